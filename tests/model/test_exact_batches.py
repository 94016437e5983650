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

