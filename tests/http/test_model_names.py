"""``statecache serve --model NAME`` as a user runs it, a process on a port, with the models
where Ollama, LM Studio and the Hugging Face cache keep them (under the test's own home),
and a Hub on 127.0.0.1 for the one not cached: each serves a request, and ``/v1/models``
names it as asked and its file. A name that cannot serve is a clear error and exit 1."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import gguf
import pytest
from gguf.scripts.gguf_new_metadata import copy_with_new_metadata
from openai import OpenAI

from tests.fakehub import Hub, running
from tests.http.proc import Proc, serve_process
from tests.model_layouts import PLACE_VARS, hf_cached, lmstudio_model, ollama_model

pytestmark = pytest.mark.http

CONFIG = "[server]\nlanes = 1\n[model]\nn_ctx = 1024\n"
CHATML_GO = ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n"
             "{{ end }}<|im_start|>assistant\n")


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for var in PLACE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "home"


def _one_request(p: Proc, asked: str, file: Path) -> None:
    client = OpenAI(base_url=f"{p.url}/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(
        model=asked, messages=[{"role": "user", "content": "Hello"}], max_tokens=8,
        temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop")
    client.close()
    with urllib.request.urlopen(f"{p.url}/v1/models", timeout=10) as r:
        card = json.load(r)["data"][0]
    assert (card["id"], card["file"]) == (asked, str(file))
    with urllib.request.urlopen(f"{p.url}/v1/models/{file.name}", timeout=10) as r:
        assert json.load(r)["id"] == asked  # the file's name finds it too
    with urllib.request.urlopen(f"{p.url}/admin/ui.json", timeout=10) as r:  # the live page
        page = json.load(r)
    assert (page["model"], page["model_file"]) == (asked, str(file))


def test_ollama_lmstudio_and_hf_cache_names_serve(home: Path, tmp_path: Path,
                                                   hybrid_path: Path, norollback_path: Path,
                                                   draft_path: Path) -> None:
    ollama_model(home, hybrid_path, "qwen3.5", "27b")
    lm = lmstudio_model(home, norollback_path, "lmstudio-community", "Jamba-GGUF",
                        "Jamba-Q8_0.gguf")
    hf = hf_cached(home, draft_path, "org/Tiny-GGUF", "tiny-Q4_K_M.gguf")
    blob = next(p for p in (home / ".ollama" / "models" / "blobs").iterdir()
                if p.stat().st_size == hybrid_path.stat().st_size)
    for i, (asked, file) in enumerate((("qwen3.5:27b", blob),
                                       ("lmstudio-community/Jamba-GGUF", lm),
                                       ("org/Tiny-GGUF:Q4_K_M", hf))):
        run = tmp_path / f"run{i}"
        run.mkdir()
        with serve_process(asked, run, CONFIG) as p:
            _one_request(p, asked, file)
            p.proc.terminate()
            out = p.output()
        assert f"model {asked} ({file})" in out, out


def test_a_hub_name_downloads_then_serves(home: Path, tmp_path: Path, hybrid_path: Path,
                                          draft_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    repo = {"remote-Q8_0.gguf": hybrid_path, "remote-Q4_K_M.gguf": draft_path}
    with running(Hub({"org/Remote-GGUF": repo}, token="hf_x")) as hub:
        # TQDM_POSITION=-1: huggingface_hub's bar also where stderr is no terminal
        env = {"HF_ENDPOINT": hub.url, "HF_TOKEN": "hf_x", "TQDM_POSITION": "-1"}
        with serve_process("org/Remote-GGUF:Q8_0", tmp_path, CONFIG, env=env) as p:
            cached = home / ".cache" / "huggingface" / "hub" / "models--org--Remote-GGUF"
            file = next((cached / "snapshots").iterdir()) / "remote-Q8_0.gguf"
            _one_request(p, "org/Remote-GGUF:Q8_0", file)
            p.proc.terminate()
            out = p.output()
    assert file.read_bytes() == hybrid_path.read_bytes()
    assert "downloading org/Remote-GGUF from http://127.0.0.1" in out, out
    assert "remote-Q8_0.gguf: 100%" in out, out  # huggingface_hub's progress bar
    assert "HTTP Request:" not in out  # huggingface_hub's client logs each at INFO


def test_an_ollama_template_layer_where_the_gguf_has_none(home: Path, tmp_path: Path,
                                                          hybrid_path: Path) -> None:
    reader = gguf.GGUFReader(hybrid_path)
    bare = tmp_path / "bare.gguf"
    writer = gguf.GGUFWriter(bare, arch="qwen35")
    copy_with_new_metadata(reader, writer, {}, ["tokenizer.chat_template"])
    ollama_model(home, bare, "bare", template=CHATML_GO)
    with serve_process("bare", tmp_path, CONFIG) as p:
        client = OpenAI(base_url=f"{p.url}/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(
            model="bare", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        assert reply.usage is not None and reply.usage.prompt_tokens > 0
        client.close()
        p.proc.terminate()
        out = p.output()
    assert "Ollama's template layer writes the turns of chatml-tools.jinja" in out, out
    assert "chat template: file " in out and "chatml-tools.jinja" in out, out


def _serve_fails(asked: str, tmp: Path, **env: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "proxy", "serve", "--model", asked, "--port", "1"],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env}, cwd=tmp)
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    assert "Traceback" not in text, text
    return text


def test_names_that_cannot_serve(home: Path, tmp_path: Path, hybrid_path: Path) -> None:
    text = _serve_fails("nobody/nothing:Q4_K_M", tmp_path)
    assert "no model 'nobody/nothing:Q4_K_M'; looked in:" in text
    assert f"Ollama ({home}" in text and "Hugging Face cache (" in text
    lmstudio_model(home, hybrid_path, "org", "Two-GGUF", "two-Q8_0.gguf")
    hf_cached(home, hybrid_path, "org/Two-GGUF", "two-Q8_0.gguf")
    text = _serve_fails("org/Two-GGUF:Q8_0", tmp_path)
    assert "names 2 models" in text and "hf:org/Two-GGUF:Q8_0" in text
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(hybrid_path.read_bytes()[:4000])
    ollama_model(home, cut, "cut")
    assert "truncated" in _serve_fails("cut", tmp_path)
