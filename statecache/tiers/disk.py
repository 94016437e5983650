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
methods (``write_file``, ``read_file``, ``quarantine_file``, ``utime``) touch no shared
state and run without it. A record being written is reserved in the budget, with the
pages it adds, from before its temporary files exist until it is committed or
cancelled. A page lives while a record (stored or being written) names it: the budget
counts each page once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import xxhash

from statecache.buffers import Buffer
from statecache.formats import codec
from statecache.formats.diskfmt import (
    KEY_BYTES,
    SUFFIX,
    TMP_PREFIX,
    BadFile,
    file_name,
    file_size,
    fsync_dir,
    open_regular,
    read_checkpoint,
    read_meta,
    record_from_meta,
    valid_id,
    write_atomic,
    write_checkpoint,
)
from statecache.formats.pagefmt import BadPage, decode_page, encode_page, max_size
from statecache.kvpages import PageData, PageKey, page_bytes, page_nbytes, unpack_keys
from statecache.records import CheckpointRecord, Record
from statecache.sizes import format_size
from statecache.tiers.background import run_in_background
from statecache.tiers.tier import TierStats

log = logging.getLogger(__name__)

QUARANTINE = "quarantine"
PAGE_SUFFIX = ".kvp"
# Page files are written by a few threads at once: a state of 2,400 pages is 2,400 small
# fdatasyncs, and one at a time each waits for the device.
_IO_THREADS = 4
_BATCH = 32  # pages a write task
# Reads need no threads to keep the device busy: a reader opens its next _AHEAD files and
# asks for them all (WILLNEED) before it reads one, so the kernel has them in flight. The
# threads only share the MACs and decoding; on two cores one reader beats two, whose GIL
# hand-offs cost more than the second core gives (bench.pages, hybrid-tiny: docs/design.md,
# "Reading pages from disk").
_READERS = max(1, (os.cpu_count() or 2) // 2)


def _ahead() -> int:
    """Files a reader opens at once: 128 (best measured), or a small share of a low
    open-file limit (macOS shells start at 256)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 128
    return max(8, min(128, soft // (8 * _READERS)))


_AHEAD = _ahead()
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)
_io_lock = threading.Lock()
_readers: ThreadPoolExecutor | None = None
_writers: ThreadPoolExecutor | None = None


def _pool_of(kind: str) -> ThreadPoolExecutor:
    global _readers, _writers
    with _io_lock:
        if kind == "read":
            if _readers is None:
                _readers = ThreadPoolExecutor(_READERS, "statecache-page-read")
            return _readers
        if _writers is None:  # as low a priority as the disk writer that uses them
            _writers = ThreadPoolExecutor(_IO_THREADS, "statecache-page-write",
                                          initializer=run_in_background)
        return _writers


def _batches(items: list[int], size: int = _BATCH) -> list[list[int]]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def ensure_dir(path: Path) -> None:
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)


def pages_dir(directory: Path, fingerprint: str) -> Path:
    """The directory of one model's pages (its name derived from the fingerprint)."""
    return directory / f"pages-{xxhash.xxh3_64_hexdigest(fingerprint.encode())}"


def page_path(pages: Path, key: PageKey) -> Path:
    return Path(page_file(str(pages), key))


def page_file(pages: str, key: PageKey) -> str:
    """``page_path`` as a string (a restore opens thousands: no Path objects)."""
    h = key.hex()
    return f"{pages}/{h[:2]}/{h}{PAGE_SUFFIX}"


def quarantine(directory: Path, path: Path, reason: str, *, quiet: bool = False) -> bool:
    """Move a bad file (or link) aside; never served again. Returns True if moved."""
    qdir = directory / QUARANTINE
    try:
        ensure_dir(qdir)
        os.replace(path, qdir / f"{path.name}.{time.time_ns()}")
    except FileNotFoundError:
        return False
    except OSError as e:
        log.error("disk: cannot quarantine %s (%s): %s", path.name, reason, e)
        return False
    log.log(logging.DEBUG if quiet else logging.WARNING, "disk: quarantined %s: %s",
            path.name, reason)
    return True


def _same_claims(found: CheckpointRecord, rec: Record, keys: bytes) -> bool:
    """The record rebuilt from a file's authenticated metadata (its id recomputed from its
    content) says exactly what the indexed one says, and names the pages ``keys``."""
    return (
        found.id == rec.id
        and found.n == rec.n
        and (not isinstance(rec, CheckpointRecord) or found.tokens == rec.tokens)
        and found.fingerprint == rec.fingerprint
        and found.tenant == rec.tenant
        and found.state_format == rec.state_format
        and found.kind is rec.kind
        and found.owner is rec.owner
        and found.lane == rec.lane
        and found.nbytes == rec.nbytes
        and found.keys == keys
        and found.rest_nbytes == rec.rest_nbytes
    )


class BadPageFile(BadFile):
    """A page file that must never be used: the records that name it are misses."""

    def __init__(self, key: PageKey, reason: str) -> None:
        super().__init__(f"page {key.hex()}: {reason}")
        self.key = key


@dataclass(slots=True, eq=False)
class _Page:
    size: int  # on disk; while not written, the most it can take
    refs: int = 0  # records, stored or being written, that name it
    written: bool = False


@dataclass(slots=True)
class Stored:
    """A checkpoint as read from disk: its whole record, its rest and its pages (None:
    not read, the caller has it)."""

    record: CheckpointRecord
    rest: Buffer
    pages: list[Buffer | None]


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
        # f16 KV as 2-byte planes, a recurrent state (f32) as 4-byte ones
        self.page_packer = codec.Packer(level, 2)
        self.rest_packer = codec.Packer(level, 4)
        self.path = path
        self.pages_path = pages_dir(path, fingerprint)
        self._pages_str = str(self.pages_path)
        self.budget = budget
        # records held at most (0: no bound but the bytes): the pool keeps a head of each
        # in memory, so this bounds the index, whose records KV pages make small on disk
        self.max_records = max_records
        self.fingerprint = fingerprint
        self.state_format = state_format
        self.page_size = page_size
        # No key: an ephemeral one (benchmarks), so nothing written outlives the process.
        self._key = key if key is not None else os.urandom(KEY_BYTES)
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
        ensure_dir(path)

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

    def stats(self) -> TierStats:
        return TierStats(self.name, self.label, str(self.path.resolve()), entries=len(self),
                         bytes=self.used, budget=self.budget, pages=len(self._pages),
                         page_bytes=self.page_bytes, evictions=self.evictions)

    # -- start -------------------------------------------------------------------------

    def scan(self, found: Callable[[CheckpointRecord], None]) -> int:
        """Index this model's valid records and their pages, quarantine bad records and
        records whose pages are missing, remove pages no record names, sweep temp files;
        the number of records kept.

        Each valid record is given to ``found`` as it is read (in no order), before the
        tier holds it: only its size and page keys stay here, and a record the budget
        has no room for is evicted (``on_evict``) once all are read, oldest first.
        The caller holds the directory's lock, so every temporary file is a leftover of
        a crash; one that cannot be removed is counted in the budget.
        """
        on_disk = self._scan_pages()
        kept: list[tuple[float, str, int, bytes]] = []
        reasons: Counter[str] = Counter()  # one warning for the whole scan, not one per file
        for entry in os.scandir(self.path):
            p = Path(entry.path)
            if entry.name.startswith(TMP_PREFIX):
                self._sweep(p)
                continue
            if not entry.name.endswith(SUFFIX):
                continue  # not ours
            stem = entry.name[: -len(SUFFIX)]
            if entry.is_symlink():
                self._quarantine(p, "symlink", reasons)
                continue
            if not valid_id(stem):
                self._quarantine(p, "file name is not a checkpoint id", reasons)
                continue
            try:
                fm = read_meta(p, self._key)
                if fm.meta["fingerprint"] != self.fingerprint:
                    continue  # another model's: leave it alone
                if fm.meta["state_format"] != self.state_format:
                    continue  # another build's state format: not ours to judge
                rec = record_from_meta(fm.meta, self.page_size)
                if rec.id != stem:
                    raise BadFile("file name does not match its id")
            except BadFile as e:
                self._quarantine(p, str(e), reasons)
                continue
            except OSError as e:
                log.warning("disk: skipped %s: %s", entry.name, e)
                continue
            if not all(k in on_disk for k in rec.page_keys):
                self._quarantine(p, "a page is missing", reasons)
                continue
            found(rec)
            kept.append((fm.mtime, rec.id, fm.file_size, rec.keys))
        if reasons:
            log.warning(
                "disk: moved %d bad file(s) to %s (%s); `statecache purge --quarantined "
                "--yes` removes them",
                sum(reasons.values()),
                self.path / QUARANTINE,
                ", ".join(f"{n} {why}" for why, n in reasons.most_common()),
            )
        kept.sort(key=lambda t: t[0])
        for _, entry_id, size, keys in kept:
            self._sizes[entry_id] = size
            self.used += size
            self._keys[entry_id] = keys
            for k in unpack_keys(keys):
                page = self._pages.get(k)
                if page is None:
                    page = self._pages[k] = _Page(on_disk[k], 0, True)
                    self.used += page.size
                    self.page_bytes += page.size
                page.refs += 1
        orphans = [k for k in on_disk if k not in self._pages]
        for k in orphans:
            page_path(self.pages_path, k).unlink(missing_ok=True)
        if orphans:
            log.info("disk: removed %d page(s) no checkpoint names", len(orphans))
        self._shrink()
        return len(self._sizes)

    def _scan_pages(self) -> dict[PageKey, int]:
        """This model's page files and their sizes (temp files swept)."""
        out: dict[PageKey, int] = {}
        if not self.pages_path.is_dir():
            return out
        for sub in os.scandir(self.pages_path):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                if entry.name.startswith(TMP_PREFIX):
                    self._sweep(Path(entry.path))
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
        return out

    def _sweep(self, p: Path) -> None:
        try:
            size = p.lstat().st_size
            p.unlink()
        except FileNotFoundError:
            return
        except OSError as e:
            log.warning("disk: cannot remove the leftover %s (%s); counted in the budget", p, e)
            self.stray += size
            self.used += size
            return
        log.info("disk: removed %s, left by an interrupted write", p.name)

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

    # -- file I/O (no lock) ------------------------------------------------------------

    def write_file(self, rec: CheckpointRecord, rest: Buffer, pages: Sequence[PageData],
                   which: Sequence[int]) -> tuple[int, dict[PageKey, int]]:
        """Write the pages ``which`` of ``rec``, then its record (the pages durable
        before the record that names them); the sizes written."""
        keys = rec.page_keys
        dirs = {page_path(self.pages_path, keys[i]).parent for i in which}
        for d in dirs:
            ensure_dir(d)

        def write(batch: list[int]) -> list[tuple[PageKey, int]]:
            out = []
            for i in batch:
                path = page_path(self.pages_path, keys[i])
                parts = encode_page(self._key, keys[i], page_bytes(pages[i]),
                                    self.page_packer.encode)
                out.append((keys[i], write_atomic(path.parent, path.name, parts,
                                                  sync_dir=False)))
            return out

        sizes: dict[PageKey, int] = {}
        for done in _pool_of("write").map(write, _batches(list(which))):
            sizes.update(done)
        for d in dirs:
            fsync_dir(d)
        if dirs:
            fsync_dir(self.pages_path)
        return write_checkpoint(self.path, rec, rest, self._key,
                                self.rest_packer.encode), sizes

    def read_file(self, rec: Record, keys: bytes, have: Sequence[bool] = ()) -> Stored:
        """The whole record of ``rec`` (a head or a whole one), its rest and the pages
        it names (but those ``have`` marks: the caller holds them), authenticated and
        bound to it (``keys``: its page keys as this tier counts them, read under the
        pool's lock); raises BadFile (BadPageFile for a page)."""
        fm, rest = read_checkpoint(self.path / file_name(rec.id), self._key)
        whole = record_from_meta(fm.meta, self.page_size)
        if not _same_claims(whole, rec, keys):
            raise BadFile("metadata does not match the indexed entry")
        pkeys = whole.page_keys
        pages: list[Buffer | None] = [None] * len(pkeys)
        want = [i for i in range(len(pkeys)) if not (i < len(have) and have[i])]

        def read(batch: list[int]) -> list[tuple[int, Buffer]]:
            return list(zip(batch, self.read_pages([pkeys[i] for i in batch]), strict=True))

        share = -(-len(want) // _READERS)  # one task a reader
        for done in _pool_of("read").map(read, _batches(want, max(share, _BATCH))):
            for i, page in done:
                pages[i] = page
        return Stored(whole, rest, pages)

    def read_page(self, key: PageKey) -> Buffer:
        """One page's raw bytes, authenticated; raises BadPageFile."""
        return self.read_pages([key])[0]

    def read_pages(self, keys: Sequence[PageKey]) -> list[Buffer]:
        """Pages' raw bytes, authenticated; raises BadPageFile for the first bad one.
        The next _AHEAD files are open and asked for before one is read."""
        ahead: deque[tuple[PageKey, int, int]] = deque()  # key, fd, size
        todo = iter(keys)
        willneed = len(keys) > 1
        out: list[Buffer] = []
        try:
            while True:
                if not ahead:  # in groups: reads asked for together reach the device so
                    ahead.extend(self._open_page(key, willneed) for key in islice(todo, _AHEAD))
                    if not ahead:
                        return out
                key, fd, size = ahead.popleft()
                try:
                    blob = bytearray(size)
                    view = memoryview(blob)
                    got = 0
                    while got < size:
                        k = os.readv(fd, [view[got:]])
                        if k == 0:
                            break
                        got += k
                finally:
                    os.close(fd)
                try:
                    out.append(decode_page(self._key, key, view[:got]))
                except BadPage as e:
                    raise BadPageFile(key, str(e)) from None
        finally:
            for _, fd, _ in ahead:
                os.close(fd)

    def _open_page(self, key: PageKey, willneed: bool) -> tuple[PageKey, int, int]:
        """A page file open for reading, no bigger than the index holds it (a file put
        in its place may be huge), its read started where ``willneed``."""
        try:
            fd, st = open_regular(page_file(self._pages_str, key))
        except FileNotFoundError:
            raise BadPageFile(key, "missing") from None
        except BadFile as e:
            raise BadPageFile(key, str(e)) from None
        page = self._pages.get(key)
        if page is None or st.st_size > page.size:
            os.close(fd)
            raise BadPageFile(key, f"{st.st_size} bytes, more than the index holds")
        if willneed and _WILLNEED is not None:
            os.posix_fadvise(fd, 0, 0, _WILLNEED)
        return key, fd, st.st_size

    def quarantine_file(self, entry_id: str, reason: str) -> bool:
        return quarantine(self.path, self.path / file_name(entry_id), reason)

    def quarantine_page(self, key: PageKey, reason: str) -> bool:
        return quarantine(self.path, page_path(self.pages_path, key), reason)

    def utime(self, entry_id: str) -> None:
        with contextlib.suppress(OSError):  # mtime carries the LRU order across restarts
            os.utime(self.path / file_name(entry_id))

    # -- one thread only (benchmarks, tests) -------------------------------------------

    def write(self, rec: CheckpointRecord, rest: Buffer, pages: Sequence[PageData] = ()
              ) -> bool:
        """Reserve, write and commit in one call; False if refused or failed."""
        if rec.id in self._sizes:
            return True
        which = self.reserve(rec, [page_nbytes(p) for p in pages])
        if which is None:
            return False
        try:
            size, sizes = self.write_file(rec, rest, pages, which)
        except OSError as e:
            log.error("disk: writing %s failed: %s", rec.id, e)
            self.cancel(rec.id)
            return False
        return self.commit(rec.id, size, sizes)

    def read(self, entry_id: str, rec: Record) -> Stored | None:
        """The verified record, rest and pages, or None (a bad file is quarantined and
        forgotten)."""
        if entry_id not in self._sizes:
            return None
        try:
            got = self.read_file(rec, self._keys[entry_id])
        except BadPageFile as e:
            self._quarantine(page_path(self.pages_path, e.key), str(e))
            self.drop_page(e.key)
            return None
        except BadFile as e:
            self._quarantine(self.path / file_name(entry_id), str(e))
            self.forget(entry_id)
            return None
        except OSError as e:
            log.warning("disk: reading %s failed: %s", entry_id, e)
            self.forget(entry_id)
            return None
        self.touch(entry_id)
        self.utime(entry_id)
        return got

    def _quarantine(self, path: Path, reason: str, batch: Counter[str] | None = None) -> None:
        if quarantine(self.path, path, reason, quiet=batch is not None):
            self.quarantined += 1
            if batch is not None:
                batch[reason] += 1

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
