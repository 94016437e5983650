"""The Hugging Face cache, as ``huggingface_hub`` writes it: ``$HF_HUB_CACHE``, else
``$HF_HOME/hub``, else ~/.cache/huggingface/hub (``$XDG_CACHE_HOME`` for ~/.cache).

A repo ``org/repo`` is the folder ``models--org--repo``: ``blobs/`` holds the files by
hash, ``snapshots/<commit>/`` a tree of links to them per commit, ``refs/main`` the commit
``main`` was when last asked. A file is taken from the ``main`` snapshot, else from the
newest snapshot that has it. A name is ``org/repo[:quant]`` (``quants``' rule among the
cached files) or ``org/repo/path/in/repo.gguf``.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable
from pathlib import Path

from proxy.models.places import Found, Scan, entries, file_size, home, subdirs
from proxy.models.quants import DEFAULT_QUANT, Ambiguous, ModelFile, choose, group

PREFIX = "models--"
DEPTH = 3  # folders inside a snapshot searched for GGUFs
_REPO_PART = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")


def root() -> Path:
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(var):
            return Path(os.environ[var]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    cache = os.environ.get("XDG_CACHE_HOME")
    return (Path(cache).expanduser() if cache else home() / ".cache") / "huggingface" / "hub"


def parse_name(name: str) -> tuple[str, str, str] | None:
    """(repo id, quant, file in the repo) of ``org/repo[:quant]`` or ``org/repo/file``."""
    head, sep, quant = name.partition(":")
    parts = head.split("/")
    if len(parts) < 2 or not all(_REPO_PART.match(p) for p in parts) or "--" in parts[1] \
            or ".." in parts or (sep and (len(parts) != 2 or not quant)):
        return None
    return f"{parts[0]}/{parts[1]}", quant, "/".join(parts[2:])


def repo_folder(repo_id: str, base: Path | None = None) -> Path:
    return (base or root()) / (PREFIX + repo_id.replace("/", "--"))


def cached(folder: Path, problems: list[str]) -> dict[str, Path]:
    """Each GGUF file of a repo's snapshots, by its path in the repo."""
    snaps = {e.name: Path(e.path) for e in subdirs(folder / "snapshots", problems)}
    main = ""
    with contextlib.suppress(OSError, UnicodeDecodeError):  # no ref: newest first
        main = (folder / "refs" / "main").read_text(encoding="ascii").strip()

    def newest_first(name: str) -> tuple[bool, float]:
        try:
            return name == main, snaps[name].stat().st_mtime
        except OSError:
            return name == main, 0.0

    out: dict[str, Path] = {}
    for name in sorted(snaps, key=newest_first, reverse=True):
        for rel, path in _ggufs(snaps[name], "", 0, problems):
            out.setdefault(rel, path)
    return out


def _ggufs(d: Path, rel: str, depth: int, problems: list[str]) -> list[tuple[str, Path]]:
    out = []
    for e in entries(d, problems):
        if e.name.lower().endswith(".gguf"):
            out.append((rel + e.name, Path(e.path)))
        elif depth < DEPTH and os.path.isdir(e.path):
            out += _ggufs(Path(e.path), f"{rel}{e.name}/", depth + 1, problems)
    return out


def models(folder: Path, problems: list[str]) -> list[tuple[ModelFile, Path]]:
    """The repo's cached models and the snapshot path of each one's first part; a link
    whose blob is gone (an interrupted download) is a problem, not a model."""
    files, sizes = cached(folder, problems), []
    for rel, path in files.items():
        size = file_size(path)
        if size is None:
            problems.append(f"{path}: its blob is missing (an interrupted download?)")
            continue
        sizes.append((rel, size))
    return [(f, files[f.first]) for f in group(sizes)]


def _found(repo_id: str, f: ModelFile, path: Path, all_files: list[ModelFile]) -> Found:
    unique = f.quant and sum(g.quant == f.quant for g in all_files) == 1
    name = f"{repo_id}:{f.quant}" if unique else f"{repo_id}/{f.first}"
    note = f"parts {list(f.missing)} missing" if f.missing else ""
    return Found("hf", name, path, f.size, parts=len(f.parts), note=note,
                 complete=not f.missing)


def scan(where: Path | None = None) -> Scan:
    base = where or root()
    s = Scan("hf", base, base.is_dir())
    if not s.exists:
        return s
    for repo in subdirs(base, s.problems):
        if not repo.name.startswith(PREFIX):
            continue  # datasets--, spaces--, .locks
        org, _, name = repo.name[len(PREFIX):].partition("--")
        pairs = models(Path(repo.path), s.problems)
        every = [f for f, _ in pairs]
        s.found += [_found(f"{org}/{name}", f, p, every) for f, p in pairs]
    return s


def lookup(name: str, fits: Callable[[ModelFile], bool],
           where: Path | None = None) -> tuple[list[Found], str]:
    """The cached models ``name`` answers, and where it looked."""
    base = where or root()
    parsed = parse_name(name)
    if parsed is None:
        return [], f"Hugging Face cache ({base}): not an org/repo[:quant] name"
    repo_id, quant, rel = parsed
    folder = repo_folder(repo_id, base)
    pairs = models(folder, []) if folder.is_dir() else []
    every = [f for f, _ in pairs]
    if not pairs:
        return [], f"Hugging Face cache ({base}): no GGUF of {repo_id}"
    if rel:
        hit = [(f, p) for f, p in pairs if f.first == rel]
        return [_found(repo_id, f, p, every) for f, p in hit], \
            f"Hugging Face cache ({base}): no {rel} in {repo_id}"
    try:
        f = choose(every, quant, fits, repo_id)
    except FileNotFoundError as e:
        return [], f"Hugging Face cache ({base}): {e}"
    except Ambiguous:
        return [_found(repo_id, f, p, every) for f, p in pairs
                if f.quant == (quant or DEFAULT_QUANT).upper()], ""
    return [_found(repo_id, f, dict(pairs)[f], every)], ""
