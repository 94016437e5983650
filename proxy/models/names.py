"""``--model`` / ``model.path`` to the GGUF to load: a path, or the name of a model people
already have (docs/models.md).

- A file that exists is that file; a path that starts with ``/``, ``./``, ``../`` or ``~``
  is only ever a path.
- Otherwise a name, looked up in Ollama (``qwen3.5:27b``), LM Studio (``publisher/repo``,
  ``publisher/repo/file``) and the Hugging Face cache (``org/repo[:quant]``); a prefix
  ``ollama:``, ``lmstudio:`` or ``hf:`` looks in that place only.
- One model answers: that one. Several: an error that lists them by their prefixed names,
  which nothing else can answer. None: an ``org/repo[:quant]`` is downloaded from the Hub
  (``hub``), anything else is an error that says where it looked.
- Ollama's template layer serves a GGUF that has no chat template (``gotemplate``).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from proxy.models import hfcache, hub, lmstudio, ollama
from proxy.models.bundled import default_model_path
from proxy.models.gotemplate import jinja_for
from proxy.models.header import read_header
from proxy.models.places import Found
from proxy.models.quants import Ambiguous, fits_memory

log = logging.getLogger("statecache")

PREFIXES = ("ollama", "lmstudio", "hf")
_PATH_STARTS = ("/", "./", "../", "~")


class ModelNotFound(FileNotFoundError):
    """No model answers the name; the message says where it looked."""


@dataclass(slots=True, frozen=True)
class Resolved:
    path: Path  # the GGUF llama.cpp opens (a split model's first part)
    name: str  # as the user asked for it; a path's file name
    source: str  # "file", "bundled", "ollama", "lmstudio", "hf" (cached) or "hub" (downloaded)
    # a vendored Jinja template for a GGUF without one (Ollama's template layer, mapped)
    chat_template: Path | None = None


def resolve_model(spec: str, *, kv_budget: int = 4 << 30, download: bool = True) -> Resolved:
    """The model ``spec`` names (``model.kv_budget`` decides what fits the machine)."""
    if not spec:
        return Resolved(default_model_path(), default_model_path().name, "bundled")
    path = Path(os.path.expanduser(spec))
    if path.is_file():
        return Resolved(path, path.name, "file")
    if spec.startswith(_PATH_STARTS) or os.path.isabs(spec):
        raise ModelNotFound(f"model file not found: {path}")
    place, sep, rest = spec.partition(":")
    only, name = (place, rest) if sep and place in PREFIXES else (None, spec)
    fits = fits_memory(kv_budget)
    found: list[Found] = []
    looked: list[str] = []
    for source, look in (("ollama", lambda: ollama.lookup(name)),
                         ("lmstudio", lambda: lmstudio.lookup(name, fits)),
                         ("hf", lambda: hfcache.lookup(name, fits))):
        if only not in (None, source):
            continue
        try:
            hits, where = look()
        except ValueError as e:  # a manifest that leads nowhere, two files of one quant
            hits, where = [], str(e)
        found += hits
        looked += [where] if where and not hits else []
    distinct = {f.path.resolve(): f for f in found}
    if len(distinct) > 1:
        raise Ambiguous(f"{spec!r} names {len(distinct)} models; pass one of these to "
                        "--model:\n" + "\n".join(f"  {f.qualified}" for f in found))
    if distinct:
        return _resolved(found[0], spec)
    parsed = hfcache.parse_name(name) if only in (None, "hf") else None
    if parsed is not None and not parsed[2] and download and not hub.offline():
        repo_id, quant, _ = parsed
        try:
            got = hub.download(repo_id, quant, fits, hfcache.root())
        except (FileNotFoundError, Ambiguous) as e:  # the Hub said no, or no file fits
            looked.append(f"the Hub: {e}")
        else:
            return Resolved(got, spec, "hub")
    raise ModelNotFound(f"no model {spec!r}; looked in:\n" + "\n".join(f"  {w}" for w in looked))


def _resolved(f: Found, asked: str) -> Resolved:
    """A model found on disk, its header read (a bad file is a clear error here, not
    llama.cpp's) and, for Ollama's, its template layer weighed."""
    if not f.complete:
        raise ModelNotFound(f"{f.qualified}: {f.note}")
    header = read_header(f.path)
    if f.note:
        log.warning("%s: %s", f.qualified, f.note)
    template = None
    if f.template and not header.chat_template:
        template = jinja_for(f.template)
        if template is None:
            log.warning("%s: the GGUF has no chat template and Ollama's template layer is a "
                        "Go template of no known turn format; falling back", f.qualified)
        else:
            log.info("%s: the GGUF has no chat template; Ollama's template layer writes the "
                     "turns of %s, used instead", f.qualified, template.name)
    return Resolved(f.path, asked, f.source, template)
