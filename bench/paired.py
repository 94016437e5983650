"""Two systems run by run: the ratio of their runs in each repeat (seconds apart, in the
same stretch of the machine's drift), its median over the repeats and a confidence
interval that assumes nothing about their distribution; and the table of them."""

from __future__ import annotations

import math
import statistics
from typing import Any

from bench.tables import md_table, streams


def median_ci(xs: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """A confidence interval of the median of ``xs`` that assumes nothing about their
    distribution: the k-th lowest and k-th highest value, with k the largest for which
    the median falls outside with a chance under ``1 - level`` (a binomial(n, 1/2) tail
    on each side). None where no k is enough (at 95%: under 6 values)."""
    s = sorted(xs)
    n = len(s)
    tail = (1 - level) / 2
    k, below = 0, 0.0  # below: P(binomial(n, 1/2) <= k - 1)
    while k + 1 <= n - k:
        nxt = below + math.comb(n, k) / 2 ** n
        if nxt > tail:
            break
        k, below = k + 1, nxt
    return (s[k - 1], s[n - k]) if k else None


def paired(runs: dict[str, dict[str, list[float]]], a: str, b: str
           ) -> dict[str, dict[str, float]]:
    """``a`` against ``b`` per stream count: the ratio of the two systems' runs in each
    repeat (seconds apart, in the same stretch of the machine's drift), as the median
    over repeats, its 95% confidence interval (``median_ci``), and the lowest and
    highest (the ratio of the medians, which mixes runs minutes apart, is
    ``decode_tps``'s)."""
    out: dict[str, dict[str, float]] = {}
    for c, xs in runs[a].items():
        # a run with no span where every stream decoded at once has no rate (NaN)
        ratios = sorted(x / y for x, y in zip(xs, runs[b][c], strict=True)
                        if math.isfinite(x) and math.isfinite(y) and y > 0)
        if ratios:
            out[c] = {"median": statistics.median(ratios), "low": ratios[0],
                      "high": ratios[-1], "n": len(ratios)}
            ci = median_ci(ratios)
            if ci is not None:  # too few repeats: the lowest and highest only
                out[c]["ci_low"], out[c]["ci_high"] = ci
    return out


def table(b: dict[str, Any]) -> list[str]:
    """statecache against the binding, llama-server and any other system it was paired
    with (``bench.batching --against``), run by run (bench.batching.paired): the median
    ratio with its 95% confidence interval (too few repeats for one, or results from
    before it: with the lowest and highest)."""
    rows = []
    others = [("binding", "the binding"), ("llama-server", "llama-server")]
    others += [(k, k) for k in (key.removeprefix("paired_statecache_") for key in b
                                if key.startswith("paired_statecache_"))
               if k not in ("binding", "llama-server")]
    with_ci = True
    for other, label in others:
        p = b.get(f"paired_statecache_{other}")
        if isinstance(p, dict) and p:
            cells = []
            for c in ("1", "2", "4"):
                if c not in p:
                    cells.append("–")
                    continue
                lo, hi = p[c].get("ci_low"), p[c].get("ci_high")
                if lo is None or hi is None:
                    with_ci, lo, hi = False, p[c]["low"], p[c]["high"]
                cells.append(f"{p[c]['median']:.3f} ({lo:.2f}–{hi:.2f})")
            rows.append([f"statecache ÷ {label}", *cells])
    if not rows:
        return []
    ns = {q["n"] for k, p in b.items() if k.startswith("paired_statecache_")
          and isinstance(p, dict) for q in p.values() if "n" in q}
    n = ns.pop() if len(ns) == 1 else None
    brackets = ("its 95% confidence interval (between the k-th lowest and the k-th highest "
                "ratio, whatever their distribution" + (f", of {n} repeats" if n else "")
                + ")") if with_ci else "the lowest and highest"
    return ["", "The same ratios run by run: in each repeat, statecache's run against the "
            "other system's in the same turn, seconds apart; the median over the repeats "
            f"and, in brackets, {brackets}:", ""] + md_table(
        ["", *(streams(c) for c in ("1", "2", "4"))], rows)


