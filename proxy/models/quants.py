"""GGUF files as models: a quantisation tag read from the file name, the parts of a split
model grouped into one (llama.cpp opens it from its first part), and the choice of one
file among a repository's by ``:quant``.

The choice (docs/models.md): a tag equal to ``:quant`` (case aside, so ``q4_k_m`` is
Q4_K_M); else the files whose tag starts with it (``:Q4`` takes Q4_0, Q4_K_M, ...), the
smallest that fits; without ``:quant``, Q4_K_M, else the smallest that fits. A model fits
when its bytes and ``model.kv_budget`` together are at most the machine's memory.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

DEFAULT_QUANT = "Q4_K_M"
_SPLIT = re.compile(r"^(?P<stem>.+)-(?P<part>\d{5})-of-(?P<count>\d{5})\.gguf$", re.I)
_QUANT = re.compile(
    r"(?:^|[-_.])(?P<tag>(?:UD-)?(?:I?Q\d(?:_[A-Z0-9]+)*|TQ\d_\d|MXFP4(?:_MOE)?|BF16|F16|F32))"
    r"(?=[-_.]|$)", re.I)
# GGUFs that are not a model to serve: vision projectors, importance matrices
_NOT_MODELS = re.compile(r"(^|[-_./])(mmproj|imatrix)([-_.]|$)", re.I)


class Ambiguous(ValueError):
    """Several files answer the name; the message lists them, one per line."""


@dataclass(slots=True, frozen=True)
class ModelFile:
    """One model among a folder's or a repository's GGUFs; ``parts`` are the paths
    relative to it, the first part first, and ``missing`` the part numbers absent."""

    parts: tuple[str, ...]
    size: int
    quant: str  # "" when the file name carries no tag
    missing: tuple[int, ...] = ()

    @property
    def first(self) -> str:
        return self.parts[0]


def is_model_file(rel: str) -> bool:
    return rel.lower().endswith(".gguf") and _NOT_MODELS.search(rel) is None


def quant_of(rel: str) -> str:
    """The quantisation tag of a file name ("Qwen3-8B-Q4_K_M.gguf" -> "Q4_K_M")."""
    name = rel.rsplit("/", 1)[-1]
    m = _SPLIT.match(name)
    stem = m.group("stem") if m else name[:-5] if name.lower().endswith(".gguf") else name
    tags = [t.group("tag").upper() for t in _QUANT.finditer(stem)]
    return tags[-1] if tags else ""


def group(files: Iterable[tuple[str, int]]) -> list[ModelFile]:
    """Model files from (relative path, bytes) pairs: the parts of a split model become
    one, and the projectors and importance matrices are left out."""
    singles: list[ModelFile] = []
    splits: dict[tuple[str, int], dict[int, tuple[str, int]]] = {}
    for rel, size in files:
        if not is_model_file(rel):
            continue
        folder, _, name = rel.rpartition("/")
        m = _SPLIT.match(name)
        if m is None:
            singles.append(ModelFile((rel,), size, quant_of(rel)))
            continue
        key = (f"{folder}/{m.group('stem')}", int(m.group("count")))
        splits.setdefault(key, {})[int(m.group("part"))] = (rel, size)
    for (_stem, count), parts in splits.items():
        order = sorted(parts)
        missing = tuple(i for i in range(1, count + 1) if i not in parts)
        rels = tuple(parts[i][0] for i in order)
        singles.append(ModelFile(rels, sum(parts[i][1] for i in order), quant_of(rels[0]),
                                 missing))
    return sorted(singles, key=lambda f: f.first)


def physical_memory() -> int:
    """The machine's memory in bytes (0 when it cannot be read: everything fits)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def fits_memory(kv_budget: int, memory: int | None = None) -> Callable[[ModelFile], bool]:
    total = physical_memory() if memory is None else memory
    return lambda f: not total or f.size + kv_budget <= total


def choose(files: list[ModelFile], quant: str, fits: Callable[[ModelFile], bool],
           where: str) -> ModelFile:
    """The file ``:quant`` names among ``files`` (the module's rule); ``where`` names the
    repository in messages. FileNotFoundError when none answers, ``Ambiguous`` when two
    files carry the same tag."""
    complete = [f for f in files if not f.missing]
    if not complete:
        broken = ", ".join(f"{f.first} (parts {list(f.missing)} missing)" for f in files)
        raise FileNotFoundError(f"{where} has no complete GGUF model" +
                                (f": {broken}" if broken else ""))
    want = (quant or DEFAULT_QUANT).upper()
    exact = [f for f in complete if f.quant == want]
    if len(exact) > 1:
        raise Ambiguous(f"{where} has {len(exact)} {want} files:\n" + "\n".join(
            f"  {f.first}" for f in exact))
    if exact:
        return exact[0]
    pool = [f for f in complete if f.quant.startswith(want)] if quant else complete
    if not pool:
        raise FileNotFoundError(f"{where} has no {want} file; its quantisations: "
                                + ", ".join(sorted({f.quant or f.first for f in complete})))
    fitting = [f for f in pool if fits(f)]
    if not fitting:
        smallest = min(pool, key=lambda f: f.size)
        raise FileNotFoundError(
            f"no {quant or 'GGUF'} file of {where} fits this machine's memory with "
            f"model.kv_budget (the smallest, {smallest.first}, is {smallest.size:,} bytes)")
    return min(fitting, key=lambda f: (f.size, f.first))
