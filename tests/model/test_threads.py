"""The context's threads: a persistent ggml threadpool (engine.thread_poll)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from proxy.engine.binding import Context, ContextParams, Model, init_backend

PROMPT = np.array([(i * 37) % 200 + 10 for i in range(100)], dtype=np.int32)


@pytest.mark.parametrize("which", ["hybrid", "gemma"])
def test_a_persistent_threadpool_gives_the_same_logits(
    which: str, request: pytest.FixtureRequest
) -> None:
    # engine.thread_poll >= 0 attaches a ggml threadpool to the context (no threads
    # started per decode); the arithmetic is the same, over a prefill and decodes. Gemma 3
    # (Q4_K) caught a pool made by a second copy of libggml-cpu: NaN logits.
    init_backend()
    path: Path = request.getfixturevalue(f"{which}_path")
    with Model(path) as model:
        out = []
        for poll in (-1, 0, 50):
            ctx = Context(model, ContextParams(n_ctx=512, n_batch=128, n_ubatch=128, threads=2,
                                               poll=poll))
            with ctx:
                assert (ctx._pool is not None) == (poll >= 0)
                rows = [ctx.prefill(0, PROMPT, 0)]
                for i in range(4):
                    rows.append(ctx.prefill(0, [int(np.argmax(rows[-1]))], len(PROMPT) + i))
                out.append(np.stack(rows))
    assert np.isfinite(out[0]).all()
    assert np.array_equal(out[0], out[1]) and np.array_equal(out[0], out[2])


def test_a_draft_decodes_on_its_targets_threadpool(spec_target_path: Path,
                                                   spec_draft_path: Path) -> None:
    # the engine's draft context shares the target's pool (one thread drives both: no
    # second pool polls while the other computes); its logits are its own, and closing
    # it leaves the target's pool working
    init_backend()
    with Model(spec_target_path) as target, Model(spec_draft_path) as draft:
        alone = Context(draft, ContextParams(n_ctx=512, threads=2, poll=-1))
        with alone:
            want = alone.prefill(0, PROMPT, 0)
        t = Context(target, ContextParams(n_ctx=512, threads=2, poll=50))
        with t:
            d = Context(draft, ContextParams(n_ctx=512, threads=2, poll=50))
            own = d._pool
            assert own is not None and d.share_threads(t)
            assert d._pool == t._pool and not d._pool_owned
            got = d.prefill(0, PROMPT, 0)
            d.close()  # detaches, does not free the target's pool
            assert t.prefill(0, PROMPT, 0) is not None
        assert np.array_equal(want, got)
    # nothing to share: a context without a pool keeps its own threads
    with Model(spec_draft_path) as draft:
        a = Context(draft, ContextParams(n_ctx=512, threads=2, poll=-1))
        b = Context(draft, ContextParams(n_ctx=512, threads=2, poll=-1))
        with a, b:
            assert not b.share_threads(a) and b._pool is None


def test_the_engine_gives_its_draft_the_targets_threadpool_by_default(
    spec_target_path: Path, spec_draft_path: Path, tmp_path: Path
) -> None:
    from proxy.engine.engine import Engine
    from statecache.config import load_config

    cfg = load_config(None, {"model.path": str(spec_target_path),
                             "engine.sanity_checks": True, "model.threads": 2,
                             "model.draft_path": str(spec_draft_path), "model.n_ctx": 512,
                             "server.lanes": 1, "speculative.source": "draft",
                             "cache.disk_path": str(tmp_path / "ck")})
    assert cfg.engine.thread_poll >= 0  # the default: a persistent pool
    eng = Engine(cfg, spec_target_path)
    try:
        assert eng.draft is not None and eng.ctx._pool is not None
        assert eng.draft.ctx._pool == eng.ctx._pool
    finally:
        eng.close()
