"""Disk tier: one file per FULL checkpoint, a byte budget, quarantine for bad files.

Scan reads header + metadata of every file (cheap); the digest over the whole file
is verified lazily, on every read, before any byte is served.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path

from statecache.diskfmt import (
    SUFFIX,
    BadFile,
    file_name,
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
_STALE_TMP_S = 3600.0


def ensure_dir(path: Path) -> None:
    if not path.is_dir():
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(path, 0o700)


def quarantine(directory: Path, path: Path, reason: str) -> bool:
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
    log.warning("disk: quarantined %s: %s", path.name, reason)
    return True


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
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        self.path = path
        self.budget = budget
        self.fingerprint = fingerprint
        self.state_format = state_format
        self.page_size = page_size
        self.used = 0
        self.quarantined = 0
        self.evictions = 0
        self._on_evict = on_evict
        self._sizes: OrderedDict[str, int] = OrderedDict()  # least recently used first
        ensure_dir(path)

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._sizes

    def ids(self) -> Iterator[str]:
        """Ids from least to most recently used."""
        return iter(self._sizes)

    def scan(self) -> list[CheckpointRecord]:
        """Index this model's valid files (oldest first), quarantine malformed ones."""
        found: list[tuple[float, CheckpointRecord, int]] = []
        now = time.time()
        for entry in os.scandir(self.path):
            p = Path(entry.path)
            if entry.name.startswith(".tmp-"):
                if now - entry.stat(follow_symlinks=False).st_mtime > _STALE_TMP_S:
                    p.unlink(missing_ok=True)  # left by a crash mid-write
                continue
            if not entry.name.endswith(SUFFIX):
                continue  # not ours
            stem = entry.name[: -len(SUFFIX)]
            if entry.is_symlink():
                self._quarantine(p, "symlink")
                continue
            if not valid_id(stem):
                self._quarantine(p, "file name is not a checkpoint id")
                continue
            try:
                fm = read_meta(p)
                if fm.meta["fingerprint"] != self.fingerprint:
                    continue  # another model's: leave it alone
                if fm.meta["state_format"] != self.state_format:
                    continue  # another build's state format: not ours to judge
                rec = record_from_meta(fm.meta, self.page_size)
                if rec.id != stem:
                    raise BadFile("file name does not match its id")
            except BadFile as e:
                self._quarantine(p, str(e))
                continue
            except OSError as e:
                log.warning("disk: skipped %s: %s", entry.name, e)
                continue
            found.append((fm.mtime, rec, fm.file_size))
        found.sort(key=lambda t: t[0])
        for _, rec, size in found:
            self._sizes[rec.id] = size
            self.used += size
        self._shrink(keep=None)
        return [rec for _, rec, _ in found if rec.id in self._sizes]

    def write(self, rec: CheckpointRecord, data: bytes | bytearray | memoryview) -> bool:
        """Store ``rec``'s state, evicting old files past the budget; False if refused."""
        if rec.id in self._sizes:
            return True
        need = rec.nbytes + rec.token_bytes
        if need > self.budget:
            log.warning(
                "disk: refused %s: %s exceeds the budget of %s",
                rec.id,
                format_size(need),
                format_size(self.budget),
            )
            return False
        try:
            size = write_checkpoint(self.path, rec, data)
        except OSError as e:
            log.error("disk: writing %s failed: %s", rec.id, e)
            return False
        self._sizes[rec.id] = size
        self.used += size
        self._shrink(keep=rec.id)
        return rec.id in self._sizes

    def read(self, entry_id: str) -> bytearray | None:
        """The verified state bytes, or None (a bad file is quarantined and forgotten)."""
        path = self.path / file_name(entry_id)
        if entry_id not in self._sizes:
            return None
        try:
            fm, data = read_checkpoint(path)
            if fm.id != entry_id or fm.meta["fingerprint"] != self.fingerprint:
                raise BadFile("metadata does not match the indexed entry")
        except BadFile as e:
            self._quarantine(path, str(e))
            self._forget(entry_id)
            return None
        except OSError as e:
            log.warning("disk: reading %s failed: %s", entry_id, e)
            self._forget(entry_id)  # e.g. purged by hand while we ran
            return None
        self.touch(entry_id)
        return data

    def touch(self, entry_id: str) -> None:
        self._sizes.move_to_end(entry_id)
        with contextlib.suppress(OSError):  # mtime carries the LRU order across restarts
            os.utime(self.path / file_name(entry_id))

    def remove(self, entry_id: str) -> bool:
        if entry_id not in self._sizes:
            return False
        (self.path / file_name(entry_id)).unlink(missing_ok=True)
        self._forget(entry_id)
        return True

    def _forget(self, entry_id: str) -> None:
        size = self._sizes.pop(entry_id, None)
        if size is not None:
            self.used -= size

    def _shrink(self, keep: str | None) -> None:
        while self.used > self.budget:
            victim = next((i for i in self._sizes if i != keep), None)
            if victim is None:
                break
            self.remove(victim)
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict(victim)
        if self.used > self.budget and keep is not None:
            self.remove(keep)

    def _quarantine(self, path: Path, reason: str) -> None:
        if quarantine(self.path, path, reason):
            self.quarantined += 1

    def sanity_check(self) -> None:
        total = sum(self._sizes.values())
        if total != self.used:
            raise RuntimeError(f"disk: {self.used} bytes accounted, files hold {total}")
        if self.used > self.budget:
            raise RuntimeError(f"disk: {self.used} bytes over a budget of {self.budget}")
