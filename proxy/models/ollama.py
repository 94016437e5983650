"""Ollama's models: ``$OLLAMA_MODELS``, else ~/.ollama/models.

Ollama keeps a pulled model as a manifest, ``manifests/<registry>/<namespace>/<model>/<tag>``
(JSON: a list of layers, each a media type, a ``sha256:`` digest and a size), and the
layers as files ``blobs/sha256-<hex>``. The model layer is the GGUF itself; the template
layer is a Go template (``gotemplate``), the others (license, parameters, system prompt)
are not read. ``qwen3.5:27b`` is ``registry.ollama.ai/library/qwen3.5:27b``; no tag is
``latest``.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from proxy.models.places import Found, Scan, entries, file_size, home, subdirs

DEFAULT_HOST, DEFAULT_NAMESPACE, DEFAULT_TAG = "registry.ollama.ai", "library", "latest"
MODEL = "application/vnd.ollama.image.model"
TEMPLATE = "application/vnd.ollama.image.template"
ADAPTER = "application/vnd.ollama.image.adapter"
MAX_MANIFEST = 1 << 20
MAX_TEMPLATE = 1 << 20
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")
_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


class BadManifest(ValueError):
    """A manifest that does not lead to a model file; the message says which and why."""


@dataclass(slots=True, frozen=True)
class Ref:
    host: str
    namespace: str
    model: str
    tag: str
    tagged: bool  # the name carried its tag

    @property
    def short(self) -> str:
        """The name as Ollama prints it: the default registry and namespace left out."""
        if self.host == DEFAULT_HOST:
            head = self.model if self.namespace == DEFAULT_NAMESPACE else \
                f"{self.namespace}/{self.model}"
        else:
            head = f"{self.host}/{self.namespace}/{self.model}"
        return f"{head}:{self.tag}"


def root() -> Path:
    env = os.environ.get("OLLAMA_MODELS")
    return Path(env).expanduser() if env else home() / ".ollama" / "models"


def parse_name(name: str) -> Ref | None:
    """``[registry/][namespace/]model[:tag]``, or None when it cannot be an Ollama name."""
    head, sep, tag = name.rpartition(":") if ":" in name.rpartition("/")[2] else (name, "", "")
    parts = head.split("/")
    if not 1 <= len(parts) <= 3 or (sep and not tag):
        return None
    if any(not _PART.match(p) for p in [*parts, *([tag] if tag else [])]):
        return None
    host, namespace = DEFAULT_HOST, DEFAULT_NAMESPACE
    if len(parts) == 3:
        host, namespace = parts[0], parts[1]
    elif len(parts) == 2:
        namespace = parts[0]
    return Ref(host.lower(), namespace.lower(), parts[-1].lower(), tag or DEFAULT_TAG, bool(sep))


def scan(where: Path | None = None) -> Scan:
    """Every manifest under ``where`` that leads to a model; the others as problems."""
    base = where or root()
    s = Scan("ollama", base, (base / "manifests").is_dir())
    if not s.exists:
        return s
    for host in subdirs(base / "manifests", s.problems):
        for ns in subdirs(host, s.problems):
            for model in subdirs(ns, s.problems):
                for tag in entries(model, s.problems):
                    ref = Ref(host.name, ns.name, model.name, tag.name, True)
                    try:
                        s.found.append(load(base, ref, Path(tag.path)))
                    except BadManifest as e:
                        s.problems.append(str(e))
    return s


def lookup(name: str, where: Path | None = None) -> tuple[list[Found], str]:
    """The models ``name`` answers here, and where it looked (for a message)."""
    base = where or root()
    ref = parse_name(name)
    if ref is None:
        return [], f"Ollama ({base}): not an Ollama name"
    folder = _child(_child(_child(base / "manifests", ref.host), ref.namespace), ref.model)
    manifest = _child(folder, ref.tag)
    if manifest.is_file():
        return [load(base, ref, manifest)], ""
    tags = sorted(e.name for e in entries(folder, [])) if folder.is_dir() else []
    if not ref.tagged and tags:  # no "latest": each tag it has is a choice
        return [load(base, Ref(ref.host, ref.namespace, ref.model, t, True), folder / t)
                for t in tags], ""
    have = f"; it has {', '.join(tags)}" if tags else ""
    return [], f"Ollama ({base}): no manifest {ref.short}{have}"


def _child(folder: Path, name: str) -> Path:
    """``folder/name``, matched without case as Ollama matches names."""
    exact = folder / name
    if exact.exists() or not folder.is_dir():
        return exact
    for e in entries(folder, []):
        if e.name.lower() == name.lower():
            return Path(e.path)
    return exact


def load(base: Path, ref: Ref, manifest: Path) -> Found:
    """The model a manifest names; BadManifest when it names none that is on disk."""
    where = f"Ollama manifest {ref.short} ({manifest})"
    try:
        with manifest.open("rb") as fh:
            raw = fh.read(MAX_MANIFEST + 1)
    except OSError as e:
        raise BadManifest(f"{where}: cannot read it: {e.strerror or e}") from None
    try:
        if len(raw) > MAX_MANIFEST:
            raise ValueError("over 1 MiB")
        layers = json.loads(raw)["layers"]
        if not isinstance(layers, list):
            raise ValueError("layers is not a list")
        kinds = {str(x["mediaType"]): str(x["digest"]) for x in layers if isinstance(x, dict)}
    except (ValueError, KeyError, TypeError) as e:
        raise BadManifest(f"{where}: not an Ollama manifest ({type(e).__name__}: {e})") from None
    if MODEL not in kinds:
        raise BadManifest(f"{where}: no model layer")
    model = _blob(base, kinds[MODEL], where)
    size = file_size(model)
    if size is None:
        raise BadManifest(f"{where}: its model layer {model.name} is not in {base / 'blobs'} "
                          f"(an interrupted pull? `ollama pull {ref.short}`)")
    template, note = "", ""
    if TEMPLATE in kinds:
        template, note = _template(_blob(base, kinds[TEMPLATE], where))
    if ADAPTER in kinds:
        note = "; ".join(x for x in (note, "its adapter layer is not applied") if x)
    return Found("ollama", ref.short, model, size, template=template, note=note)


def _blob(base: Path, digest: str, where: str) -> Path:
    m = _DIGEST.match(digest)
    if m is None:
        raise BadManifest(f"{where}: a layer digest that is not sha256: {digest[:80]!r}")
    dashed = base / "blobs" / f"sha256-{m.group(1)}"
    colon = base / "blobs" / f"sha256:{m.group(1)}"  # the layout of older Ollama versions
    return colon if not dashed.exists() and colon.exists() else dashed


def _template(blob: Path) -> tuple[str, str]:
    try:
        with blob.open("rb") as fh:
            raw = fh.read(MAX_TEMPLATE + 1)
        if len(raw) > MAX_TEMPLATE:
            return "", "its template layer is over 1 MiB and was not read"
        return raw.decode("utf-8"), ""
    except (OSError, UnicodeDecodeError) as e:
        return "", f"its template layer cannot be read ({e})"
