"""One prompt prefilled in different step layouts, in one context, in turn: what the
cuts a cold prefill makes (a checkpoint at a breakpoint or a share point ends a step
there) cost inside ``llama_decode`` when nothing else differs (issue 46's cold turn).

    python -m bench.step_layout --tokens 19664 --cuts 1490,18197 --layouts forward,engine

Layouts: ``grid`` (steps of 512 from the start, the last one short: llama-server's, and
the engine's where nothing cuts), ``forward`` (a step ends at each cut, each stretch
filled from its start: the engine's layout before 2026-12-06) and ``engine`` (the same
cuts as ``layout.step_ends`` lays them: a stretch between two cuts short step first).
One context as the engine makes it (two lanes, 2 threads, a window-sized SWA cache,
Gemma 3 270M); each prefill starts from an empty lane. It prints each layout's time
inside ``llama_decode``, in all and from the step that starts at ``--past`` on, and each
layout's ratio to the first of ``--layouts``, pair by pair (median and 95% CI).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from bench.cold_prefill import prompt_text
from bench.paired import median_ci
from proxy.engine.layout import step_ends, stretch_ends
from proxy.models import gemma_model_path

CHUNK = 512


def forward_ends(cuts: Sequence[int], *, end: int, chunk: int) -> list[int]:
    """Step ends with a step ending at each cut, each stretch filled from its start (its
    short step last, as the engine lays only the last stretch now): the engine's layout
    before 2026-12-06."""
    out: list[int] = []
    pos = 0
    for cut in sorted({c for c in cuts if 0 < c < end} | {end}):
        out += stretch_ends(pos, cut, chunk, last=True)
        pos = cut
    return out


def layouts(cuts: Sequence[int], end: int) -> dict[str, list[int]]:
    return {
        "grid": forward_ends([], end=end, chunk=CHUNK),
        "forward": forward_ends(cuts, end=end, chunk=CHUNK),
        "engine": step_ends(cuts, reuse=0, end=end, chunk=CHUNK),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.step_layout", description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=19664)
    ap.add_argument("--cuts", default="1490,18197")
    ap.add_argument("--past", type=int, default=17000)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--layouts", default="grid,forward,engine")
    a = ap.parse_args(argv)
    from proxy.engine.binding import init_backend
    from proxy.engine.binding.context import Context, ContextParams
    from proxy.engine.binding.model import Model

    cuts = [int(x) for x in a.cuts.split(",") if x]
    every = layouts(cuts, a.tokens)
    names = a.layouts.split(",")
    if unknown := [n for n in names if n not in every]:
        ap.error(f"--layouts: unknown {unknown}")
    init_backend()
    model = Model(gemma_model_path())
    toks = model.tokenize(prompt_text(a.tokens // 3), add_special=True)
    if len(toks) < a.tokens:
        ap.error("the generated prompt is too short for --tokens")
    toks = toks[:a.tokens]
    ctx = Context(model, ContextParams(n_ctx=2 * 32768, n_seq_max=2, threads=2, poll=50,
                                       swa_full=False))
    for n in names:
        ends = every[n]
        sizes = [e - s for s, e in zip([0, *ends], ends, strict=False) if s >= a.past]
        print(f"{n}: {len(ends)} steps, sizes past {a.past:,}: {sizes}", flush=True)
    took: dict[str, list[tuple[float, float]]] = {n: [] for n in names}
    for r in range(a.repeats):
        order = names if r % 2 == 0 else names[::-1]
        for n in order:
            ctx.seq_rm(0, -1, -1)
            total = past = 0.0
            pos = 0
            for e in every[n]:
                ctx.batch.clear()
                ctx.batch.add(0, toks[pos:e], pos, logits_last=True)
                t0 = time.perf_counter()
                ctx.decode()
                dt = time.perf_counter() - t0
                total += dt
                if pos >= a.past:
                    past += dt
                pos = e
            took[n].append((total, past))
            print(f"repeat {r + 1} {n}: {total:.2f} s, past {a.past:,}: {past:.2f} s",
                  flush=True)
    base = names[0]
    print(f"\n| layout | steps | s inside llama_decode (median) | from {a.past:,} | "
          f"÷ {base}, all (95% CI) | ÷ {base}, from there |")
    print("|---|---:|---:|---:|---:|---:|")
    for n in names:
        tot = sorted(t for t, _ in took[n])
        pst = sorted(p for _, p in took[n])
        cells = []
        for i in (0, 1):
            if n == base:
                cells.append("")
                continue
            ratios = [x[i] / g[i] for x, g in zip(took[n], took[base], strict=True) if g[i] > 0]
            ci = median_ci(ratios)
            mid = sorted(ratios)[len(ratios) // 2] if ratios else 0.0
            cells.append(f"{mid:.3f}" + (f" ({ci[0]:.3f}-{ci[1]:.3f})" if ci else ""))
        print(f"| {n} | {len(every[n])} | {tot[len(tot) // 2]:.2f} | {pst[len(pst) // 2]:.2f} | "
              f"{cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
