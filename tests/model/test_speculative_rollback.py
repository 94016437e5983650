"""Rolling rejected drafts back, per memory kind, as the executor does it: after a
verification batch (the last accepted token plus drafts, all with logits) whose tail is
rejected, the next logits must be those of a run that never saw the rejected tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from proxy.engine.binding import FLAGS_PARTIAL, Context, ContextParams, Model, init_backend
from tests.busy import THREADS

PROMPT = np.array([(i * 37) % 200 + 10 for i in range(100)], dtype=np.int32)
PENDING, DRAFTS, ACCEPTED, NEXT = 50, [60, 61, 62, 63], 2, 77
KEEP = len(PROMPT) + 1 + ACCEPTED  # prompt, pending and the accepted drafts


@pytest.fixture(scope="module", autouse=True)
def _backend() -> None:
    init_backend()


def _ctx(model: Model, n_rs_seq: int = 0) -> Context:
    ctx = Context(model, ContextParams(n_ctx=1024, n_seq_max=2, n_batch=256, n_ubatch=256,
                                       n_rs_seq=n_rs_seq, threads=THREADS))
    ctx.prefill(0, PROMPT, 0, logits_last=False)
    return ctx


def _decode(ctx: Context, tokens: list[int], pos0: int, logits_from: int = -1) -> np.ndarray:
    b = ctx.batch
    b.clear()
    b.add(0, tokens, pos0, logits_last=True, logits_from=logits_from)
    ctx.decode()
    return ctx.logits(-1)


def _after_rejection(ctx: Context, rejected: list[int], *, staged: bool) -> np.ndarray:
    """Verify pending + accepted + ``rejected`` drafts, roll the rejected ones back, and
    return the logits of the next token."""
    n = len(PROMPT)
    saved = bytes(ctx.save(0, FLAGS_PARTIAL)) if staged else b""
    _decode(ctx, [PENDING, *DRAFTS[:ACCEPTED], *rejected], n, logits_from=0)
    if not staged:
        assert ctx.seq_rm(0, KEEP, -1)
        return _decode(ctx, [NEXT], KEEP)
    # no rollback in the memory: the staged partial state, then the attention cells (fact
    # 7), then the accepted tokens again with the next one
    assert ctx.restore(0, saved, FLAGS_PARTIAL)
    assert ctx.seq_rm(0, n, -1)
    return _decode(ctx, [PENDING, *DRAFTS[:ACCEPTED], NEXT], n)


def _never_saw_them(ctx: Context, *, staged: bool) -> np.ndarray:
    n = len(PROMPT)
    if staged:
        return _decode(ctx, [PENDING, *DRAFTS[:ACCEPTED], NEXT], n)
    _decode(ctx, [PENDING, *DRAFTS[:ACCEPTED]], n, logits_from=0)
    return _decode(ctx, [NEXT], KEEP)


@pytest.mark.parametrize("which", ["hybrid", "draft", "norollback"])
def test_rollback_is_bitwise_exact(which: str, request: pytest.FixtureRequest) -> None:
    # hybrid: n_rs_seq = drafts + 1 snapshots (docs/design.md fact 11: one ubatch); draft: plain
    # attention, seq_rm; norollback: jamba has no snapshots, so the state is staged
    path: Path = request.getfixturevalue(f"{which}_path")
    staged = which == "norollback"
    with Model(path) as model:
        rs = len(DRAFTS) + 1 if which == "hybrid" else 0
        with _ctx(model, rs) as a, _ctx(model, rs) as b:
            got = _after_rejection(a, DRAFTS[ACCEPTED:], staged=staged)
            want = _never_saw_them(b, staged=staged)
    assert np.array_equal(got, want), float(np.abs(got - want).max())


def test_hybrid_without_snapshots_cannot_drop_drafts(hybrid_path: Path) -> None:
    # why the engine sets n_rs_seq when it drafts: without it seq_rm refuses (docs/design.md fact 5)
    with Model(hybrid_path) as model, _ctx(model) as ctx:
        _decode(ctx, [PENDING, *DRAFTS], len(PROMPT), logits_from=0)
        assert not ctx.seq_rm(0, KEEP, -1)


def test_swa_rollback_forgets_the_rejected_tokens(gemma_path: Path) -> None:
    # Gemma 3 (SWA, every cell kept): after seq_rm the logits do not depend on what was
    # rejected, bitwise; against a run that never had those cells they differ only by
    # where the new token's cell lands (docs/design.md fact 10's scale), with the same greedy token.
    with Model(gemma_path) as model, _ctx(model) as a, _ctx(model) as b, _ctx(model) as c:
        one = _after_rejection(a, DRAFTS[ACCEPTED:], staged=False)
        other = _after_rejection(b, [5, 6], staged=False)
        never = _never_saw_them(c, staged=False)
    assert np.array_equal(one, other)
    assert int(np.argmax(one)) == int(np.argmax(never))
    assert float(np.abs(one - never).max()) < 2.0

