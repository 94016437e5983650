"""Disk tier: one authenticated record file per FULL checkpoint, its KV pages in files of
their own (each page once, whatever number of records name it), a byte budget,
quarantine.

Layout of the directory (other models' records may share it)::

    <id>.ckpt                     a record: its metadata (tokens, page keys ...) and rest
    pages-<model>/<xx>/<key>.kvp  a KV page (statecache.formats.pagefmt), xx its key's first byte
    quarantine/                   what was refused

Scan lists the page files, reads header + metadata of every record and checks their MAC
(cheap), and drops records whose pages are missing and pages no record names; the MAC
of a record's rest and of each page is verified on every read, before any byte is used.

In memory the tier keeps, per record, its size and its page keys packed (16 bytes a
page, for the pages' reference counts), and per page its size and count: not the
records' tokens (``read_file`` gives back the whole record from its file).

Two halves, so the pool can keep file I/O out of its lock: bookkeeping (``reserve``,
``commit``, ``pin``, ``touch``, ``remove`` ...) runs under the pool's lock; the file
methods (``write_file``, ``read_file``, ``quarantine_file``, ``utime``: the tier's
``files``, statecache.tiers.diskfiles) touch no shared state and run without it. A
record being written is reserved in the budget, with the pages it adds, from before
its temporary files exist until it is committed or cancelled. A page lives while a
record (stored or being written) names it: the budget counts each page once.
"""

from __future__ import annotations

import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from statecache.buffers import Buffer
from statecache.formats import codec
from statecache.formats.diskfmt import KEY_BYTES, file_name, file_size
from statecache.formats.pagefmt import max_size
from statecache.kvpages import PageData, PageKey, unpack_keys
from statecache.records import CheckpointRecord, Record
from statecache.sizes import format_size
from statecache.tiers.diskfiles import DiskFiles, Stored, page_path
from statecache.tiers.diskscan import Lost, scan_pages, scan_records
from statecache.tiers.tier import TierStats

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Page:
    size: int  # on disk; while not written, the most it can take
    refs: int = 0  # records, stored or being written, that name it
    written: bool = False


