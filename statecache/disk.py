"""Disk tier: one authenticated file per FULL checkpoint, a byte budget, quarantine.

Scan reads header + metadata of every file and checks their MAC (cheap); the MAC over
the whole file is verified on every read, before any byte is served.

Two halves, so the pool can keep file I/O out of its lock: bookkeeping (``reserve``,
``commit``, ``pin``, ``touch``, ``remove`` ...) runs under the pool's lock; the file
methods (``write_file``, ``read_file``, ``quarantine_file``, ``utime``) touch no shared
state and run without it. A file being written is reserved in the budget from before
its temporary file exists until it is committed or cancelled.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

from statecache.diskfmt import (
    KEY_BYTES,
    SUFFIX,
    TMP_PREFIX,
    BadFile,
    file_name,
    file_size,
    read_checkpoint,
    read_meta,
    record_from_meta,
    valid_id,
    write_checkpoint,
)
from statecache.records import CheckpointRecord
from statecache.sizes import format_size

log = logging.getLogger(__name__)

QUARANTINE = "quarantine"

Buffer = bytes | bytearray | memoryview


def ensure_dir(path: Path) -> None:
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)


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


def _same_claims(meta: dict[str, object], rec: CheckpointRecord) -> bool:
    """The authenticated metadata says exactly what the indexed record says."""
    return (
        meta["id"] == rec.id
        and meta["tokens"] == rec.tokens
        and meta["fingerprint"] == rec.fingerprint
        and meta["tenant"] == rec.tenant
        and meta["state_format"] == rec.state_format
        and meta["kind"] == rec.kind.value
        and meta["owner"] == rec.owner.value
        and meta["lane"] == rec.lane
        and meta["nbytes"] == rec.nbytes
    )


class DiskTier:
    """FULL checkpoints of one model fingerprint in a directory other models may share."""

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
    ) -> None:
        self.path = path
        self.budget = budget
        self.fingerprint = fingerprint
        self.state_format = state_format
        self.page_size = page_size
        # No key: an ephemeral one (benchmarks), so nothing written outlives the process.
        self._key = key if key is not None else os.urandom(KEY_BYTES)
        self.used = 0  # committed files + reserved (being written) + stray temp files
        self.stray = 0  # leftover temporary files that could not be removed
        self.quarantined = 0
        self.evictions = 0
        self._on_evict = on_evict
        self._sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._reserved: dict[str, int] = {}
        self._pins: Counter[str] = Counter()  # files being read: not evicted meanwhile
        self._warned_budget = False
        ensure_dir(path)

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._sizes

    def ids(self) -> Iterator[str]:
        """Ids from least to most recently used."""
        return iter(self._sizes)

    def reserved_ids(self) -> Iterator[str]:
        """Ids whose files are being written."""
        return iter(self._reserved)

    # -- start -------------------------------------------------------------------------

    def scan(self) -> list[CheckpointRecord]:
        """Index this model's valid files (oldest first), quarantine bad ones, sweep temp files.

        The caller holds the directory's lock, so every temporary file is a leftover of
        a crash; one that cannot be removed is counted in the budget.
        """
        found: list[tuple[float, CheckpointRecord, int]] = []
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
            found.append((fm.mtime, rec, fm.file_size))
        if reasons:
            log.warning(
                "disk: moved %d bad file(s) to %s (%s); `statecache purge --quarantined "
                "--yes` removes them",
                sum(reasons.values()),
                self.path / QUARANTINE,
                ", ".join(f"{n} {why}" for why, n in reasons.most_common()),
            )
        found.sort(key=lambda t: t[0])
        for _, rec, size in found:
            self._sizes[rec.id] = size
            self.used += size
        self._shrink()
        return [rec for _, rec, _ in found if rec.id in self._sizes]

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

    def reserve(self, rec: CheckpointRecord) -> int | None:
        """Room for ``rec``'s file, evicting old files; its size, or None if refused."""
        if rec.id in self._sizes or rec.id in self._reserved:
            raise RuntimeError(f"disk: {rec.id} is already stored or being written")
        size = file_size(rec)
        if size > self.budget:
            if not self._warned_budget:
                self._warned_budget = True
                log.warning(
                    "disk: a %s checkpoint exceeds the disk budget of %s; such states "
                    "are not written",
                    format_size(size),
                    format_size(self.budget),
                )
            return None
        self._reserved[rec.id] = size
        self.used += size
        self._shrink()
        if self.used > self.budget:  # the rest is being read or written right now
            self.cancel(rec.id)
            return None
        return size

    def commit(self, entry_id: str) -> None:
        """The reserved file is in place: index it as most recently used."""
        self._sizes[entry_id] = self._reserved.pop(entry_id)

    def cancel(self, entry_id: str) -> None:
        self.used -= self._reserved.pop(entry_id)

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

    def _shrink(self) -> None:
        while self.used > self.budget:
            victim = next((i for i in self._sizes if i not in self._pins), None)
            if victim is None:
                break
            self.remove(victim)
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict(victim)

    # -- file I/O (no lock) ------------------------------------------------------------

    def write_file(self, rec: CheckpointRecord, data: Buffer) -> int:
        return write_checkpoint(self.path, rec, data, self._key)

    def read_file(self, rec: CheckpointRecord) -> bytearray:
        """The state bytes of ``rec``, authenticated and bound to it; raises BadFile."""
        fm, data = read_checkpoint(self.path / file_name(rec.id), self._key)
        if not _same_claims(fm.meta, rec):
            raise BadFile("metadata does not match the indexed entry")
        return data

    def quarantine_file(self, entry_id: str, reason: str) -> bool:
        return quarantine(self.path, self.path / file_name(entry_id), reason)

    def utime(self, entry_id: str) -> None:
        with contextlib.suppress(OSError):  # mtime carries the LRU order across restarts
            os.utime(self.path / file_name(entry_id))

    # -- one thread only (benchmarks, tests) -------------------------------------------

    def write(self, rec: CheckpointRecord, data: Buffer) -> bool:
        """Reserve, write and commit in one call; False if refused or failed."""
        if rec.id in self._sizes:
            return True
        if self.reserve(rec) is None:
            return False
        try:
            self.write_file(rec, data)
        except OSError as e:
            log.error("disk: writing %s failed: %s", rec.id, e)
            self.cancel(rec.id)
            return False
        self.commit(rec.id)
        return True

    def read(self, entry_id: str) -> bytearray | None:
        """The verified state bytes, or None (a bad file is quarantined and forgotten)."""
        if entry_id not in self._sizes:
            return None
        path = self.path / file_name(entry_id)
        try:
            fm, data = read_checkpoint(path, self._key)
            meta = fm.meta
            if (meta["id"], meta["fingerprint"], meta["state_format"]) != (
                entry_id, self.fingerprint, self.state_format
            ):
                raise BadFile("metadata does not match the indexed entry")
        except BadFile as e:
            self._quarantine(path, str(e))
            self.forget(entry_id)
            return None
        except OSError as e:
            log.warning("disk: reading %s failed: %s", entry_id, e)
            self.forget(entry_id)
            return None
        self.touch(entry_id)
        self.utime(entry_id)
        return data

    def _quarantine(self, path: Path, reason: str, batch: Counter[str] | None = None) -> None:
        if quarantine(self.path, path, reason, quiet=batch is not None):
            self.quarantined += 1
            if batch is not None:
                batch[reason] += 1

    def sanity_check(self) -> None:
        total = sum(self._sizes.values()) + sum(self._reserved.values()) + self.stray
        if total != self.used:
            raise RuntimeError(f"disk: {self.used} bytes accounted, files hold {total}")
        if self.used > self.budget:
            raise RuntimeError(f"disk: {self.used} bytes over a budget of {self.budget}")
        if set(self._reserved) & set(self._sizes):
            raise RuntimeError("disk: a file is both stored and being written")
        # A pinned id may be gone already: removed while its reader held the file.
