"""The disk writer: one background thread that writes FULL states to disk, oldest first.

The queue holds ids, never bytes: a queued state is still in the RAM tier (live, or
evicted but kept until written), so the RAM budget bounds the queue. The pool claims
each id under its lock and writes with the lock released (see ``CheckpointPool``).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from statecache.buffers import Buffer
from statecache.kvpages import PageData
from statecache.records import CheckpointRecord
from statecache.tiers.background import run_in_background
from statecache.tiers.ram import Pin

if TYPE_CHECKING:
    from statecache.tiers.disk import DiskTier

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class WriteJob:
    """One record (and the pages the disk lacks) being written: its disk bytes are
    reserved, its RAM bytes pinned."""

    record: CheckpointRecord
    data: Buffer  # the rest
    pages: Sequence[PageData]  # every page the record names, in order
    which: list[int]  # those the disk lacks: written with the record
    pin: Pin | None  # the RAM slot held while writing; None when the state never fit RAM
    disk: DiskTier
    direct: bool = False  # the entry joins the pool when its file is committed


class Writer:
    """A FIFO of ids and the thread that drains it; started on the first id."""

    def __init__(
        self,
        cond: threading.Condition,
        claim: Callable[[str], WriteJob | None],
        run: Callable[[WriteJob], bool],
    ) -> None:
        self._cond = cond  # the pool's lock: every method but stop() runs under it
        self._claim = claim
        self._run = run
        self.queue: OrderedDict[str, None] = OrderedDict()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failed = False

    def __len__(self) -> int:
        return len(self.queue)

    @property
    def usable(self) -> bool:
        """False once stopped or broken: then nothing written happens in the background."""
        return not self._stopping and not self.failed

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.failed

    def enqueue(self, entry_id: str) -> None:
        self.queue.setdefault(entry_id, None)
        if self._thread is None and self.usable:
            self._thread = threading.Thread(
                target=self._loop, name="statecache-disk-writer", daemon=True
            )
            self._thread.start()
        self._cond.notify_all()

    def discard(self, entry_id: str) -> None:
        self.queue.pop(entry_id, None)

    def stop(self) -> None:
        """Write what is queued, then end the thread. Call without the pool's lock."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        run_in_background()
        try:
            while True:
                with self._cond:
                    while not self.queue and not self._stopping:
                        self._cond.wait()
                    if not self.queue:
                        return
                    entry_id, _ = self.queue.popitem(last=False)
                    job = self._claim(entry_id)
                if job is not None:
                    self._run(job)
        except BaseException:  # a bug: say so, and let flush() write synchronously
            log.critical("the disk writer failed; states wait in RAM until close", exc_info=True)
            with self._cond:
                self.failed = True
                self._cond.notify_all()
