"""The ideal follow-up TTFT's prefill part: a follow-up's new tokens prefilled at
the context length where they land, by ``proxy.engine.binding`` alone (no HTTP,
no planner, no checkpoints).

    python -m bench.ideal --model PATH --shapes shapes.json --json out.json

``shapes.json`` is a list of sessions, each a list of ``[base, new]`` pairs in
turn order (``base``: the tokens the server already held, ``new``: what it had
never seen). One lane walks each session: it prefills up to ``base`` untimed,
saves its state, then prefills ``new`` tokens ``--repeats`` times, restoring the
state at ``base`` before each, and keeps the median. The bench adds the
server's own restore time to this to get the ideal TTFT. Run in its own process
so the model it loads is gone before anything else runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.micro import _prompt_tokens
from bench.servers import N_BATCH, THREADS


def measure(model_path: str, sessions: list[list[tuple[int, int]]], n_ctx: int,
            repeats: int) -> list[list[float]]:
    from proxy.engine.binding import FLAGS_FULL, Context, ContextParams, Model

    model = Model(model_path)
    ctx = Context(model, ContextParams(n_ctx=n_ctx, n_seq_max=1, n_batch=N_BATCH,
                                       n_ubatch=N_BATCH, threads=THREADS))
    out: list[list[float]] = []
    try:
        for i, shapes in enumerate(sessions):
            longest = max((b + n for b, n in shapes), default=0)
            toks = _prompt_tokens(model, longest + 1, 500 + i)
            ctx.clear_all()
            pos = 0
            times: list[float] = []
            for base, new in shapes:
                if base < pos or base + new > len(toks):
                    raise ValueError(f"shapes must grow within a session: {shapes}")
                if base > pos:  # untimed
                    ctx.prefill(0, toks[pos:base], pos, logits_last=False)
                state = bytes(ctx.save(0, FLAGS_FULL))
                ts = []
                for _ in range(max(1, repeats)):
                    if not ctx.restore(0, state, FLAGS_FULL):
                        raise RuntimeError("restore failed")
                    t0 = time.perf_counter()
                    logits = ctx.prefill(0, toks[base:base + new], base)  # in n_batch chunks
                    if new and logits is None:
                        raise RuntimeError("no logits for the last new token")
                    ts.append(time.perf_counter() - t0)
                times.append(statistics.median(ts) if new else 0.0)
                pos = base + new
            out.append(times)
    finally:
        ctx.close()
        model.close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.ideal", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--shapes", required=True, help="JSON: sessions of [base, new] pairs")
    p.add_argument("--json", required=True, help="output: seconds per pair, same nesting")
    p.add_argument("--n-ctx", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    sessions: Any = json.loads(Path(a.shapes).read_text())
    shapes = [[(int(b), int(n)) for b, n in s] for s in sessions]
    Path(a.json).write_text(json.dumps(measure(a.model, shapes, a.n_ctx, a.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
