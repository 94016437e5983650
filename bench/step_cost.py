"""What one prefill step of ``n`` tokens costs inside ``llama_decode``, at a given depth:
how a step's size, not only its number of tokens, sets its cost (docs/design.md fact 26).

    python -m bench.step_cost --depth 16384 --sizes 128,256,323,384,443,448,512

One context as the server makes it (Gemma 3, a window-sized SWA cache, 512-token
ubatches), a prompt prefilled to ``--depth`` tokens in steps of 512; then each size is
decoded there, the lane cut back to the depth with ``seq_rm`` (a window-sized cache
reaches a step back, design.md fact 25), ``--repeats`` times in turn. It prints each
size's fastest time and its ms per token.
"""

from __future__ import annotations

import argparse
import time

from proxy.engine.binding import Model
from proxy.engine.binding.context import Context, ContextParams
from proxy.models import gemma_model_path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.step_cost", description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=16384)
    ap.add_argument("--sizes", default="128,256,323,384,443,448,512")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="0: the binding's default")
    a = ap.parse_args(argv)
    sizes = [int(x) for x in a.sizes.split(",")]
    if not sizes or min(sizes) < 1 or max(sizes) > 512:
        ap.error("--sizes: steps of 1 to 512 tokens")
    model = Model(gemma_model_path())
    params = ContextParams(n_ctx=2 * (a.depth + 1024), n_seq_max=2, n_batch=512,
                           n_ubatch=512, swa_full=False)
    if a.threads:
        params.threads = a.threads
    ctx = Context(model, params)
    words = " ".join(f"rule {i}: every session of this agent shares it;"
                     for i in range(a.depth // 4 + 300))
    toks = model.tokenize(words)[:a.depth + 512]
    if len(toks) < a.depth + max(sizes):
        ap.error("the generated prompt is too short for --depth")
    for i in range(0, a.depth, 512):
        ctx.batch.clear()
        ctx.batch.add(0, toks[i:min(i + 512, a.depth)], i, logits_last=True)
        ctx.decode()
    took: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in range(a.repeats):
        for n in sizes:
            ctx.batch.clear()
            ctx.batch.add(0, toks[a.depth:a.depth + n], a.depth, logits_last=True)
            t0 = time.perf_counter()
            ctx.decode()
            took[n].append(time.perf_counter() - t0)
            if not ctx.seq_rm(0, a.depth, -1):
                raise SystemExit("seq_rm failed: the lane cannot be cut back to the depth")
    print(f"depth {a.depth:,}, fastest of {a.repeats}:")
    print("| step tokens | s | ms per token |")
    print("|---:|---:|---:|")
    for n in sizes:
        best = min(took[n])
        print(f"| {n} | {best:.3f} | {1000 * best / n:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
