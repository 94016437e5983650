"""Lease: a looked-up checkpoint whose bytes stay valid until it is closed."""

from __future__ import annotations

import mmap
from types import TracebackType
from typing import Protocol

import numpy as np
import numpy.typing as npt

from statecache.buffers import Buffer
from statecache.records import CheckpointRecord
from statecache.tiers.rampages import Pin


class _Releaser(Protocol):
    def release(self, pin: Pin | None, spare: mmap.mmap | None = None) -> None: ...


class Lease:
    """A looked-up checkpoint, pinned in RAM until closed (use as a context manager)."""

    __slots__ = ("record", "tier", "logits", "_data", "_pool", "_pin", "_closed", "_spare")

    def __init__(
        self,
        pool: _Releaser,
        record: CheckpointRecord,
        tier: str,
        data: Buffer,
        pin: Pin | None,
        spare: mmap.mmap | None = None,
        logits: npt.NDArray[np.float32] | None = None,
    ) -> None:
        self.record = record
        # the last row's logits after the state's tokens, where the checkpoint kept them
        # (a copy: valid after ``close``)
        self.logits = logits
        self._spare = spare  # the buffer ``data`` was assembled in: reused once closed
        self.tier = tier  # the name of the tier the hit came from ("ram", "disk", "remote" ...)
        self._data = memoryview(data).toreadonly()
        self._pool = pool
        self._pin = pin
        self._closed = False

    @property
    def data(self) -> memoryview:
        if self._closed:
            raise RuntimeError("lease is closed")
        return self._data

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._data.release()
            self._pool.release(self._pin, self._spare)
            self._spare = None

    def __enter__(self) -> Lease:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Lease({self.record.id[:12]}, n={self.record.n}, tier={self.tier})"
