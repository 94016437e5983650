"""Why exact mode (``cache.exact``) runs one lane a step: a row's logits depend on the
other lanes' rows in its ``llama_decode`` (docs/exact.md, "The default mode").

Measured on every memory kind: a decoding lane's row beside another lane's decode row,
and a prefill chunk beside another lane's decode row, against the same row in a batch of
its own. On each model at least one of the two differs, so a cold server's reply (its
steps alone, one request at a time) is reproduced only by steps alone. If a llama.cpp
upgrade makes both bitwise equal on every model, these tests fail and exact mode may
batch lanes again.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from proxy.engine.binding import Context, ContextParams, Model

pytestmark = pytest.mark.model

TEXT = " ".join(f"Item {i}: the quick brown fox number {i * 7} jumps over {i % 13} lazy dogs."
                for i in range(400))


def _rows(model: Model) -> tuple[float, float]:
    """Largest differences: (a decode row beside another lane's decode row, a prefill
    chunk's last row beside another lane's decode row), each against the row alone."""
    toks = model.tokenize(TEXT, add_special=True)
    a, b = toks[:300], toks[300:620]

    def row(work: list[int], beside: bool) -> np.ndarray:
        with Context(model, ContextParams(n_ctx=4096, n_seq_max=2, n_batch=512, n_ubatch=512,
                                          threads=1)) as ctx:
            ctx.prefill(0, a, 0, logits_last=False)
            ctx.prefill(1, b, 0, logits_last=False)
            ctx.batch.clear()
            r = ctx.batch.add(0, work, len(a), logits_last=True)
            if beside:
                ctx.batch.add(1, [b[0]], len(b), logits_last=True)
            ctx.decode()
            return ctx.logits(r).copy()

    def diff(work: list[int]) -> float:
        return float(np.max(np.abs(row(work, False) - row(work, True))))

    return diff([a[0]]), diff(a[:200])


@pytest.mark.parametrize("which", ["draft", "hybrid", "smollm2", "gemma"])
def test_a_row_beside_another_lanes_is_other_arithmetic(
        which: str, request: pytest.FixtureRequest) -> None:
    path: Path
    if which == "smollm2":
        from proxy.models import smollm2_path
        path = smollm2_path()
    else:
        path = request.getfixturevalue(f"{which}_path")
    with Model(path) as model:
        decode, prefill = _rows(model)
    # measured here: llama 9.5e-7 and 0; hybrid 0.0070 and 0.0045; SmolLM2 0 and 0.80;
    # Gemma 3 0 and 0.89
    assert decode > 0 or prefill > 0, (
        f"{which}: a row beside another lane's is bitwise the row alone in both shapes; "
        "exact mode may batch lanes (docs/exact.md)")



def test_an_swa_state_restored_on_the_grid_past_its_window_is_the_live_lane(
        gemma_path: Path) -> None:
    """Why exact mode restores Gemma 3 past its window (docs/exact.md): a state after 1,024
    tokens prefilled in ubatches of 512 from token 0, restored into another lane, holds
    fewer SWA cells than the live lane (docs/design.md fact 12), yet the next ubatch gives
    the live lane's logits bitwise. Off the grid they differ (test_facts.py's
    test_swa_restore_beyond_window_changes_cell_layout, restored after 699 tokens)."""
    with Model(gemma_path) as model:
        toks = model.tokenize(TEXT, add_special=True)[:1324]
        with Context(model, ContextParams(n_ctx=4096, n_seq_max=2, n_batch=512, n_ubatch=512,
                                          threads=1)) as ctx:
            for k in (0, 512):
                ctx.prefill(0, toks[k:k + 512], k, logits_last=False)
            assert ctx.restore(1, bytes(ctx.save(0)))
            assert ctx.pos_min(0) == 0 and ctx.pos_min(1) > 0  # fewer cells
            rows = []
            for lane in (0, 1):
                ctx.batch.clear()
                r = ctx.batch.add(lane, toks[1024:], 1024, logits_last=True)
                ctx.decode()
                rows.append(ctx.logits(r).copy())
    assert np.array_equal(rows[0], rows[1])
