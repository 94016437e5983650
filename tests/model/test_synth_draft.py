"""The generated target/draft pair of tools/synth_gguf.py (issue 9, item 5):
the draft is exactly the target's first layers and head, and its greedy
choices agree with the target's often but not always."""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import pytest

from tools import synth_gguf
from tools.synth_gguf import DRAFTS, VOCAB, ensure

pytestmark = pytest.mark.model

PAIR = DRAFTS["spec-target"]
# Greedy agreement over 2 prompts x 64 tokens, damping scale 0.1: measured 0.86
# (k=4 acceptance 0.71); scale 0 (draft = target) gives 1.00, scale 0.3 gives 0.62
# and undamped 0.14 (python -m tools.draft_agreement --scale 0 0.1 0.3 1 --prompts 2).
# The band fails both for a draft that does not follow the target and for one
# that always does.
AGREEMENT_BAND = (0.5, 0.97)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Fresh copies (never a stale models/ directory) made through ensure()."""
    out = tmp_path_factory.mktemp("synth-draft")
    return ensure(PAIR.target, out), ensure(PAIR.draft, out)


def _tensors(path: Path) -> dict[str, tuple[int, bytes]]:
    import gguf

    r = gguf.GGUFReader(path)
    return {t.name: (int(t.tensor_type), bytes(t.data.tobytes())) for t in r.tensors}


def _field(path: Path, key: str) -> object:
    import gguf

    field = gguf.GGUFReader(path).get_field(key)
    assert field is not None, key
    return field.contents()


def test_pair_is_deterministic_and_listed(pair: tuple[Path, Path], tmp_path: Path) -> None:
    for name, path in zip((PAIR.target, PAIR.draft), pair, strict=True):
        again = synth_gguf.generate(name, tmp_path)
        assert hashlib.sha256(again.read_bytes()).digest() == \
            hashlib.sha256(path.read_bytes()).digest(), name
        assert synth_gguf.stored_version(again) == synth_gguf.SPECS[name].version
        assert name in synth_gguf.ALL


def test_draft_is_the_targets_first_layers(pair: tuple[Path, Path]) -> None:
    target_path, draft_path = pair
    target, draft = _tensors(target_path), _tensors(draft_path)
    assert _field(target_path, "tokenizer.ggml.tokens") == _field(draft_path,
                                                                  "tokenizer.ggml.tokens")
    assert _field(draft_path, "tokenizer.ggml.tokens") == VOCAB.tokens
    assert _field(target_path, "qwen35.block_count") == PAIR.shape.n_layer
    assert _field(draft_path, "qwen35.block_count") == PAIR.draft_layers
    # Every draft tensor is the target's tensor of that name, bit for bit.
    assert set(draft) < set(target)
    for name, value in draft.items():
        assert target[name] == value, name
    assert {"token_embd.weight", "output_norm.weight", "output.weight"} <= set(draft)
    layers = {int(n.split(".")[1]) for n in draft if n.startswith("blk.")}
    assert layers == set(range(PAIR.draft_layers))


def test_later_layers_are_damped(pair: tuple[Path, Path], tmp_path: Path) -> None:
    """The target is hybrid-tiny's weights with the residual writers of its
    later layers scaled by the damping factor, and nothing else changed."""
    assert PAIR.seed == "hybrid" and PAIR.damping.from_layer >= PAIR.draft_layers
    import gguf

    base = {t.name: np.array(t.data, dtype=np.float32)
            for t in gguf.GGUFReader(ensure("hybrid", tmp_path)).tensors}
    damped = {t.name: np.array(t.data, dtype=np.float32)
              for t in gguf.GGUFReader(pair[0]).tensors}
    assert set(base) == set(damped)
    n_scaled = 0
    for name, value in damped.items():
        if PAIR.damping.factor(name) == 1.0:
            assert np.array_equal(value, base[name]), name
        else:
            n_scaled += 1
            np.testing.assert_allclose(value, base[name] * PAIR.damping.scale,
                                       rtol=2e-3, atol=1e-6, err_msg=name)
    assert n_scaled == 2 * (PAIR.shape.n_layer - PAIR.damping.from_layer)


def test_agreement_is_high_but_not_total(pair: tuple[Path, Path]) -> None:
    pytest.importorskip("llama_cpp")
    from tools.draft_agreement import measure

    report = measure(*pair, prompts=2, tokens=64, k=4)
    print(report.lines())
    assert report.same_vocab
    assert report.draft_round_trips
    lo, hi = AGREEMENT_BAND
    assert lo <= report.agreement <= hi, report.lines()
    assert 0.0 < report.acceptance < 1.0
    assert report.size_ratio < 0.75
