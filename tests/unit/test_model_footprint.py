"""The memory rules of architectures the tests cannot load (no synthetic weights for them),
on headers written as their converters write them; tests/model/test_model_footprint.py
checks the same rules against llama.cpp on the models it can load."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.models.footprint import footprint
from proxy.models.header import read_header
from tests.model_layouts import header_gguf


def _fp(tmp_path: Path, arch: str, **fields: object):  # type: ignore[no-untyped-def]
    return footprint(read_header(header_gguf(tmp_path / f"{arch}.gguf", arch, fields)))


def test_mamba2_is_recurrent_only(tmp_path: Path) -> None:
    fp = _fp(tmp_path, "mamba2", block_count=4, embedding_length=256, context_length=4096,
             **{"ssm.conv_kernel": 4, "ssm.inner_size": 512, "ssm.state_size": 64,
                "ssm.group_count": 1, "ssm.time_step_rank": 8})
    assert (fp.kind, fp.attention_layers, fp.recurrent_layers) == ("recurrent", 0, 4)
    assert fp.kv_bytes_per_token == 0 and fp.kv_bytes(32768) == 0
    # conv rows 3 x (512 + 2 x 64), state rows 64 x 512, f32, four layers
    assert fp.recurrent_bytes == 4 * (3 * 640 + 64 * 512) * 4


def test_lfm2_short_convolutions_beside_attention(tmp_path: Path) -> None:
    fp = _fp(tmp_path, "lfm2", block_count=6, embedding_length=128, context_length=128000,
             **{"attention.head_count": 8, "attention.head_count_kv": [0, 0, 4, 0, 4, 0],
                "shortconv.l_cache": 3})
    assert (fp.kind, fp.attention_layers, fp.recurrent_layers) == ("hybrid", 2, 4)
    assert fp.recurrent_bytes == 4 * 128 * 2 * 4  # n_embd x (l_cache - 1) rows, f32
    assert fp.kv_bytes_per_token == 2 * 4 * (16 + 16) * 2 + 12


def test_nemotron_h_mlp_layers_are_neither(tmp_path: Path) -> None:
    fp = _fp(tmp_path, "nemotron_h", block_count=4, embedding_length=64, context_length=8192,
             feed_forward_length=[0, 0, 256, 0],
             **{"attention.head_count": 4, "attention.head_count_kv": [0, 2, 0, 0],
                "ssm.conv_kernel": 4, "ssm.inner_size": 128, "ssm.state_size": 16,
                "ssm.group_count": 2, "ssm.time_step_rank": 4})
    assert (fp.kind, fp.attention_layers, fp.recurrent_layers) == ("hybrid", 1, 2)


def test_gemma2_window_and_the_conversation_it_keeps(tmp_path: Path) -> None:
    fp = _fp(tmp_path, "gemma2", block_count=4, embedding_length=256, context_length=8192,
             **{"attention.head_count": 4, "attention.head_count_kv": 2,
                "attention.key_length": 64, "attention.value_length": 64,
                "attention.sliding_window": 4096})
    assert (fp.kind, fp.swa_layers, fp.n_swa) == ("swa", 2, 4096)  # layers 0 and 2
    row = 2 * (64 + 64) * 2
    assert fp.kv_bytes_per_token == 4 * row + 2 * 12  # two caches, a record in each
    # past the window a sliding layer keeps only the window's cells
    assert fp.kv_bytes(32768) == (2 * row + 12) * 32768 + (2 * row + 12) * 4096


def test_a_window_that_llama_cpp_does_not_use_is_not_one(tmp_path: Path) -> None:
    fp = _fp(tmp_path, "llama", block_count=2, embedding_length=128, context_length=4096,
             **{"attention.head_count": 4, "attention.sliding_window": 4096})
    assert fp.kind == "attention" and fp.swa_layers == 0


def test_a_header_without_a_shape_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="block_count"):
        _fp(tmp_path, "llama", embedding_length=128)
    with pytest.raises(ValueError, match="per-layer array of 2 values for 4 layers"):
        _fp(tmp_path, "jamba", block_count=4, **{"attention.head_count_kv": [0, 2]})
