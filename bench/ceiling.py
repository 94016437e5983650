"""How fast prompt lookup could make a reply at best, on this machine: the replies a run
of ``bench.speculative`` kept (each cell's undrafted reply) replayed through the engine's
own lookup (``proxy.engine.drafting.lookup``), each step priced by what a verification
of that many tokens costs the model here (``bench.spec_models.verify_cost``, measured
beside the turn's prompt), and a step of another size than the last one's by what
building its graph anew costs (llama.cpp reuses a graph while the size stays: measured
alongside, ``switch_ms``). Two policies, no controller's mistakes in either:

- ``fixed k``: every step drafts the k tokens the lookup proposes (the best k of 1 to 8);
- ``foresight``: every step drafts exactly the tokens that will be accepted, and only
  as many as pay (with no graph to build anew, no policy can do better with these
  drafts; with one, each step's choice is the best for that step).

    python -m bench.ceiling results/speculative-real.json [--only smollm2]

It says whether a target speedup is within reach of the model's verification costs on
this machine before any policy is blamed (docs/speculative.md, "How far could any
policy take these replies?").
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from proxy.engine.drafting import lookup
from statecache.config import SpeculativeConfig

SIZES = (1, 2, 4, 9, 17)  # tokens a measured verification decodes


def interpolate(points: Sequence[tuple[int, float]]) -> Callable[[int], float]:
    """Seconds a verification of n tokens costs, from measured (n, seconds) points:
    linear between them, and beyond the last along its last segment."""
    pts = sorted(points)

    def cost(n: int) -> float:
        for (a, ca), (b, cb) in zip(pts, pts[1:], strict=False):
            if n <= b:
                return ca + (cb - ca) * (n - a) / (b - a)
        (a, ca), (b, cb) = pts[-2], pts[-1]
        return cb + (cb - ca) * (n - b) / (b - a)
    return cost


def replay(prompt: Sequence[int], reply: Sequence[int], cost: Callable[[int], float],
           k: int | None, k_max: int = 64, switch: float = 0.0) -> dict[str, float]:
    """The reply decoded step by step after ``prompt``, each step drafting from the
    engine's lookup (its copy cursor carried as the engine carries it): ``k`` drafts a
    step, or (None) exactly those that will be accepted where they pay; a step of
    another size than the one before costs ``switch`` more (its graph built anew).
    Returns the speedup over one-token steps and the share of the reply accepted from
    drafts."""
    sc = SpeculativeConfig()
    known = np.asarray(list(prompt) + list(reply), dtype=np.int32)
    n0, total, cursor, spent, taken = len(prompt), len(reply), -1, 0.0, 0
    i = 1  # the first token comes from the prefill's logits
    last = 1  # the size of the step before (undrafted steps: one token, the same graph)

    def price(n: int) -> float:
        return cost(n) + (switch if n != last else 0.0)

    while i < total:
        held = known[: n0 + i]
        room = min(k or k_max, total - i - 1)  # the step's drafts and its own token fit
        found, start, _ = lookup(held, room, sc.lookup_max, sc.lookup_min, None, cursor) \
            if room > 0 else (np.empty(0, np.int32), -1, 0)
        right = 0
        for j, d in enumerate(found.tolist()):
            if reply[i + j] != d:
                break
            right = j + 1
        if k is None:  # of the tokens that will be accepted, the count that pays best
            drafted = max(range(right + 1), key=lambda m: ((1 + m) / price(1 + m), -m))
            accepted = drafted
        else:
            drafted, accepted = len(found), right
        spent += price(1 + drafted)
        last = 1 + drafted
        cursor = start + accepted + 1 if start >= 0 else -1
        taken += accepted
        i += 1 + accepted
    steps_alone = max(total - 1, 1)
    return {"speedup": steps_alone * cost(1) / spent if spent else 1.0,
            "drafted_share": taken / steps_alone}


def ceilings(prompt: Sequence[int], reply: Sequence[int],
             cost: Callable[[int], float], switch: float = 0.0) -> dict[str, Any]:
    """The best fixed draft length and its speedup, and foresight's."""
    fixed = {k: replay(prompt, reply, cost, k, switch=switch)["speedup"] for k in range(1, 9)}
    best = max(fixed, key=lambda k: fixed[k])
    seen = replay(prompt, reply, cost, None, switch=switch)
    return {"best_k": best, "fixed": fixed[best], "foresight": seen["speedup"],
            "copied": seen["drafted_share"]}


def measure(result: dict[str, Any], only: str = "") -> list[dict[str, Any]]:
    """Each real model's cells of a ``bench.speculative`` result, replayed."""
    from bench.spec_models import picked, targets, verify_cost, workloads
    from proxy.api.render import load_chat_template
    from proxy.engine.binding import Model, init_backend

    init_backend()
    paths = {t.model.label: t for t in targets(True) if t.draft is None}
    rows = []
    for cell in result["targets"]:
        t = paths.get(cell.get("model", ""))
        if t is None or "off" not in cell or not picked(only, t.model.label):
            continue
        with Model(t.model.path) as m:
            template = load_chat_template(
                m.chat_template(), bos_token=m.token_text(m.bos) if m.bos >= 0 else "",
                eos_token=m.token_text(m.eos) if m.eos >= 0 else "")
            for name, (messages, _) in workloads().items():
                off = cell["off"].get(name)
                if not off or not off.get("reply"):
                    continue
                prompt = m.tokenize(template.render(messages), parse_special=True)
                reply = m.tokenize(off["reply"], parse_special=False)
                curve = verify_cost(t.model.path, 0, SIZES, len(prompt))
                cost = interpolate([(r["tokens"], r["ms"]) for r in curve])
                switch = switch_ms(curve)
                got = ceilings(prompt, reply, cost, switch)
                rows.append({"model": t.model.label, "workload": name,
                             "prompt": len(prompt), "reply": len(reply),
                             "measured": cell.get("auto", {}).get(name, {}).get("speedup"),
                             "verify_ms": {r["tokens"]: round(r["ms"], 2) for r in curve},
                             "switch_ms": round(switch, 2),
                             **got})
    return rows


def switch_ms(curve: Sequence[dict[str, Any]]) -> float:
    """What a step of another size than the last one's costs more (its graph built
    anew), from ``verify_cost``'s rows: each size alternating with one-token steps
    against each in a run of its own, both ways, the median over the sizes (0 at
    least: a noisy machine can make it look negative)."""
    one = next(r["ms"] for r in curve if r["tokens"] == 1)
    each = [((r["after_one_ms"] - r["ms"]) + (r["one_after_ms"] - one)) / 2
            for r in curve if "after_one_ms" in r]
    return max(float(np.median(each)), 0.0) if each else 0.0


def table(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| model | workload | prompt | reply | copied | graph anew | best fixed k | "
             "its speedup | foresight | measured (auto) |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        got = f"{r['measured']:.2f}x" if r.get("measured") else "-"
        anew = f"{r['switch_ms']:.1f} ms" if "switch_ms" in r else "-"
        lines.append(f"| {r['model']} | {r['workload']} | {r['prompt']} | {r['reply']} | "
                     f"{100 * r['copied']:.0f}% | {anew} | {r['best_k']} | "
                     f"{r['fixed']:.2f}x | {r['foresight']:.2f}x | {got} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("result", help="a bench.speculative --json file (its off replies)")
    p.add_argument("--only", default="", help="targets whose label holds any of these")
    p.add_argument("--json", default=None, help="write the rows here too")
    a = p.parse_args(argv)
    rows = measure(json.loads(Path(a.result).read_text()), a.only)
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    print("\n".join(table(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
