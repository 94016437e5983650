"""``--model`` as a name: the Ollama, LM Studio and Hugging Face cache layouts written as
those tools write them, under a test's own home; the Hub is a local server. Every
mistake is a clear error that says what and where."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from proxy.models import quants
from proxy.models.header import BadGGUF
from proxy.models.names import ModelNotFound, resolve_model
from proxy.models.quants import Ambiguous, ModelFile
from tests.fakehub import Hub, running
from tests.model_layouts import (
    PLACE_VARS,
    header_gguf,
    hf_cached,
    lmstudio_model,
    ollama_model,
)


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A home of the test's own; the Hub off unless a test points HF_ENDPOINT at one."""
    for var in PLACE_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "home"


def test_ollama_names(home: Path, hybrid_path: Path, draft_path: Path) -> None:
    ollama_model(home, hybrid_path, "qwen3.5", "27b")
    ollama_model(home, draft_path, "qwen3.5", "9b")
    ollama_model(home, draft_path, "tiny", "latest", namespace="someone")
    blob = resolve_model("qwen3.5:27b")
    assert blob.path.read_bytes()[:64] == hybrid_path.read_bytes()[:64]
    assert blob.path.parent == home / ".ollama" / "models" / "blobs"
    assert (blob.name, blob.source, blob.chat_template) == ("qwen3.5:27b", "ollama", None)
    for same in ("library/qwen3.5:27b", "registry.ollama.ai/library/qwen3.5:27b",
                 "ollama:qwen3.5:27b", "QWEN3.5:27b"):
        assert resolve_model(same).path == blob.path, same
    assert resolve_model("someone/tiny").name == "someone/tiny"  # no tag: latest
    # no tag and no "latest": each tag is a choice
    with pytest.raises(Ambiguous, match="'qwen3.5' names 2 models") as e:
        resolve_model("qwen3.5")
    assert "ollama:qwen3.5:27b" in str(e.value) and "ollama:qwen3.5:9b" in str(e.value)
    with pytest.raises(ModelNotFound, match=r"no manifest qwen3.5:4b; it has 27b, 9b"):
        resolve_model("qwen3.5:4b")


def test_older_ollama_blob_names(home: Path, hybrid_path: Path) -> None:
    ollama_model(home, hybrid_path, "old", "1b")
    blobs = home / ".ollama" / "models" / "blobs"
    for blob in blobs.glob("sha256-*"):  # older Ollama versions: sha256:<hex>
        blob.rename(blobs / blob.name.replace("sha256-", "sha256:"))
    got = resolve_model("old:1b").path
    assert got.name.startswith("sha256:") and got.stat().st_size == hybrid_path.stat().st_size


def test_a_manifest_naming_a_missing_blob(home: Path, hybrid_path: Path) -> None:
    manifest = ollama_model(home, hybrid_path, "gone", "1b")
    for blob in (home / ".ollama" / "models" / "blobs").glob("sha256-*"):
        if blob.stat().st_size == hybrid_path.stat().st_size:
            blob.unlink()
    with pytest.raises(ModelNotFound) as e:
        resolve_model("gone:1b")
    msg = str(e.value)
    assert str(manifest) in msg and "is not in" in msg and "ollama pull gone:1b" in msg
    manifest.write_text("{not json")
    with pytest.raises(ModelNotFound, match="not an Ollama manifest"):
        resolve_model("gone:1b")


