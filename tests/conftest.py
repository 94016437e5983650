"""Shared fixtures: real model files (bundled Gemma 3 270M, synthetic GGUFs)."""

from __future__ import annotations

from pathlib import Path

import pytest

# llama.cpp's libraries before the clients' and aiohttp's (docs/gpu.md: on a CUDA
# machine, a process that had loaded frozenlist first died loading a model)
import proxy.engine.binding  # noqa: F401  isort: skip

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "models"


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    from proxy.models import gemma_model_path

    return gemma_model_path()


def _synth(name: str) -> Path:
    from tools.synth_gguf import ensure

    return ensure(name, MODELS)


@pytest.fixture(scope="session")
def hybrid_path() -> Path:
    return _synth("hybrid")


@pytest.fixture(scope="session")
def norollback_path() -> Path:
    return _synth("norollback")


@pytest.fixture(scope="session")
def draft_path() -> Path:
    return _synth("draft")


@pytest.fixture(scope="session")
def spec_target_path() -> Path:
    """A hybrid whose later layers barely change the residual stream..."""
    return _synth("spec-target")


@pytest.fixture(scope="session")
def spec_draft_path() -> Path:
    """...and its first layers with the same head: a draft that agrees with it."""
    return _synth("spec-draft")


@pytest.fixture(scope="session")
def spec_llama_target_path() -> Path:
    """Plain attention (llama): draft-tiny's layers plus damped ones..."""
    return _synth("spec-llama-target")


@pytest.fixture(scope="session")
def spec_llama_draft_path() -> Path:
    """...and its first 2 layers with the same head."""
    return _synth("spec-llama-draft")


@pytest.fixture(scope="session")
def spec_jamba_target_path() -> Path:
    """A hybrid without n_rs_seq rollback (jamba) whose later layers are damped..."""
    return _synth("spec-jamba-target")


@pytest.fixture(scope="session")
def spec_jamba_draft_path() -> Path:
    """...and its first 4 layers (3 Mamba + 1 attention) with the same head."""
    return _synth("spec-jamba-draft")
