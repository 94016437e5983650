"""What a prefill slice costs by its size, alone and beside a decoding lane, with the
binding alone: the measurement behind the engine's prefill bursts (proxy/engine/steps.py).

    python -m bench.chunks --model models/hybrid-mid.gguf --context 6000

One lane decodes a short conversation, another holds ``--context`` tokens of a long
prompt; each size is timed prefilled alone and together with the decoding lane's
token in one ``llama_decode`` (median of ``--repeats``). The context grows by what
each measurement prefills.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from bench.batching import _prompt
from proxy.engine.binding import Context, ContextParams, Model

SIZES = (1, 2, 4, 8, 16, 32, 48, 63, 64, 65, 96, 128, 256)


def measure(model_path: Path, context: int, sizes: tuple[int, ...], repeats: int
            ) -> dict[str, object]:
    model = Model(model_path)
    need = context + repeats * 2 * sum(sizes) + 64 + 8 + repeats
    ctx = Context(model, ContextParams(n_ctx=2 * need, n_seq_max=2, n_batch=512,
                                       n_ubatch=512, poll=50))
    try:
        short = model.tokenize(_prompt(400, 1))
        long = model.tokenize(_prompt(need * 8, 2))[:need]
        ctx.prefill(0, short, 0)
        pos = {0: len(short), 1: 0}
        while pos[1] < context:
            n = min(512, context - pos[1])
            ctx.prefill(1, long[pos[1]: pos[1] + n], pos[1])
            pos[1] += n

        def step(n_prefill: int, with_decode: bool) -> float:
            b = ctx.batch
            b.clear()
            if with_decode:
                b.add(0, [short[5]], pos[0], logits_last=True)
            if n_prefill:
                b.add(1, long[pos[1]: pos[1] + n_prefill], pos[1], logits_last=True)
            t0 = time.perf_counter()
            ctx.decode()
            dt = time.perf_counter() - t0
            pos[0] += int(with_decode)
            pos[1] += n_prefill
            return dt

        def median_ms(fn: Callable[[], float]) -> float:
            return 1000 * statistics.median(fn() for _ in range(repeats))

        for _ in range(8):  # warm-up
            step(0, True)
        decode_ms = median_ms(lambda: step(0, True))
        rows = [{"tokens": n, "alone_ms": median_ms(lambda n=n: step(n, False)),
                 "beside_decode_ms": median_ms(lambda n=n: step(n, True))} for n in sizes]
        return {"model": model_path.stem, "context": context, "decode_ms": decode_ms,
                "rows": rows}
    finally:
        ctx.close()
        model.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.chunks", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/hybrid-mid.gguf")
    p.add_argument("--context", type=int, default=6000)
    p.add_argument("--sizes", default=",".join(map(str, SIZES)))
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    res = measure(Path(a.model), a.context, tuple(int(x) for x in a.sizes.split(",")),
                  a.repeats)
    print(f"{res['model']}, {res['context']:,} tokens of context; a decode step "
          f"{res['decode_ms']:.2f} ms")
    print("| tokens | alone ms | ms a token | beside a decoding lane ms |")
    print("|---|---|---|---|")
    for r in res["rows"]:  # type: ignore[attr-defined]
        print(f"| {r['tokens']} | {r['alone_ms']:.1f} | {r['alone_ms'] / r['tokens']:.2f} "
              f"| {r['beside_decode_ms']:.1f} |")
    json.dump(res, sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
