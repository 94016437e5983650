"""The places people keep models, written as their tools write them, under a test's home:
an Ollama manifest and its blobs, an LM Studio tree, a Hugging Face cache snapshot of
links into its blobs; and GGUF headers of any shape (no tensors) for the listing."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import gguf

OLLAMA_MODEL = "application/vnd.ollama.image.model"
OLLAMA_TEMPLATE = "application/vnd.ollama.image.template"
OLLAMA_CONFIG = "application/vnd.docker.container.image.v1+json"
# The variables that name the places: a test clears them so that only its home counts.
PLACE_VARS = ("OLLAMA_MODELS", "LMSTUDIO_MODELS", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE",
              "HF_HOME", "XDG_CACHE_HOME", "HF_ENDPOINT", "HF_TOKEN", "HF_HUB_OFFLINE")


def place_file(src: Path, dst: Path) -> None:
    """``dst`` with ``src``'s bytes: a hard link where the file system allows one (never
    written to afterwards: it is the repository's model file)."""
    if dst.exists():  # a content-addressed blob placed before
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def ollama_blob(root: Path, data: bytes) -> tuple[str, int]:
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    (root / "blobs" / f"sha256-{digest}").write_bytes(data)
    return f"sha256:{digest}", len(data)


def ollama_model(home: Path, gguf_file: Path, name: str, tag: str = "latest", *,
                 namespace: str = "library", host: str = "registry.ollama.ai",
                 template: str | None = None) -> Path:
    """A model as ``ollama pull`` leaves it; returns its manifest."""
    root = home / ".ollama" / "models"
    digest = sha256(gguf_file)
    place_file(gguf_file, root / "blobs" / f"sha256-{digest}")
    config = ollama_blob(root, json.dumps({"model_format": "gguf"}).encode())
    layers: list[dict[str, Any]] = [{"mediaType": OLLAMA_MODEL, "digest": f"sha256:{digest}",
                                     "size": gguf_file.stat().st_size}]
    if template is not None:
        d, n = ollama_blob(root, template.encode())
        layers.append({"mediaType": OLLAMA_TEMPLATE, "digest": d, "size": n})
    manifest = root / "manifests" / host / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    manifest.write_text(json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.docker.distribution.manifest.v2+json",
        "config": {"mediaType": OLLAMA_CONFIG, "digest": config[0], "size": config[1]},
        "layers": layers}))
    return manifest


def lmstudio_model(home: Path, gguf_file: Path, publisher: str, repo: str, file: str) -> Path:
    path = home / ".lmstudio" / "models" / publisher / repo / file
    place_file(gguf_file, path)
    return path


def hf_cached(home: Path, gguf_file: Path, repo_id: str, file: str,
              commit: str = "0123456789abcdef0123456789abcdef01234567") -> Path:
    """A file as huggingface_hub caches it: the blob by its sha256, a snapshot link to it
    (relative, as huggingface_hub makes them), ``refs/main`` naming the commit."""
    repo = home / ".cache" / "huggingface" / "hub" / ("models--" + repo_id.replace("/", "--"))
    digest = sha256(gguf_file)
    place_file(gguf_file, repo / "blobs" / digest)
    link = repo / "snapshots" / commit / file
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(os.path.relpath(repo / "blobs" / digest, link.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(commit)
    return link


def header_gguf(path: Path, arch: str, fields: dict[str, Any], *,
                template: str | None = None, vocab: int = 8) -> Path:
    """A GGUF of metadata only (no tensors): ``fields`` are ``{arch}.``-relative keys."""
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(path, arch)
    for key, value in fields.items():
        full = f"{arch}.{key}"
        if isinstance(value, bool):
            w.add_bool(full, value)
        elif isinstance(value, int):
            w.add_uint32(full, value)
        elif isinstance(value, float):
            w.add_float32(full, value)
        elif isinstance(value, list):
            w.add_array(full, value)
        else:
            w.add_string(full, str(value))
    w.add_token_list([f"t{i}" for i in range(vocab)])
    if template is not None:
        w.add_chat_template(template)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
