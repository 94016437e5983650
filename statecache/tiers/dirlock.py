"""One process per checkpoint directory: an flock on DIR/.lock, held while a pool uses it.

Two proxies on one directory would each count only their own writes against the disk
budget and evict each other's files; the second one to start gets no disk tier.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

LOCK_NAME = ".lock"


class Busy(Exception):
    """Another process holds the directory; the message names it."""


class DirLock:
    """An exclusive, non-blocking flock; released by ``release`` or when the process ends."""

    __slots__ = ("path", "_fd")

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
        fd = os.open(self.path, flags, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise Busy(
                f"{directory} is in use by another statecache process (pid {holder}); "
                "give each proxy its own cache.disk_path"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        # The file stays: unlinking it would let a third process lock a new inode
        # while a second still waits on the old one.
        if self._fd is not None:
            fd, self._fd = self._fd, None
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
