"""The disk tier's files: the half of the tier that touches no shared state, so the
pool runs it without its lock (``DiskTier`` keeps the bookkeeping, under the lock).

One authenticated record file per FULL checkpoint (statecache.formats.diskfmt), its KV
pages in files of their own (statecache.formats.pagefmt), each page once; what cannot
be trusted is moved to ``quarantine/``. Pages are written by a few threads at once and
read ahead in groups (``posix_fadvise(WILLNEED)``), so the device has them in flight
together (docs/design.md, "Reading pages from disk"). Every byte is authenticated
before it is used: a record's rest and each page on every read, a record's metadata at
start.
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

import xxhash

from statecache.buffers import Buffer
from statecache.formats import codec
from statecache.formats.diskfmt import (
    BadFile,
    FileMeta,
    file_name,
    fsync_dir,
    open_regular,
    read_checkpoint,
    read_meta,
    record_from_meta,
    same_claims,
    write_atomic,
    write_checkpoint,
)
from statecache.formats.pagefmt import BadPage, decode_page, encode_page
from statecache.kvpages import PageData, PageKey, page_bytes
from statecache.records import CheckpointRecord, Record
from statecache.tiers.background import run_in_background

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


class BadPageFile(BadFile):
    """A page file that must never be used: the records that name it are misses."""

    def __init__(self, key: PageKey, reason: str, *, missing: bool = False) -> None:
        super().__init__(f"page {key.hex()}: {reason}")
        self.key = key
        self.missing = missing  # gone, not refused


@dataclass(slots=True)
class Stored:
    """A checkpoint as read from disk: its whole record, its rest and its pages (None:
    not read, the caller has it)."""

    record: CheckpointRecord
    rest: Buffer
    pages: list[Buffer | None]


class DiskFiles:
    def __init__(self, path: Path, fingerprint: str, *, state_format: int, page_size: int,
                 key: bytes, level: int, limit: Callable[[PageKey], int | None]) -> None:
        # f16 KV as 2-byte planes, a recurrent state (f32) as 4-byte ones
        self.page_packer = codec.Packer(level, 2)
        self.rest_packer = codec.Packer(level, 4)
        self.path = path
        self.pages_path = pages_dir(path, fingerprint)
        self._pages_str = str(self.pages_path)
        self.fingerprint = fingerprint
        self.state_format = state_format
        self.page_size = page_size
        self._key = key
        self._limit = limit  # the most bytes the index holds a page at (None: not held)
        ensure_dir(path)

    def read_meta(self, path: Path) -> FileMeta:
        """A record file's header and metadata, authenticated; raises BadFile."""
        return read_meta(path, self._key)

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
        # the record says each page's size: a page this write did not write is held at
        # its size by the index (a page dropped meanwhile fails the commit)
        claimed = [sizes[k] if k in sizes else self._limit(k) or 0 for k in keys]
        return write_checkpoint(self.path, rec, rest, self._key,
                                self.rest_packer.encode, claimed), sizes

    def read_file(self, rec: Record, keys: bytes, have: Sequence[bool] = ()) -> Stored:
        """The whole record of ``rec`` (a head or a whole one), its rest and the pages
        it names (but those ``have`` marks: the caller holds them), authenticated and
        bound to it (``keys``: its page keys as this tier counts them, read under the
        pool's lock); raises BadFile (BadPageFile for a page)."""
        fm, rest = read_checkpoint(self.path / file_name(rec.id), self._key)
        whole = record_from_meta(fm.meta, self.page_size)
        if not same_claims(whole, rec, keys):
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
            raise BadPageFile(key, "missing", missing=True) from None
        except BadFile as e:
            raise BadPageFile(key, str(e)) from None
        limit = self._limit(key)
        if limit is None or st.st_size > limit:
            os.close(fd)
            raise BadPageFile(key, f"{st.st_size} bytes, more than the index holds")
        if willneed and _WILLNEED is not None:
            os.posix_fadvise(fd, 0, 0, _WILLNEED)
        return key, fd, st.st_size

    def quarantine_file(self, entry_id: str, reason: str) -> bool:
        return quarantine(self.path, self.path / file_name(entry_id), reason)

    def quarantine_page(self, key: PageKey, reason: str) -> bool:
        """Quiet: the pool logs the page with the checkpoints it took (pool/lost.py)."""
        return quarantine(self.path, page_path(self.pages_path, key), reason, quiet=True)

    def utime(self, entry_id: str) -> None:
        with contextlib.suppress(OSError):  # mtime carries the LRU order across restarts
            os.utime(self.path / file_name(entry_id))