def test_a_truncated_gguf_is_a_clear_error(home: Path, hybrid_path: Path,
                                          tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(hybrid_path.read_bytes()[:5000])
    ollama_model(home, cut, "cut", "1b")
    with pytest.raises(BadGGUF, match=r"truncated: .* \(at byte"):
        resolve_model("cut:1b")


def test_lmstudio_names(home: Path, hybrid_path: Path, draft_path: Path) -> None:
    one = lmstudio_model(home, hybrid_path, "lmstudio-community", "Tiny-GGUF", "Tiny-Q8_0.gguf")
    assert resolve_model("lmstudio-community/Tiny-GGUF").path == one
    two = lmstudio_model(home, draft_path, "lmstudio-community", "Tiny-GGUF", "Tiny-Q4_K_M.gguf")
    with pytest.raises(Ambiguous) as e:
        resolve_model("lmstudio-community/Tiny-GGUF")
    assert "lmstudio:lmstudio-community/Tiny-GGUF/Tiny-Q8_0.gguf" in str(e.value)
    assert resolve_model("lmstudio-community/Tiny-GGUF/Tiny-Q4_K_M.gguf").path == two
    assert resolve_model("lmstudio-community/Tiny-GGUF/Tiny-Q4_K_M").path == two
    assert resolve_model("lmstudio-community/Tiny-GGUF:q8_0").path == one
    assert resolve_model("lmstudio:lmstudio-community/Tiny-GGUF:Q4_K_M").path == two


def test_hf_cache_names(home: Path, hybrid_path: Path, draft_path: Path) -> None:
    q8 = hf_cached(home, hybrid_path, "org/Tiny-GGUF", "tiny-Q8_0.gguf")
    q4 = hf_cached(home, draft_path, "org/Tiny-GGUF", "tiny-Q4_K_M.gguf")
    assert q4.is_symlink() and q4.resolve().parent.name == "blobs"
    assert resolve_model("org/Tiny-GGUF:Q8_0").path == q8
    assert resolve_model("org/Tiny-GGUF").path == q4  # Q4_K_M by default
    assert resolve_model("hf:org/Tiny-GGUF:q4_k_m").source == "hf"
    # the same repo in LM Studio too: the name is ambiguous, a prefix is not
    lm = lmstudio_model(home, hybrid_path, "org", "Tiny-GGUF", "tiny-Q8_0.gguf")
    with pytest.raises(Ambiguous, match="lmstudio:org/Tiny-GGUF/tiny-Q8_0.gguf"):
        resolve_model("org/Tiny-GGUF:Q8_0")
    assert resolve_model("hf:org/Tiny-GGUF:Q8_0").path == q8
    assert resolve_model("lmstudio:org/Tiny-GGUF:Q8_0").path == lm


def test_a_split_model_loads_from_its_first_part(home: Path, hybrid_path: Path,
                                                 draft_path: Path) -> None:
    first = hf_cached(home, hybrid_path, "org/Big-GGUF", "Q4_K_M/big-Q4_K_M-00001-of-00002.gguf")
    with pytest.raises(ModelNotFound, match=r"parts \[2\] missing"):
        resolve_model("org/Big-GGUF")
    hf_cached(home, draft_path, "org/Big-GGUF", "Q4_K_M/big-Q4_K_M-00002-of-00002.gguf")
    assert resolve_model("org/Big-GGUF").path == first


def test_paths_and_unknown_names(home: Path, hybrid_path: Path, monkeypatch: pytest.MonkeyPatch,
                                 tmp_path: Path) -> None:
    assert resolve_model(str(hybrid_path)).name == hybrid_path.name
    monkeypatch.chdir(hybrid_path.parent)
    assert resolve_model(f"./{hybrid_path.name}").source == "file"
    for path in ("./nope.gguf", "/no/such.gguf", "~/nope.gguf"):
        with pytest.raises(ModelNotFound, match="model file not found"):
            resolve_model(path)
    with pytest.raises(ModelNotFound) as e:
        resolve_model("someone/nothing:Q4_K_M")
    msg = str(e.value)
    for where in ("Ollama (", "LM Studio (", "Hugging Face cache (", str(home)):
        assert where in msg, msg


def test_an_unreadable_place_does_not_hide_the_others(home: Path, hybrid_path: Path) -> None:
    lm = home / ".lmstudio" / "models"
    lm.mkdir(parents=True)
    (lm / "loop").symlink_to(lm / "loop")  # ELOOP, also as root (whom no mode stops)
    q8 = hf_cached(home, hybrid_path, "org/Tiny-GGUF", "tiny-Q8_0.gguf")
    assert resolve_model("org/Tiny-GGUF").path == q8
    with pytest.raises(ModelNotFound, match="LM Studio"):
        resolve_model("loop/x")


def test_ollama_template_layer(home: Path, tmp_path: Path,
                               caplog: pytest.LogCaptureFixture) -> None:
    bare = header_gguf(tmp_path / "bare.gguf", "llama", {"block_count": 1})
    templated = header_gguf(tmp_path / "t.gguf", "llama", {"block_count": 1}, template="{{x}}")
    chatml = ("{{- if .System }}<|im_start|>system\n{{ .System }}<|im_end|>\n{{ end }}"
              "{{ range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
              "<|im_start|>assistant\n")
    ollama_model(home, bare, "chatml", template=chatml)
    ollama_model(home, bare, "odd", template="[INST] {{ .Prompt }} [/INST]")
    ollama_model(home, templated, "own", template=chatml)
    with caplog.at_level(logging.INFO, logger="statecache"):
        got = resolve_model("chatml")
        assert got.chat_template is not None and got.chat_template.name == "chatml-tools.jinja"
        assert resolve_model("odd").chat_template is None  # no known turn format
        assert "no known turn format; falling back" in caplog.text
        assert resolve_model("own").chat_template is None  # the GGUF's own wins


# -- the Hub ----------------------------------------------------------------------------


def _tiny_repo(hybrid_path: Path, draft_path: Path) -> dict[str, Path]:
    return {"tiny-Q8_0.gguf": hybrid_path, "tiny-Q4_K_M.gguf": draft_path,
            "mmproj-tiny-F16.gguf": draft_path, "README.md": draft_path}


def test_download_resumes_and_then_is_cached(home: Path, hybrid_path: Path, draft_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    # the first GET of a file breaks after 12 MB: huggingface_hub asks for the rest
    with running(Hub({"org/Tiny-GGUF": _tiny_repo(hybrid_path, draft_path)},
                     drop_after=12_000_000)) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        got = resolve_model("org/Tiny-GGUF:Q8_0")
        assert got.source == "hub" and got.name == "org/Tiny-GGUF:Q8_0"
        assert got.path.read_bytes() == hybrid_path.read_bytes()
        cache = home / ".cache" / "huggingface" / "hub" / "models--org--Tiny-GGUF"
        assert got.path.parent.parent == cache / "snapshots" and got.path.is_symlink()
        gets = [r for r in hub.requests if r[0] == "GET" and "resolve" in r[1]]
        assert [r[2] for r in gets] == ["", "bytes=10485760-"], hub.requests
        seen = len(hub.requests)
        assert resolve_model("org/Tiny-GGUF:Q8_0").path == got.path  # now from the cache
        # no quant: what the cache holds, by the same rule (no surprise download)
        assert resolve_model("org/Tiny-GGUF").path == got.path
        assert len(hub.requests) == seen
        q4 = resolve_model("org/Tiny-GGUF:Q4_K_M")  # not cached yet
        assert q4.source == "hub" and q4.path.read_bytes() == draft_path.read_bytes()
        assert resolve_model("org/Tiny-GGUF").path == q4.path  # Q4_K_M, now it is there


def test_download_a_split_model_with_a_token(home: Path, hybrid_path: Path, draft_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE")
    repo = {"Q4_K_M/big-Q4_K_M-00001-of-00002.gguf": hybrid_path,
            "Q4_K_M/big-Q4_K_M-00002-of-00002.gguf": draft_path}
    with running(Hub({"org/Big-GGUF": repo}, token="hf_secret")) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(ModelNotFound, match="gated: .* set HF_TOKEN"):
            resolve_model("org/Big-GGUF")
        monkeypatch.setenv("HF_TOKEN", "hf_secret")
        got = resolve_model("org/Big-GGUF:Q4_K_M")
        assert got.path.name == "big-Q4_K_M-00001-of-00002.gguf"
        assert (got.path.parent / "big-Q4_K_M-00002-of-00002.gguf").read_bytes() == \
            draft_path.read_bytes()
        with pytest.raises(ModelNotFound, match=r"has no Q8_0 file; its quantisations: Q4_K_M"):
            resolve_model("org/Big-GGUF:Q8_0")
        with pytest.raises(ModelNotFound, match="no repo org/Nothing-GGUF at http://127"):
            resolve_model("org/Nothing-GGUF")


def test_no_hub_reached_offline(home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # would refuse: never asked
    with pytest.raises(ModelNotFound) as e:
        resolve_model("org/Tiny-GGUF")
    assert "the Hub" not in str(e.value)


def test_the_quant_rule() -> None:
    files = [ModelFile((f"m-{q}.gguf",), size, q) for q, size in
             (("Q8_0", 800), ("Q4_0", 420), ("Q4_K_S", 430), ("Q6_K", 600))]
    every = quants.fits_memory(0, memory=1 << 40)
    small = quants.fits_memory(0, memory=500)
    assert quants.choose(files, "", every, "r").quant == "Q4_0"  # no Q4_K_M: the smallest
    assert quants.choose(files, "q4", every, "r").quant == "Q4_0"
    assert quants.choose(files, "Q4_K", every, "r").quant == "Q4_K_S"
    assert quants.choose(files + [ModelFile(("m-Q4_K_M.gguf",), 450, "Q4_K_M")], "", small,
                         "r").quant == "Q4_K_M"
    with pytest.raises(FileNotFoundError, match="fits this machine's memory"):
        quants.choose(files, "Q6", small, "r")
    assert quants.quant_of("Qwen3-8B-UD-Q4_K_XL-00001-of-00003.gguf") == "UD-Q4_K_XL"
    assert quants.quant_of("qwen2.5-0.5b-instruct-q4_k_m.gguf") == "Q4_K_M"
    assert quants.quant_of("SmolLM2-135M-Instruct.Q4_1.gguf") == "Q4_1"
    assert quants.quant_of("model-bf16.gguf") == "BF16"
    assert not quants.is_model_file("mmproj-model-f16.gguf")
