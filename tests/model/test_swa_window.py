"""docs/design.md fact 25: with a window-sized SWA cache (``swa_full`` off) a PARTIAL
state of Gemma 3 is its SWA cache alone, and it rolls a lane back past the window:
restore it, then ``seq_rm``, and the lane's logits are those of a lane restored from
the FULL state saved at the same point, bit for bit."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from proxy.engine.binding import FLAGS_FULL, FLAGS_PARTIAL, Context, ContextParams, Model
from proxy.engine.sizing import state_format

pytestmark = pytest.mark.model

TEXT = " ".join(
    f"Item {i}: the quick brown fox number {i * 7} jumps over {i % 13} lazy dogs."
    for i in range(400)
)


@pytest.fixture(scope="module")
def gemma(gemma_path: Path) -> Iterator[Model]:
    with Model(gemma_path) as m:
        yield m


def _window_ctx(model: Model, lanes: int = 2, swa_full: bool = False) -> Context:
    return Context(model, ContextParams(n_ctx=4096 * lanes, n_seq_max=lanes, n_batch=512,
                                        n_ubatch=512, swa_full=swa_full))


def _step(ctx: Context, lane: int, tok: int, pos: int) -> np.ndarray:
    ctx.batch.clear()
    row = ctx.batch.add(lane, [tok], pos, logits_last=True)
    ctx.decode()
    return ctx.logits(row)


@pytest.mark.parametrize("n", [600, 1000])
def test_partial_restore_then_seq_rm_rolls_back_past_the_window(gemma: Model, n: int) -> None:
    toks = gemma.tokenize(TEXT, add_special=True)[: n + 601]
    x = toks[n]
    with _window_ctx(gemma) as ctx:
        assert ctx.describe_memory().swa_window
        ctx.prefill(0, toks[:n], 0, logits_last=False)
        partial = bytes(ctx.save(0, FLAGS_PARTIAL))
        full = bytes(ctx.save(0, FLAGS_FULL))
        ctx.prefill(0, toks[n: n + 600], n, logits_last=False)
        # the window-sized cache dropped the cells token n's window needs: seq_rm alone
        # cannot bring them back (planner.can_truncate's rule refuses this cut)
        assert ctx.pos_min(0) > max(0, n - gemma.n_swa)
        assert ctx.restore(0, partial, FLAGS_PARTIAL)
        assert ctx.seq_rm(0, n, -1)
        assert ctx.pos_max(0) == n - 1
        got = _step(ctx, 0, x, n)
        assert ctx.restore(1, full, FLAGS_FULL)
        ref = _step(ctx, 1, x, n)
    assert np.array_equal(got, ref)
    # the partial state is the SWA cache alone: the base cache's n tokens are not in it
    assert len(partial) < len(full)


def test_seq_rm_alone_past_the_window_is_wrong(gemma: Model) -> None:
    # The same cut without the partial state: seq_rm returns true and the logits are
    # wrong (the cells of the window are gone), so the engine must never make it.
    n = 1000
    toks = gemma.tokenize(TEXT, add_special=True)[: n + 601]
    with _window_ctx(gemma) as ctx:
        ctx.prefill(0, toks[:n], 0, logits_last=False)
        full = bytes(ctx.save(0, FLAGS_FULL))
        ctx.prefill(0, toks[n: n + 600], n, logits_last=False)
        assert ctx.seq_rm(0, n, -1)
        got = _step(ctx, 0, toks[n], n)
        assert ctx.restore(1, full, FLAGS_FULL)
        ref = _step(ctx, 1, toks[n], n)
    assert np.abs(got - ref).max() > 0.1


def test_window_cache_writes_states_of_the_same_size(gemma: Model) -> None:
    # state_write drops the SWA cells masked relative to a lane's end (docs/design.md
    # fact 8) in both modes: a window-sized cache makes the context's KV smaller, not the
    # checkpoints
    toks = gemma.tokenize(TEXT, add_special=True)[:3000]
    sizes = {}
    for swa_full in (True, False):
        with _window_ctx(gemma, lanes=1, swa_full=swa_full) as ctx:
            ctx.prefill(0, toks, 0, logits_last=False)
            sizes[swa_full] = (ctx.state_size(0, FLAGS_FULL), ctx.state_size(0, FLAGS_PARTIAL))
    print(f"FULL, PARTIAL at 3,000 tokens: full-size {sizes[True]}, window {sizes[False]}")
    assert sizes[False] == sizes[True]


def test_the_two_settings_write_states_of_different_formats() -> None:
    # a disk tier written in one setting is never restored in the other (the pool checks
    # the state format before set_data)
    full, window = ContextParams(n_ctx=4096), ContextParams(n_ctx=4096, swa_full=False)
    assert state_format(full) != state_format(window)
    assert state_format(full, exact=True) != state_format(window, exact=True)
