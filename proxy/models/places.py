"""What the places models live in have in common: a model found there (``Found``), what a
scan of one place gives (``Scan``), and a directory read that turns an unreadable entry
into a problem to report instead of an exception."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

SOURCES = ("ollama", "lmstudio", "hf", "dir")


@dataclass(slots=True, frozen=True)
class Found:
    """A model on disk: ``name`` is what to type after ``source:`` to get it again."""

    source: str  # one of SOURCES
    name: str  # "qwen3.5:27b", "lmstudio-community/Qwen3-8B-GGUF/Qwen3-8B-Q4_K_M.gguf", ...
    path: Path  # the GGUF llama.cpp opens: a split model's first part
    size: int  # bytes, every part together
    parts: int = 1
    template: str = ""  # Ollama's template layer (a Go template), else ""
    note: str = ""  # what is off about it, shown beside it
    complete: bool = True  # false: parts of a split model are missing

    @property
    def qualified(self) -> str:
        """The name with its place, which no other place can answer: ``ollama:qwen3.5``
        (a file of a ``--dir`` folder: its path)."""
        return self.name if self.source == "dir" else f"{self.source}:{self.name}"


@dataclass(slots=True)
class Scan:
    """One place: where it is, whether it exists, what it holds, what could not be read."""

    source: str
    root: Path
    exists: bool
    found: list[Found] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)


def home() -> Path:
    return Path(os.path.expanduser("~"))


def entries(path: Path | os.DirEntry[str], problems: list[str]) -> list[os.DirEntry[str]]:
    """The entries of a directory sorted by name; [] and a problem when it cannot be read
    (no permission, a symlink loop, a file where a directory should be)."""
    path = Path(path)
    try:
        with os.scandir(path) as it:
            return sorted(it, key=lambda e: e.name)
    except OSError as e:
        problems.append(f"cannot read {path}: {e.strerror or e}")
        return []


def subdirs(path: Path | os.DirEntry[str], problems: list[str]) -> list[os.DirEntry[str]]:
    """The directories in ``path`` (through symlinks); an entry that cannot be followed (a
    symlink loop, a link into a folder we may not read) is a problem."""
    out = []
    for e in entries(path, problems):
        try:
            if stat.S_ISDIR(os.stat(e.path).st_mode):
                out.append(e)
        except OSError as err:
            problems.append(f"cannot read {e.path}: {err.strerror or err}")
    return out


def file_size(path: Path) -> int | None:
    """Bytes of the file ``path`` names (through symlinks), None when there is none."""
    try:
        st = path.stat()
    except OSError:
        return None
    return st.st_size if not os.path.isdir(path) else None
