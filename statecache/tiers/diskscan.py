"""The disk tier's scan at start: which records and page files it keeps, and at what
sizes (the ones the records say, never a file's own: statecache.tiers.disk counts them
in its budget). Nothing of a page file is read: a file of another size than its record
says is quarantined, and so is a record that names a page missing.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from statecache.formats.diskfmt import (
    SUFFIX,
    TMP_PREFIX,
    BadFile,
    page_sizes,
    record_from_meta,
    valid_id,
)
from statecache.kvpages import PageKey
from statecache.records import CheckpointRecord, RecordHead
from statecache.tiers.diskfiles import PAGE_SUFFIX, QUARANTINE, DiskFiles, page_path, quarantine

log = logging.getLogger(__name__)

_MISSING, _REFUSED = "a page is missing", "a page was refused"
_QUARANTINED = -1  # a page file's size in the listing once it is quarantined
# A page gone (missing, or quarantined for its size) and the heads of the records it took
Lost = Callable[[PageKey, str, list[RecordHead]], None]


@dataclass(slots=True, frozen=True)
class Listing:
    """What a scan of the records found."""

    # (mtime, id, file size, page keys), oldest first
    kept: list[tuple[float, str, int, bytes]]
    pages: dict[PageKey, int]  # the pages they name, at the sizes their records say
    stray: int  # bytes of leftover temporary files that could not be removed
    moved: int  # files quarantined


def _moved(directory: Path, path: Path, reason: str, reasons: Counter[str]) -> None:
    """Quarantine one file of a scan, counted by its reason (one warning for them all)."""
    if quarantine(directory, path, reason, quiet=True):
        reasons[reason] += 1


def scan_records(files: DiskFiles, found: Callable[[CheckpointRecord], None],
                 pages: dict[PageKey, int], lost: Lost | None = None) -> Listing:
    """This model's valid records, each given to ``found`` as it is read; records
    that fail their checks or name a page not in ``pages`` (file sizes) are
    quarantined, and so is a page file whose size is not the one the first record
    naming it says (nothing read of it: a file put in place may be huge). ``lost`` is
    told each page gone and the records it took."""
    kept: list[tuple[float, str, int, bytes]] = []
    held: dict[PageKey, int] = {}
    gone: dict[PageKey, tuple[str, list[RecordHead]]] = {}  # page: why, records it took
    stray = 0
    reasons: Counter[str] = Counter()  # one warning for the whole scan, not one per file
    for entry in os.scandir(files.path):
        p = Path(entry.path)
        if entry.name.startswith(TMP_PREFIX):
            stray += sweep(p)
            continue
        if not entry.name.endswith(SUFFIX):
            continue  # not ours
        stem = entry.name[: -len(SUFFIX)]
        if entry.is_symlink():
            _moved(files.path, p, "symlink", reasons)
            continue
        if not valid_id(stem):
            _moved(files.path, p, "file name is not a checkpoint id", reasons)
            continue
        try:
            fm = files.read_meta(p)
            if fm.meta["fingerprint"] != files.fingerprint:
                continue  # another model's: leave it alone
            if fm.meta["state_format"] != files.state_format:
                continue  # another build's state format: not ours to judge
            rec = record_from_meta(fm.meta, files.page_size)
            if rec.id != stem:
                raise BadFile("file name does not match its id")
        except BadFile as e:
            _moved(files.path, p, str(e), reasons)
            continue
        except OSError as e:
            log.warning("disk: skipped %s: %s", entry.name, e)
            continue
        why, page = _pages_agree(files, rec.page_keys, page_sizes(fm.meta), pages, held,
                                 reasons)
        if why:
            _moved(files.path, p, why, reasons)
            if page is not None:
                gone.setdefault(page, ("missing" if why == _MISSING else "refused", []))
                gone[page][1].append(rec.head())
            continue
        for k, n in zip(rec.page_keys, page_sizes(fm.meta), strict=True):
            held[k] = n
        found(rec)
        kept.append((fm.mtime, rec.id, fm.file_size, rec.keys))
    if reasons:
        log.warning(
            "disk: moved %d bad file(s) to %s (%s); `statecache purge --quarantined "
            "--yes` removes them",
            sum(reasons.values()),
            files.path / QUARANTINE,
            ", ".join(f"{n} {why}" for why, n in reasons.most_common()),
        )
    for page, (why, heads) in gone.items():
        if lost is not None:
            lost(page, why, heads)
    kept.sort(key=lambda t: t[0])
    return Listing(kept, held, stray, sum(reasons.values()))


def _pages_agree(files: DiskFiles, keys: Sequence[PageKey], sizes: Sequence[int],
                 pages: dict[PageKey, int], held: dict[PageKey, int],
                 reasons: Counter[str]) -> tuple[str, PageKey | None]:
    """Why a record cannot be kept for its pages ("" if it can) and the page: one is
    missing, or its file's size is not the one the record says (that page is
    quarantined unless an earlier record's size for it holds: then this record is
    stale). A page quarantined here stays in ``pages`` as _QUARANTINED."""
    if len(sizes) != len(keys):
        return "no page sizes", None
    for k, n in zip(keys, sizes, strict=True):
        if k not in pages:
            return _MISSING, k
        if pages[k] == _QUARANTINED:
            return _REFUSED, k
        if pages[k] == n:
            continue
        if k in held:
            return "a page's size differs from the record's", None
        _moved(files.path, page_path(files.pages_path, k),
               f"{pages[k]} bytes, its record says {n}", reasons)
        pages[k] = _QUARANTINED
        return _REFUSED, k
    return "", None


def scan_pages(files: DiskFiles) -> tuple[dict[PageKey, int], int]:
    """This model's page files and their sizes, and the bytes of leftover temporary
    files that could not be removed (the others are)."""
    out: dict[PageKey, int] = {}
    stray = 0
    if not files.pages_path.is_dir():
        return out, stray
    for sub in os.scandir(files.pages_path):
        if not sub.is_dir(follow_symlinks=False):
            continue
        for entry in os.scandir(sub.path):
            if entry.name.startswith(TMP_PREFIX):
                stray += sweep(Path(entry.path))
                continue
            stem = entry.name[: -len(PAGE_SUFFIX)]
            if not entry.name.endswith(PAGE_SUFFIX) or len(stem) != 32 \
                    or not entry.is_file(follow_symlinks=False):
                continue
            try:
                key = PageKey(bytes.fromhex(stem))
                out[key] = entry.stat(follow_symlinks=False).st_size
            except (ValueError, OSError):
                continue
    return out, stray


def sweep(p: Path) -> int:
    """Remove a leftover of an interrupted write; its bytes if it cannot be."""
    try:
        size = p.lstat().st_size
        p.unlink()
    except FileNotFoundError:
        return 0
    except OSError as e:
        log.warning("disk: cannot remove the leftover %s (%s); counted in the budget", p, e)
        return size
    log.info("disk: removed %s, left by an interrupted write", p.name)
    return 0