class DiskTier:
    """FULL checkpoints of one model fingerprint in a directory other models may share."""

    name = "disk"
    label = "Disk"
    prior_bandwidth: float | None = 1e9  # bytes/s, read and checked, until measured

    def __init__(
        self,
        path: Path,
        budget: int,
        fingerprint: str,
        *,
        state_format: int,
        page_size: int,
        key: bytes | None = None,
        on_evict: Callable[[str], None] | None = None,
        level: int = codec.DEFAULT_LEVEL,
        max_records: int = 0,
    ) -> None:
        # No key: an ephemeral one (benchmarks), so nothing written outlives the process.
        self.files = DiskFiles(path, fingerprint, state_format=state_format,
                               page_size=page_size, level=level, limit=self._limit,
                               key=key if key is not None else os.urandom(KEY_BYTES))
        self.path = path
        self.pages_path = self.files.pages_path
        self.budget = budget
        # records held at most (0: no bound but the bytes): the pool keeps a head of each
        # in memory, so this bounds the index, whose records KV pages make small on disk
        self.max_records = max_records
        self.fingerprint = fingerprint
        self.state_format = state_format
        self.page_size = page_size
        self.used = 0  # records + pages + reserved + stray temp files
        self.page_bytes = 0  # of ``used``, the pages' (reserved ones at their most)
        self.stray = 0  # leftover temporary files that could not be removed
        self.quarantined = 0
        self.evictions = 0
        self._on_evict = on_evict
        self._sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._reserved: dict[str, int] = {}
        self._keys: dict[str, bytes] = {}  # stored or reserved record's page keys, packed
        self._pages: dict[PageKey, _Page] = {}
        self._pins: Counter[str] = Counter()  # files being read: not evicted meanwhile
        self._warned_budget = False

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._sizes

    @property
    def pages(self) -> int:
        return len(self._pages)

    def ids(self) -> Iterator[str]:
        """Ids from least to most recently used."""
        return iter(self._sizes)

    def reserved_ids(self) -> Iterator[str]:
        """Ids whose files are being written."""
        return iter(self._reserved)

    def keys(self, entry_id: str) -> bytes:
        """The page keys of a record stored or being written, packed."""
        return self._keys[entry_id]

    def has_page(self, key: PageKey) -> bool:
        page = self._pages.get(key)
        return page is not None and page.written

    @classmethod
    def off(cls, why: str) -> TierStats:
        """The figures of a disk tier that is off: nothing held, no budget."""
        return TierStats(cls.name, cls.label, status=why, entries=0, bytes=0, budget=0,
                         pages=0, page_bytes=0, evictions=0, bandwidth=0.0)

    def stats(self) -> TierStats:
        return TierStats(self.name, self.label, str(self.path.resolve()), entries=len(self),
                         bytes=self.used, budget=self.budget, pages=len(self._pages),
                         page_bytes=self.page_bytes, evictions=self.evictions)

    # -- start -------------------------------------------------------------------------

    def scan(self, found: Callable[[CheckpointRecord], None], lost: Lost | None = None) -> int:
        """Index this model's valid records and their pages, quarantine bad records and
        records whose pages are missing, remove pages no record names, sweep temp files;
        the number of records kept.

        Each valid record is given to ``found`` as it is read (in no order), before the
        tier holds it: only its size and page keys stay here, and a record the budget
        has no room for is evicted (``on_evict``) once all are read, oldest first.
        The caller holds the directory's lock, so every temporary file is a leftover of
        a crash; one that cannot be removed is counted in the budget.
        """
        on_disk, stray = scan_pages(self.files)
        listing = scan_records(self.files, found, on_disk, lost)
        self.stray += stray + listing.stray
        self.used += stray + listing.stray
        self.quarantined += listing.moved
        for _, entry_id, size, keys in listing.kept:
            self._sizes[entry_id] = size
            self.used += size
            self._keys[entry_id] = keys
            for k in unpack_keys(keys):
                page = self._pages.get(k)
                if page is None:  # at the size its records say, which its file has
                    page = self._pages[k] = _Page(listing.pages[k], 0, True)
                    self.used += page.size
                    self.page_bytes += page.size
                page.refs += 1
        orphans = [k for k in on_disk if k not in self._pages]  # (quarantined: moved)
        for k in orphans:
            page_path(self.pages_path, k).unlink(missing_ok=True)
        if orphans:
            log.info("disk: removed %d page(s) no checkpoint names", len(orphans))
        self._shrink()
        return len(self._sizes)

    # -- bookkeeping (under the pool's lock) -------------------------------------------

    def reserve(self, rec: CheckpointRecord, page_sizes: Sequence[int]) -> list[int] | None:
        """Room for ``rec``'s file and the pages the disk lacks (``page_sizes``: raw bytes
        of each of its pages), evicting old files; the indices of the pages this write
        must write, or None if refused."""
        if rec.id in self._sizes or rec.id in self._reserved:
            raise RuntimeError(f"disk: {rec.id} is already stored or being written")
        keys = rec.page_keys
        if len(page_sizes) != len(keys):
            raise RuntimeError("disk: page sizes and keys disagree")
        size = file_size(rec)
        new = {k: max_size(n) for k, n in zip(keys, page_sizes, strict=True)
               if k not in self._pages}
        if size + sum(new.values()) > self.budget:
            if not self._warned_budget:
                self._warned_budget = True
                log.warning(
                    "disk: a %s checkpoint exceeds the disk budget of %s; such states "
                    "are not written",
                    format_size(size + sum(new.values())),
                    format_size(self.budget),
                )
            return None
        for k, n in new.items():
            self._pages[k] = _Page(n)
            self.used += n
            self.page_bytes += n
        self._hold(keys)
        self._reserved[rec.id] = size
        self._keys[rec.id] = rec.keys
        self.used += size
        self._shrink()
        if self.used > self.budget:  # the rest is being read or written right now
            self.cancel(rec.id)
            return None
        return [i for i, k in enumerate(keys) if not self._pages[k].written]

    def commit(self, entry_id: str, size: int, page_sizes: dict[PageKey, int]) -> bool:
        """The reserved files are in place (the record took ``size`` bytes, the pages it
        wrote ``page_sizes``): index it as most recently used. False (the record is
        removed) when a page it names was dropped meanwhile and not written again."""
        for k, n in page_sizes.items():
            page = self._pages[k]
            if not page.written:
                self.used += n - page.size
                self.page_bytes += n - page.size
                page.size, page.written = n, True
        self.used += size - self._reserved.pop(entry_id)
        self._sizes[entry_id] = size
        if all(self._pages[k].written for k in unpack_keys(self._keys[entry_id])):
            return True
        self.remove(entry_id)
        return False

    def cancel(self, entry_id: str) -> None:
        self.used -= self._reserved.pop(entry_id)
        self._let_go(unpack_keys(self._keys.pop(entry_id)))

    def pin(self, entry_id: str) -> None:
        if entry_id not in self._sizes:
            raise RuntimeError(f"disk: pinning {entry_id} which is not stored")
        self._pins[entry_id] += 1

    def unpin(self, entry_id: str) -> None:
        self._pins[entry_id] -= 1
        if self._pins[entry_id] <= 0:
            del self._pins[entry_id]

    def touch(self, entry_id: str) -> None:
        self._sizes.move_to_end(entry_id)

    def remove(self, entry_id: str) -> bool:
        if entry_id not in self._sizes:
            return False
        # A metadata operation, fast: kept under the lock so no rewrite of the same
        # id can slip in between forgetting the file and unlinking it.
        (self.path / file_name(entry_id)).unlink(missing_ok=True)
        self.forget(entry_id)
        return True

    def forget(self, entry_id: str) -> None:
        size = self._sizes.pop(entry_id, None)
        if size is not None:
            self.used -= size
            self._let_go(unpack_keys(self._keys.pop(entry_id)))

    def drop_page(self, key: PageKey) -> list[str]:
        """A page was found bad or gone: forget it and remove the records that name it
        (not ones being written: they write it anew); their ids."""
        gone = [i for i, keys in self._keys.items()
                if i in self._sizes and key in unpack_keys(keys)]
        for entry_id in gone:
            self.remove(entry_id)
        page = self._pages.get(key)
        if page is not None and page.written:  # still named by a write in progress
            page.written = False
        return gone

    def _hold(self, keys: Sequence[PageKey]) -> None:
        for k in keys:
            self._pages[k].refs += 1

    def _let_go(self, keys: Sequence[PageKey]) -> None:
        """Drop one reference to each page; a page no record names is deleted."""
        for k in keys:
            page = self._pages[k]
            page.refs -= 1
            if page.refs == 0:
                del self._pages[k]
                self.used -= page.size
                self.page_bytes -= page.size
                page_path(self.pages_path, k).unlink(missing_ok=True)

    def _over(self) -> bool:
        return self.used > self.budget or (
            self.max_records > 0 and len(self._sizes) + len(self._reserved) > self.max_records)

    def _shrink(self) -> None:
        while self._over():
            victim = next((i for i in self._sizes if i not in self._pins), None)
            if victim is None:
                break
            self.remove(victim)
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict(victim)

    # -- file I/O (no lock): the files' own ------------------------------------------

    def _limit(self, key: PageKey) -> int | None:
        """The most bytes a page file may hold: as the index holds it (None: not held)."""
        page = self._pages.get(key)
        return None if page is None else page.size

    def write_file(self, rec: CheckpointRecord, rest: Buffer, pages: Sequence[PageData],
                   which: Sequence[int]) -> tuple[int, dict[PageKey, int]]:
        return self.files.write_file(rec, rest, pages, which)

    def read_file(self, rec: Record, keys: bytes, have: Sequence[bool] = ()) -> Stored:
        return self.files.read_file(rec, keys, have)

    def read_page(self, key: PageKey) -> Buffer:
        return self.files.read_page(key)

    def quarantine_file(self, entry_id: str, reason: str) -> bool:
        return self.files.quarantine_file(entry_id, reason)

    def quarantine_page(self, key: PageKey, reason: str) -> bool:
        return self.files.quarantine_page(key, reason)

    def utime(self, entry_id: str) -> None:
        self.files.utime(entry_id)

    def sanity_check(self) -> None:
        pages = sum(p.size for p in self._pages.values())
        if pages != self.page_bytes:
            raise RuntimeError(f"disk: {self.page_bytes} page bytes accounted, {pages} held")
        total = sum(self._sizes.values()) + sum(self._reserved.values()) + self.stray + pages
        if total != self.used:
            raise RuntimeError(f"disk: {self.used} bytes accounted, files hold {total}")
        if self.used > self.budget:
            raise RuntimeError(f"disk: {self.used} bytes over a budget of {self.budget}")
        if set(self._reserved) & set(self._sizes):
            raise RuntimeError("disk: a file is both stored and being written")
        if set(self._keys) != set(self._sizes) | set(self._reserved):
            raise RuntimeError("disk: page lists differ from the records held")
        refs: Counter[PageKey] = Counter()
        for keys in self._keys.values():
            refs.update(unpack_keys(keys))
        if set(refs) != set(self._pages):
            raise RuntimeError("disk: a page no record names, or a record names no page held")
        for k, page in self._pages.items():
            if page.refs != refs[k]:
                raise RuntimeError(f"disk: page {k.hex()} counts {page.refs} records, "
                                   f"{refs[k]} name it")
        for entry_id in self._sizes:
            if any(not self._pages[k].written for k in unpack_keys(self._keys[entry_id])):
                raise RuntimeError(f"disk: record {entry_id} names a page not written")
        # A pinned id may be gone already: removed while its reader held the file.
