"""The disk writer: FULL states go to disk in the background, oldest first, so a crash
loses seconds of checkpoints; ``flush`` and ``close`` write the rest.

It claims each queued id under the pool's lock (pins the state's bytes in RAM and
reserves its files on disk), writes the files with the lock released, then publishes
them under the lock again. One thread drains the queue (``Entries.queue``: ids, never
bytes), started by the first id. A state RAM evicts before the disk has it is kept for
the writer, "spilled" (its bytes doomed in RAM and counted there until written).

While the engine prefills, the writer holds its queue (``hold``,
``tiers.background.PrefillHold``). It writes again once the engine stops prefilling, at
the latest ``HOLD_MAX_S`` after the hold began, at once while RAM spills states to it,
and whenever ``flush`` or ``stop`` asks.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from statecache.buffers import Buffer
from statecache.formats.diskfmt import file_name
from statecache.kvpages import PageData, PageKey, page_nbytes
from statecache.pool.entries import Entries, Entry, whole
from statecache.records import CheckpointRecord, EntryStats, Kind
from statecache.sizes import format_size
from statecache.tiers.background import PrefillHold, run_in_background
from statecache.tiers.disk import DiskTier
from statecache.tiers.rampages import Pin

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


class DiskWriter:
    def __init__(self, e: Entries) -> None:
        self.e = e
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.failed = False
        self._hold = PrefillHold(e.cond)
        self._flushing = 0  # flush calls waiting: they write whatever the hold says

    @property
    def usable(self) -> bool:
        """False once stopped or broken: then nothing written happens in the background."""
        return not self._stopping and not self.failed

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self.failed

    def hold(self, on: bool) -> None:
        """The engine prefills (``on``) or no longer does: the queue waits meanwhile."""
        self._hold.set(on)

    def _held_for(self) -> float:
        """How much longer the queue waits (lock held): 0 when it is written now."""
        if self._stopping or self._flushing or self.e.spilling:
            return 0.0
        return self._hold.left()

    def dirty(self, entry: Entry) -> bool:
        """A FULL state in memory that the disk lacks and may take."""
        rec, e = entry.record, self.e
        return (rec.kind is Kind.FULL and not entry.no_disk and e.in_memory(rec.id)
                and not e.on_disk(rec.id))

    def enqueue(self, entry_id: str) -> None:
        """Queue a write (lock held); the thread starts with the first."""
        self.e.queue.setdefault(entry_id, None)
        if self._thread is None and self.usable:
            self._thread = threading.Thread(target=self._loop, name="statecache-disk-writer",
                                            daemon=True)
            self._thread.start()
        self.e.cond.notify_all()

    def queue_write(self, entry: Entry) -> None:
        if self.e.disk is not None and self.usable and self.dirty(entry):
            self.enqueue(entry.record.id)

    def keep_evicted(self, slot: Pin) -> bool:
        """RAM evicts ``slot`` (lock held): keep its bytes (True) for the writer where
        its FULL state is not on disk yet."""
        e = self.e
        entry_id = slot.entry_id
        entry = e.entries[entry_id]
        rec = entry.record
        if e.disk is not None and self.usable and rec.kind is Kind.FULL \
                and not entry.no_disk and not e.on_disk(rec.id):
            e.spilling[entry_id] = slot
            e.counts.spills += 1
            self.enqueue(entry_id)
            return True
        e.settle(entry_id)
        return False

    # -- claims (under the lock) -------------------------------------------------------

    def claim_queued(self, entry_id: str) -> WriteJob | None:
        """A write of a state in memory: pin its bytes and reserve its files (lock held)."""
        e = self.e
        entry = e.entries.get(entry_id)
        if entry is None or not self.dirty(entry) or entry_id in e.writing:
            return None
        if entry_id in e.ram:
            pin = e.ram.pin(entry_id)
        else:
            pin = e.spilling[entry_id]
            e.ram.pin_slot(pin)
        job = self._claim(entry, pin.data, [e.ram.page(k) for k in pin.keys], pin)
        if job is None:
            e.ram.unpin(pin)
            self._end_spill(entry_id)  # the disk cannot take it: a spilled state is lost
        return job

    def claim_direct(self, entry: Entry, rest: bytes, pages: list[PageData]
                     ) -> WriteJob | None:
        """A write of a state RAM could not take, straight from the insert (lock held)."""
        e = self.e
        rec = whole(entry.record)
        if rec.kind is not Kind.FULL or e.disk is None or rec.id in e.writing:
            return None
        if rec.rest_nbytes + rec.token_bytes > e.ram.budget:
            e.warn_once(
                "ram-small",
                "pool: the RAM budget of %s is smaller than a %s state: such states go "
                "straight to disk",
                format_size(e.ram.budget),
                format_size(rec.nbytes),
            )
        job = self._claim(entry, rest, pages, None)
        if job is not None:
            job.direct = True
            e.counts.direct_writes += 1
        return job

    def _claim(self, entry: Entry, rest: Buffer, pages: list[PageData], pin: Pin | None
               ) -> WriteJob | None:
        disk = self.e.disk
        if disk is None:
            return None
        rec = whole(entry.record)
        which = disk.reserve(rec, [page_nbytes(p) for p in pages])
        if which is None:
            entry.no_disk = True
            return None
        self.e.writing.add(rec.id)
        return WriteJob(rec, rest, pages, which, pin, disk)

    # -- writes (without the lock) -----------------------------------------------------

    def run(self, job: WriteJob) -> bool:
        """Write the files without the lock, then publish them under the lock."""
        error: OSError | None = None
        written: tuple[int, dict[PageKey, int]] | None = None
        try:
            written = job.disk.write_file(job.record, job.data, job.pages, job.which)
        except OSError as err:
            error = err
        finally:
            with self.e.cond:
                ok = self._finish(job, written)
                self.e.cond.notify_all()
        if error is not None:
            self.e.warn_once(
                "write",
                "disk: writing %s failed: %s (later failures are logged at debug level)",
                job.record.id,
                error,
            )
        return ok

    def _finish(self, job: WriteJob, written: tuple[int, dict[PageKey, int]] | None) -> bool:
        e = self.e
        entry_id = job.record.id
        e.writing.discard(entry_id)
        entry = e.entries.get(entry_id)
        ok = False
        if written is not None and (entry is not None or job.direct):
            ok = job.disk.commit(entry_id, *written)
            if ok:
                e.counts.disk_writes += 1
                if entry is None:  # written straight to disk: held there alone
                    e.add(Entry(job.record, EntryStats(last_used=job.record.created)))
                    e.settle(entry_id)
            elif entry is not None:
                entry.no_disk = True
        else:
            job.disk.cancel(entry_id)
            if written is not None:  # removed while being written: the file is not wanted
                (job.disk.path / file_name(entry_id)).unlink(missing_ok=True)
            else:
                e.counts.disk_write_errors += 1
                if entry is not None:
                    entry.no_disk = True
        if job.pin is not None:
            e.ram.unpin(job.pin)
        self._end_spill(entry_id)
        return ok

    def _end_spill(self, entry_id: str) -> None:
        """Release a spilled state's RAM bytes (it is on disk now, or lost)."""
        pin = self.e.spilling.pop(entry_id, None)
        if pin is not None:
            self.e.ram.unpin(pin)
            self.e.settle(entry_id)

    # -- flush, stop, the thread -------------------------------------------------------

    def flush(self) -> int:
        """Wait until every FULL entry held only in RAM is on disk; returns how many
        of them were written while this call waited (by it or by the thread)."""
        e = self.e
        with e.cond:
            if e.disk is None:
                return 0
            self._flushing += 1
            e.cond.notify_all()
        try:
            return self._flush()
        finally:
            with e.cond:
                self._flushing -= 1

    def _flush(self) -> int:
        e = self.e
        with e.cond:
            dirty = [i for i, entry in e.entries.items() if self.dirty(entry)]
            for entry_id in dirty:
                if entry_id not in e.writing:
                    self.enqueue(entry_id)
            while self.running and any(i in e.queue or i in e.writing for i in dirty):
                e.cond.wait(0.5)
        for entry_id in dirty:  # what a stopped or broken thread left: written here
            with e.cond:
                while entry_id in e.writing:
                    e.cond.wait(0.5)
                e.queue.pop(entry_id, None)
                job = self.claim_queued(entry_id)
            if job is not None:
                self.run(job)
        with e.lock:
            return sum(1 for i in dirty if e.on_disk(i))

    def stop(self) -> None:
        """Write what is queued, then end the thread. Call without the pool's lock."""
        with self.e.cond:
            self._stopping = True
            self.e.cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        run_in_background()
        e = self.e
        try:
            while True:
                with e.cond:
                    while not self._stopping:
                        left = self._held_for() if e.queue else None
                        if left == 0:
                            break
                        e.cond.wait(left)  # nothing queued, or the engine prefills
                    if not e.queue:
                        return
                    entry_id, _ = e.queue.popitem(last=False)
                    job = self.claim_queued(entry_id)
                if job is not None:
                    self.run(job)
        except BaseException:  # a bug: say so, and let flush() write synchronously
            log.critical("the disk writer failed; states wait in RAM until close", exc_info=True)
            with e.cond:
                self.failed = True
                e.cond.notify_all()
