"""The tables of ``bench.replay``: statecache's TTFT against the other systems' on the
agents' own requests, by kind of request, and where statecache's time went.

Ratios are paired: a request's time on statecache over the same request's time on the
other system in the same repeat (seconds apart, the same stretch of the machine's
drift); the median over requests and repeats, with its 95% confidence interval
(``bench.paired.median_ci``: order statistics, no assumption on the distribution).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.paired import median_ci

KINDS = ("cold", "new session", "follow-up")
# statecache's phases (GET /admin/requests phases_ms), in the order a request meets them
PHASES = (("http", "HTTP side: body, render, tokenize, points"), ("render", "  render"),
          ("tokenize", "  tokenize"), ("queue", "queue"), ("plan", "plan"),
          ("hand-off", "  hand-off (in plan)"), ("restore", "  restore (in plan)"),
          ("prefill", "prefill (admission to token one)"),
          ("llama_decode", "  inside llama_decode"), ("checkpoints", "  checkpoints saved"))
Row = dict[str, Any]


def _ok(r: Row) -> bool:
    return 200 <= int(r["status"]) < 300


def ratios(results: Iterable[Row], a: str, b: str) -> dict[tuple[str, str], list[float]]:
    """(fixture, kind) -> each request's TTFT on ``a`` over its TTFT on ``b``, in the
    same repeat; requests either system refused are left out."""
    by: dict[tuple[str, int, int], dict[str, Row]] = defaultdict(dict)
    for r in results:
        if r["kind"] in KINDS:
            by[(r["fixture"], r["repeat"], r["index"])][r["system"]] = r
    out: dict[tuple[str, str], list[float]] = defaultdict(list)
    for (fixture, _, _), pair in sorted(by.items()):
        x, y = pair.get(a), pair.get(b)
        if x is not None and y is not None and _ok(x) and _ok(y) and y["ttft_s"] > 0:
            out[(fixture, x["kind"])].append(x["ttft_s"] / y["ttft_s"])
    return out


def ratio_cell(xs: list[float]) -> str:
    """``median (low–high) n``: the 95% interval, or the range where too few for one."""
    if not xs:
        return "n/a"
    ci = median_ci(xs)
    lo, hi = ci if ci is not None else (min(xs), max(xs))
    mark = "" if ci is not None else " (range)"
    return f"{statistics.median(xs):.3f} ({lo:.2f}–{hi:.2f}{mark}), n={len(xs)}"


def _med(xs: Iterable[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return statistics.median(v) if v else None


def _f(x: float | None, spec: str = ".3f") -> str:
    return "n/a" if x is None else format(x, spec)


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(r) + " |" for r in rows)]


def _reused(results: list[Row], fixture: str, system: str) -> float | None:
    """Tokens reused over the whole replay (median over repeats)."""
    per: dict[int, int] = defaultdict(int)
    for r in results:
        if r["fixture"] == fixture and r["system"] == system and r["kind"] in KINDS \
                and r.get("cached_tokens") is not None:
            per[r["repeat"]] += int(r["cached_tokens"])
    return _med(per.values())


def table(data: dict[str, Any]) -> list[str]:
    """The report: TTFT by fixture and kind with the paired ratios, then statecache's
    phases by kind."""
    results: list[Row] = data["results"]
    systems: list[str] = data["systems"]
    others = [s for s in systems if s != "statecache"]
    pairs = {o: ratios(results, "statecache", o) for o in others}
    head = ["agent (model)", "requests", "kind", *(f"{s} TTFT s" for s in systems),
            *(f"statecache ÷ {o}: median (95% CI)" for o in others),
            "statecache outside llama_decode ms (% of TTFT)"]
    rows: list[list[str]] = []
    for fixture, meta in data["fixtures"].items():
        for kind in KINDS:
            mine = [r for r in results if r["fixture"] == fixture and r["kind"] == kind
                    and _ok(r)]
            if not mine:
                continue
            sc = [r for r in mine if r["system"] == "statecache"]
            outside = _med(r["server"].get("outside_ms") for r in sc)
            share = _med(r["server"]["outside_ms"] / (10 * r["server"]["ttft_s"])
                         for r in sc if r["server"].get("outside_ms") is not None
                         and r["server"].get("ttft_s"))
            n = len({r["index"] for r in sc})
            rows.append([f"{meta['agent']} ({meta['model']})", str(n), kind,
                         *(_f(_med(r["ttft_s"] for r in mine if r["system"] == s))
                           for s in systems),
                         *(ratio_cell(pairs[o].get((fixture, kind), [])) for o in others),
                         f"{_f(outside, '.1f')} ({_f(share, '.1f')}%)"])
    for kind in KINDS:  # Claude Code and Codex together: what the issue asks of them
        cells = [ratio_cell([x for (fx, k), xs in pairs[o].items() if k == kind
                             and data["fixtures"][fx]["agent"] in ("claude", "codex")
                             for x in xs]) for o in others]
        if any(c != "n/a" for c in cells):
            rows.append(["Claude Code and Codex", "", kind, *([""] * len(systems)), *cells,
                         ""])
    out = [f"{data['repeats']} repeats, {data['lanes']} lanes, {data['threads']} threads; "
           "TTFT: the time to a reply of one token (medians over requests and repeats).", ""]
    out += _table(head, rows)
    out += ["", "Tokens reused over each whole replay (median over repeats):", ""]
    out += _table(["agent (model)", *systems],
                  [[f"{m['agent']} ({m['model']})",
                    *(_f(_reused(results, fx, s), ",.0f") for s in systems)]
                   for fx, m in data["fixtures"].items()])
    out += ["", "Where statecache's time to the first token went, by kind (median ms over "
            "its requests; GET /admin/requests):", ""]
    rows = []
    for key, label in PHASES:
        rows.append([label, *(_f(_med(r["server"].get("phases_ms", {}).get(key)
                                      for r in results if r["system"] == "statecache"
                                      and r["kind"] == k and _ok(r)), ".1f")
                              for k in KINDS)])
    sc = [r for r in results if r["system"] == "statecache" and _ok(r) and r["server"]]
    rows.append(["prefill steps", *(_f(_med(r["server"].get("phases_ms", {}).get(
        "prefill_steps") for r in sc if r["kind"] == k), ".0f") for k in KINDS)])
    rows.append(["outside llama_decode (server TTFT − llama_decode)",
                 *(_f(_med(r["server"].get("outside_ms") for r in sc if r["kind"] == k), ".1f")
                   for k in KINDS)])
    rows.append(["server TTFT", *(_f(_med(1000 * r["server"]["ttft_s"] for r in sc
                                          if r["kind"] == k and r["server"].get("ttft_s")),
                                     ".1f") for k in KINDS)])
    rows.append(["client TTFT", *(_f(_med(1000 * r["ttft_s"] for r in sc if r["kind"] == k),
                                     ".1f") for k in KINDS)])
    rows.append(["outside the server (client TTFT − server TTFT)",
                 *(_f(_med(1000 * (r["ttft_s"] - r["server"]["ttft_s"]) for r in sc
                           if r["kind"] == k and r["server"].get("ttft_s")), ".1f")
                   for k in KINDS)])
    out += _table(["", *KINDS], rows)
    return out


TITLE = "## The agents' own requests, replayed"
INTRO = ("`bench.replay`: what Claude Code, the Codex CLI and opencode sent "
         "(bench/fixtures/agents, recorded by `make agents`), sent again to "
         "statecache and llama-server side by side: fresh servers each repeat, "
         "the same model, threads and batch, the two taking turns request by "
         "request; each request greedy with a reply of one token.")


COLD_TURN = ("What each change did to Claude Code's cold turn, commit by commit, and where "
             "its time goes: [cold-turn.md](cold-turn.md) (by hand; `make bench` leaves it).")


def section(data: dict[str, Any], command: str = "", note: str = "") -> list[str]:
    """The replay's section of docs/benchmarks.md (and of bench.run's report)."""
    said = f" `{command}`, {data.get('seconds', 0) / 60:.0f} min." if command else ""
    return [TITLE, "", INTRO + said, "", *([note, ""] if note else []), *table(data), "",
            COLD_TURN, ""]


def into_doc(doc: Path, data: dict[str, Any], command: str, note: str = "") -> None:
    """Write the replay's section into ``doc`` in place of the one there (the rest of
    the page is ``make bench``'s): before "Batched steps under load", else the end."""
    lines = doc.read_text().splitlines() if doc.exists() else []
    new = section(data, command, note) + [f"_Written by `{command}` on "
                                    f"{time.strftime('%Y-%m-%d %H:%M %Z')}._", ""]
    heads = [i for i, ln in enumerate(lines) if ln.startswith("## ")]
    if TITLE in lines:
        at = lines.index(TITLE)
        end = next((i for i in heads if i > at), len(lines))
        lines[at:end] = new
    else:
        at = next((i for i in heads if lines[i] in ("## Batched steps under load",
                                                   "## Wall time per part")), len(lines))
        lines[at:at] = new
    doc.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.replay_report",
                                 description="the tables of a bench.replay run")
    ap.add_argument("json", type=Path, help="what bench.replay --json wrote")
    ap.add_argument("--docs", type=Path, help="write the section into this page "
                    "(docs/benchmarks.md) in place of the one there")
    ap.add_argument("--note", default="", help="a line said before the tables (--docs)")
    a = ap.parse_args(argv)
    data = json.loads(a.json.read_text())
    if a.docs is not None:
        into_doc(a.docs, data, str(data.get("command", "python -m bench.replay")), a.note)
    print("\n".join(table(data)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
