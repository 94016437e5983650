"""``statecache models`` sizes a model from its GGUF header alone; the engine measures
the same model loaded. They must agree: the bytes a token adds to a state (what sizes
``model.kv_budget``) byte for byte, the memory kind, the recurrent state up to the few
hundred bytes of its record headers, and so the context a lane gets."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.engine.binding import Context, ContextParams, MemoryKind, Model
from proxy.engine.sizing import choose_n_ctx
from proxy.models import default_model_path
from proxy.models.footprint import footprint
from proxy.models.header import read_header
from statecache.budgets import lane_context
from statecache.config import load_config

pytestmark = pytest.mark.model

MODELS = ("hybrid_path", "norollback_path", "draft_path", "spec_llama_target_path",
          "spec_jamba_target_path", "spec_draft_path", "gemma_path")


def _cases(request: pytest.FixtureRequest) -> list[Path]:
    return [request.getfixturevalue(name) for name in MODELS] + [default_model_path()]


def test_header_figures_are_the_measured_ones(request: pytest.FixtureRequest) -> None:
    kinds = set()
    for path in _cases(request):
        fp = footprint(read_header(path))
        model = Model(path, n_gpu_layers=0)
        probe = ContextParams(n_ctx=512, n_seq_max=1, n_batch=64, n_ubatch=64, threads=1)
        with Context(model, probe) as ctx:
            mem = ctx.describe_memory()
        kinds.add(mem.kind)
        assert fp.kind == mem.kind.value, path.name
        assert fp.architecture == model.architecture, path.name
        assert fp.training_context == model.n_ctx_train, path.name
        assert fp.kv_bytes_per_token == mem.bytes_per_token, path.name
        if mem.kind is MemoryKind.HYBRID:
            # a partial state is the recurrent rows plus its records' headers
            assert 0 < mem.partial_bytes_per_lane - fp.recurrent_bytes < 512, path.name
        else:
            assert fp.recurrent_bytes == 0, path.name
        if mem.kind is MemoryKind.SWA:  # a partial state holds the window's layers
            assert fp.swa_bytes_per_token + fp.record_bytes == mem.partial_bytes_per_token
            assert fp.n_swa == model.n_swa
    # the listing was checked on every kind the engine treats apart, but recurrent-only
    assert kinds == {MemoryKind.ATTENTION, MemoryKind.HYBRID, MemoryKind.SWA}


@pytest.mark.parametrize("budget", ["4GiB", "24MiB", "6MiB"])
def test_the_listed_context_is_the_one_the_engine_chooses(
        request: pytest.FixtureRequest, budget: str) -> None:
    cfg = load_config(None, {"model.kv_budget": budget, "server.lanes": 3})
    for path in _cases(request):
        fp = footprint(read_header(path))
        try:
            listed = lane_context(fp.training_context, fp.kv_bytes_per_token,
                                  cfg.model.kv_budget, cfg.server.lanes)
        except ValueError:
            with pytest.raises(ValueError, match="holds only"):
                choose_n_ctx(Model(path, n_gpu_layers=0), cfg)
            continue
        assert listed == choose_n_ctx(Model(path, n_gpu_layers=0), cfg), (path.name, budget)
