"""A folder of GGUFs (``statecache models --dir``), and the walk that finds the models in
any folder: the parts of a split model grouped, projectors left out."""

from __future__ import annotations

import os
from pathlib import Path

from proxy.models.places import Found, Scan, entries, file_size
from proxy.models.quants import ModelFile, group

DEPTH = 3  # folders below the given one searched


def models_in(folder: Path, problems: list[str], depth: int = DEPTH) -> list[ModelFile]:
    """The models among ``folder``'s GGUFs and its subfolders', paths relative to it."""
    files: list[tuple[str, int]] = []

    def walk(d: Path, rel: str, level: int) -> None:
        for e in entries(d, problems):
            sub = f"{rel}{e.name}"
            if e.name.lower().endswith(".gguf"):
                size = file_size(Path(e.path))
                if size is None:
                    problems.append(f"{e.path}: a dangling link or not a file")
                else:
                    files.append((sub, size))
            elif level < depth and os.path.isdir(e.path):
                walk(Path(e.path), sub + "/", level + 1)

    walk(folder, "", 0)
    return group(files)


def scan(folder: Path) -> Scan:
    s = Scan("dir", folder, folder.is_dir())
    if not s.exists:
        s.problems.append(f"--dir {folder}: no such directory")
        return s
    for f in models_in(folder, s.problems):
        s.found.append(Found("dir", str(folder / f.first), folder / f.first, f.size,
                             parts=len(f.parts), complete=not f.missing,
                             note=f"parts {list(f.missing)} missing" if f.missing else ""))
    return s
