"""The context's threads: a persistent ggml threadpool (engine.thread_poll)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from proxy.engine.binding import Context, ContextParams, Model, init_backend

PROMPT = np.array([(i * 37) % 200 + 10 for i in range(100)], dtype=np.int32)


def test_a_persistent_threadpool_gives_the_same_logits(hybrid_path: Path) -> None:
    # engine.thread_poll >= 0 attaches a ggml threadpool to the context (no threads
    # started per decode); the arithmetic is the same
    init_backend()
    with Model(hybrid_path) as model:
        out = []
        for poll in (-1, 0, 50):
            ctx = Context(model, ContextParams(n_ctx=512, n_batch=128, n_ubatch=128, threads=2,
                                               poll=poll))
            with ctx:
                assert (ctx._pool is not None) == (poll >= 0)
                out.append(ctx.prefill(0, PROMPT, 0))
    assert np.array_equal(out[0], out[1]) and np.array_equal(out[0], out[2])
