"""``statecache models`` over the three places and a ``--dir`` folder, laid out as their
tools write them: each model with its figures, each listed name resolving to the listed
file, what cannot be read reported beside the rest, no model loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from proxy.cli import main
from proxy.models import headercache
from proxy.models.names import resolve_model
from tests.model_layouts import (
    PLACE_VARS,
    header_gguf,
    hf_cached,
    lmstudio_model,
    ollama_model,
)

CHATML_GO = ("{{ range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
             "{{ end }}<|im_start|>assistant\n")
CONFIG = '[model]\nkv_budget = "64MiB"\n[server]\nlanes = 2\n[cache]\nram_budget = "1GiB"\n'


@pytest.fixture
def layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hybrid_path: Path,
           norollback_path: Path, draft_path: Path, gemma_path: Path) -> dict[str, Path]:
    for var in PLACE_VARS:
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    bare = header_gguf(tmp_path / "bare.gguf", "llama", {
        "block_count": 2, "embedding_length": 64, "context_length": 2048,
        "attention.head_count": 4})
    ollama_model(home, hybrid_path, "qwen3.5", "27b")
    ollama_model(home, bare, "chatml", template=CHATML_GO)
    gone = ollama_model(home, draft_path, "gone", "1b")
    (home / ".ollama" / "models" / "blobs" / f"sha256-{_digest(gone)}").unlink()
    lmstudio_model(home, norollback_path, "pub", "Jamba-GGUF", "jamba-Q8_0.gguf")
    (home / ".lmstudio" / "models" / "loop").symlink_to(home / ".lmstudio" / "models" / "loop")
    hf_cached(home, draft_path, "org/Tiny-GGUF", "tiny-Q4_K_M.gguf")
    hf_cached(home, hybrid_path, "org/Big-GGUF", "big-Q8_0-00001-of-00002.gguf")
    hf_cached(home, draft_path, "org/Big-GGUF", "big-Q8_0-00002-of-00002.gguf")
    folder = tmp_path / "dir"
    folder.mkdir()
    os.link(gemma_path, folder / gemma_path.name)
    (folder / "cut.gguf").write_bytes(hybrid_path.read_bytes()[:3000])
    (tmp_path / "statecache.toml").write_text(CONFIG)
    return {"home": home, "dir": folder, "config": tmp_path / "statecache.toml",
            "cache": tmp_path / "headers.json"}


def _digest(manifest: Path) -> str:
    return str(json.loads(manifest.read_text())["layers"][0]["digest"]).split(":")[1]


def _run(layout: dict[str, Path], capsys: pytest.CaptureFixture[str],
         *extra: str) -> tuple[int, str]:
    code = main(["models", "--dir", str(layout["dir"]), "--config", str(layout["config"]),
                 *extra])
    got = capsys.readouterr()
    assert code == 0, got.err
    return code, got.out


def _report(layout: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    code, out = _run(layout, capsys, "--json", "--no-header-cache")
    assert code == 0
    return dict(json.loads(out))


def test_every_place_and_its_figures(layout: dict[str, Path],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    rep = _report(layout, capsys)
    rows = {r["name"]: r for r in rep["models"]}
    gemma = str(layout["dir"] / "gemma-3-270m-q4_k_m.gguf")
    cut = str(layout["dir"] / "cut.gguf")
    assert set(rows) == {"ollama:qwen3.5:27b", "ollama:chatml:latest",
                         "lmstudio:pub/Jamba-GGUF/jamba-Q8_0.gguf", "hf:org/Tiny-GGUF:Q4_K_M",
                         "hf:org/Big-GGUF:Q8_0", gemma, cut}
    qwen, jamba, tiny = (rows["ollama:qwen3.5:27b"],
                         rows["lmstudio:pub/Jamba-GGUF/jamba-Q8_0.gguf"],
                         rows["hf:org/Tiny-GGUF:Q4_K_M"])
    # kind, bytes a token (equal to what the engine measures: tests/model), state
    assert (qwen["memory"], qwen["kv_bytes_per_token"], qwen["recurrent_bytes"]) == \
        ("hybrid", 1048, 125952)
    assert (jamba["memory"], jamba["kv_bytes_per_token"], jamba["recurrent_bytes"]) == \
        ("hybrid", 268, 58368)
    assert (tiny["memory"], tiny["kv_bytes_per_token"], tiny["recurrent_bytes"]) == \
        ("attention", 524, 0)
    assert rows[gemma]["memory"] == "swa" and rows[gemma]["n_swa"] == 512
    # 64 MiB of KV over 2 lanes: 32,017 tokens of the hybrid's, in steps of 256
    assert (qwen["training_context"], qwen["context"]) == (32768, 32000)
    assert rows[gemma]["context"] == 1792  # 18,456 bytes a token
    # a 32K conversation: its KV once and one recurrent state; 1 GiB keeps 31 of them
    assert qwen["conversation_bytes"] == 1048 * 32768 + 125952
    assert qwen["warm_conversations"] == (1 << 30) // qwen["conversation_bytes"] == 31
    assert rows["hf:org/Big-GGUF:Q8_0"]["parts"] == 2
    assert rows["hf:org/Big-GGUF:Q8_0"]["size"] == sum(
        Path(p).stat().st_size for p in Path(rows["hf:org/Big-GGUF:Q8_0"]["file"]).parent.iterdir())
    # the template: the GGUF's, Ollama's layer mapped, or none
    # the synthetic models' ChatML template writes Hermes calls (the server's own probe)
    assert (qwen["template"], qwen["tool_syntax"]) == ("gguf", "hermes")
    assert rows["ollama:chatml:latest"]["template"] == "ollama layer as chatml-tools.jinja"
    assert (rows[gemma]["template"], rows[gemma]["tool_syntax"]) == ("none", "none")
    assert "truncated" in rows[cut]["error"]
    problems = {p["source"]: " ".join(p["problems"]) for p in rep["places"]}
    assert "gone:1b" in problems["ollama"] and "is not in" in problems["ollama"]
    assert "cannot read" in problems["lmstudio"] and "loop" in problems["lmstudio"]
    # every name it lists gives that file back
    for name, r in rows.items():
        if "error" not in r:
            assert str(resolve_model(name).path) == r["file"], name


def test_the_table(layout: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    code, out = _run(layout, capsys, "--no-header-cache")
    assert code == 0 and "Traceback" not in out
    head, *lines = out.splitlines()
    assert head.split()[:6] == ["NAME", "SIZE", "ARCH", "MEMORY", "TRAINED", "CONTEXT"]
    qwen = next(line for line in lines if line.startswith("ollama:qwen3.5:27b"))
    assert qwen.split()[3:10] == ["qwen35", "hybrid", "32,768", "32,000", "1.0", "KiB", "123.0"]
    assert any("cut.gguf: " in line and "truncated" in line for line in lines)
    assert any(line.startswith("looked in ollama:") for line in lines)


def test_headers_are_read_once(layout: dict[str, Path], capsys: pytest.CaptureFixture[str],
                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(headercache, "default_path", lambda: layout["cache"])
    code, first = _run(layout, capsys, "--json")
    assert code == 0 and layout["cache"].is_file()
    read: list[Path] = []
    real = headercache.read_header
    monkeypatch.setattr(headercache, "read_header",
                        lambda p, skim: read.append(p) or real(p, skim=skim))
    assert _run(layout, capsys, "--json") == (0, first)
    assert [p.name for p in read] == ["cut.gguf"]  # an unreadable header is not kept
    own = header_gguf(layout["dir"] / "own.gguf", "llama", {"block_count": 1})  # not a link
    read.clear()
    _run(layout, capsys, "--json")
    assert sorted(p.name for p in read) == ["cut.gguf", "own.gguf"]  # a new file: read
    os.utime(own, ns=(10**9, 10**9))  # another file now: read again
    read.clear()
    _run(layout, capsys, "--json")
    assert sorted(p.name for p in read) == ["cut.gguf", "own.gguf"]
    own.unlink()
    _run(layout, capsys, "--json")
    layout["cache"].write_text("{not json")  # a broken cache is an empty one
    assert _run(layout, capsys, "--json") == (0, first)
    assert str(own.resolve()) not in layout["cache"].read_text()  # files gone are dropped


def test_no_model_is_loaded(layout: dict[str, Path]) -> None:
    code = ("import sys; from proxy.cli import main; rc = main(['models', '--json', "
            "'--no-header-cache']); assert 'llama_cpp' not in sys.modules, 'loaded'; "
            "raise SystemExit(rc)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "ollama:qwen3.5:27b" in out.stdout
