"""LM Studio's models: ``$LMSTUDIO_MODELS``, else ~/.lmstudio/models, else the older
~/.cache/lm-studio/models; ``<publisher>/<repo>/<file>.gguf`` under it (the repo folder
named as the Hugging Face repo it came from). A name is ``publisher/repo`` (the folder's
one model), ``publisher/repo/file`` or ``publisher/repo:quant``."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from proxy.models.folder import models_in
from proxy.models.places import Found, Scan, home, subdirs
from proxy.models.quants import Ambiguous, ModelFile, choose

DEPTH = 2  # folders below a repo folder searched for GGUFs (a split model's own folder)


def roots() -> list[Path]:
    env = os.environ.get("LMSTUDIO_MODELS")
    if env:
        return [Path(env).expanduser()]
    return [home() / ".lmstudio" / "models", home() / ".cache" / "lm-studio" / "models"]


def root() -> Path:
    """The first of ``roots`` that exists (the first when none does)."""
    return next((r for r in roots() if r.is_dir()), roots()[0])


def _found(base: Path, publisher: str, repo: str, f: ModelFile) -> Found:
    note = f"parts {list(f.missing)} missing" if f.missing else ""
    return Found("lmstudio", f"{publisher}/{repo}/{f.first}", base / publisher / repo / f.first,
                 f.size, parts=len(f.parts), note=note,
                 complete=not f.missing)


def scan(where: Path | None = None) -> Scan:
    base = where or root()
    s = Scan("lmstudio", base, base.is_dir())
    if not s.exists:
        return s
    for pub in subdirs(base, s.problems):
        for repo in subdirs(pub, s.problems):
            for f in models_in(Path(repo.path), s.problems, DEPTH):
                s.found.append(_found(base, pub.name, repo.name, f))
    return s


def lookup(name: str, fits: Callable[[ModelFile], bool],
           where: Path | None = None) -> tuple[list[Found], str]:
    """The models ``name`` answers here, and where it looked."""
    base = where or root()
    head, sep, quant = name.partition(":")
    parts = head.split("/")
    if len(parts) < 2 or "" in parts or ".." in parts or (sep and len(parts) != 2):
        return [], f"LM Studio ({base}): not a publisher/repo name"
    folder = base / parts[0] / parts[1]
    if not folder.is_dir():
        return [], f"LM Studio ({base}): no folder {parts[0]}/{parts[1]}"
    models = models_in(folder, [], DEPTH)
    if len(parts) > 2:  # a file: with or without ".gguf"
        rel = "/".join(parts[2:])
        hit = [f for f in models if rel in (f.first, f.first[:-5])] or \
            [f for f in models if rel.lower() in (f.first.lower(), f.first[:-5].lower())]
        if not hit:
            return [], f"LM Studio ({base}): no {rel} in {parts[0]}/{parts[1]}"
        return [_found(base, parts[0], parts[1], hit[0])], ""
    if sep:
        try:
            return [_found(base, parts[0], parts[1],
                           choose(models, quant, fits, f"LM Studio's {head}"))], ""
        except FileNotFoundError as e:
            return [], f"LM Studio ({base}): {e}"
        except Ambiguous:  # two files of that quantisation: each is a choice
            models = [f for f in models if f.quant == quant.upper()]
    return [_found(base, parts[0], parts[1], f) for f in models], \
        f"LM Studio ({base}): no GGUF in {parts[0]}/{parts[1]}"
