"""Reading a checkpoint from the local tiers: find the deepest usable one, pin it, put
its state together, hand it out as a lease.

A lookup picks the deepest candidate of the index (at equal depth, a copy in memory
first). A state in memory is pinned and assembled from its rest and pages, or handed out
as it is where RAM keeps it whole; one on disk alone is read and verified with the lock
released (the file pinned), its tokens compared with the request's, and it joins RAM
again. A copy that does not assemble into the state that was saved, or a file that does
not verify, is a miss: it is dropped (quarantined) and the next candidate is tried.
"""

from __future__ import annotations

import dataclasses
import logging
import mmap
import time
from collections.abc import Sequence
from typing import Any

from statecache.buffers import Buffer
from statecache.formats.diskfmt import BadFile
from statecache.kvpages import (
    BadState,
    PageData,
    PageKey,
    assemble,
    page_bytes,
    page_nbytes,
    rest_info,
    rest_logits,
    unpack_keys,
    whole_state,
)
from statecache.pages import PageChain, TokenArray, Tokens, as_tokens
from statecache.pool.entries import Entries, Entry, whole
from statecache.pool.lease import Lease
from statecache.records import CheckpointRecord, Kind, Owner, Record, RecordHead
from statecache.tiers.disk import DiskTier
from statecache.tiers.diskfiles import BadPageFile
from statecache.tiers.rampages import Pin, State

log = logging.getLogger(__name__)


class Reads:
    def __init__(self, e: Entries) -> None:
        self.e = e

    def lookup(self, tokens: Tokens, chain: PageChain, *, kind: Kind, owner: Owner,
               lane: int | None, max_n: int | None, tenant: str) -> Lease | None:
        """The deepest usable checkpoint with ``n <= max_n``, pinned; None on a miss."""
        e = self.e
        e.check_chain(chain, tenant)
        if tokens is not chain.tokens and not _same(as_tokens(tokens), chain):
            raise ValueError("chain does not describe these tokens")
        if kind is Kind.PARTIAL and lane is None:
            raise ValueError("a partial lookup needs a lane")
        limit = len(chain) if max_n is None else min(max_n, len(chain))
        if limit < 0:
            raise ValueError(f"max_n must be >= 0, got {max_n}")
        tried: set[str] = set()
        while True:  # each turn tries one candidate; a bad file is never a candidate again
            pin: Pin | None = None
            with e.lock:
                rec = self._pick(chain, kind, owner, lane, limit, tried)
                if rec is None:
                    e.counts.misses += 1
                    return None
                disk = e.disk
                if e.in_memory(rec.id):
                    held = whole(rec)
                    pin, rest, pages = self._pin_memory(held)
                    state = pin.whole
                else:
                    assert disk is not None and rec.id in disk
                    disk.pin(rec.id)
                    keys = disk.keys(rec.id)
                    local = self.ram_pages(unpack_keys(keys))
            tried.add(rec.id)
            if pin is not None:
                got = self.assemble(held, rest, pages, state)
                if got is not None:
                    return Lease(self, held, e.ram.name, got[0], pin, got[1],
                                 rest_logits(rest))
                self.release(pin)
                with e.lock:
                    if rec.id in e.entries:
                        e.remove(rec.id)
                continue
            assert disk is not None
            lease = self._lease_disk(rec, disk, keys, local, chain.tokens)
            if lease is not None:
                return lease

    def assemble(self, rec: CheckpointRecord, rest: Buffer, pages: Sequence[PageData],
                 state: State | None = None) -> tuple[memoryview, mmap.mmap | None] | None:
        """The state llama.cpp reads back and the buffer it was assembled in (None: a
        view of ``rest``, a state kept whole there, or ``state``, one kept whole in RAM
        and only checked), or None (logged, counted) if it is not the one that was
        saved."""
        try:
            if state is not None:
                return whole_state(rest, state), None
            return self._assemble_checked(rec, rest, pages)
        except BadState as err:
            log.error("pool: checkpoint %s does not assemble (%s): a miss", rec.id, err)
            with self.e.lock:
                self.e.counts.bad_states += 1
            return None

    def _assemble_checked(self, rec: CheckpointRecord, rest: Buffer, pages: Sequence[PageData]
                          ) -> tuple[memoryview, mmap.mmap | None]:
        """As ``assemble``, raising BadState; the buffer goes back if it fails."""
        info = rest_info(rest)
        buf = self.e.spare.take(info.nbytes) if info.sections else None
        try:
            return assemble(rest, pages, buf, rec.token_array()), buf
        except BadState:
            self.e.spare.give(buf)
            raise

    def ram_pages(self, keys: tuple[PageKey, ...]) -> dict[int, PageData]:
        """The pages of ``keys`` the RAM tier holds, by index (lock held)."""
        ram = self.e.ram
        return {i: ram.page(k) for i, k in enumerate(keys) if ram.has_page(k)}

    def _pick(self, chain: PageChain, kind: Kind, owner: Owner, lane: int | None, limit: int,
              tried: set[str]) -> Record | None:
        """The deepest candidate not yet tried; at equal depth, a copy in memory first."""
        e = self.e
        on_disk: Record | None = None
        for rec in e.index.candidates(chain, kind=kind, owner=owner, lane=lane, max_n=limit):
            if rec.id in tried:
                continue
            if on_disk is not None and rec.n != on_disk.n:
                break
            entry = e.entries.get(rec.id)
            if entry is None or entry.record is not rec:
                raise RuntimeError(f"pool: index holds {rec.id} but the entry differs")
            if e.in_memory(rec.id):
                return rec
            if not e.on_disk(rec.id):
                raise RuntimeError(f"pool: entry {rec.id} is in no tier")
            on_disk = on_disk or rec
        return on_disk

    def _pin_memory(self, rec: CheckpointRecord) -> tuple[Pin, Buffer, list[PageData]]:
        """Pin a state held in memory: its rest and its pages (lock held)."""
        e = self.e
        if rec.id in e.ram:
            pin = e.ram.pin(rec.id)
        else:
            pin = e.spilling[rec.id]
            e.ram.pin_slot(pin)
        e.hit(e.entries[rec.id], e.ram.name)
        return pin, pin.data, [e.ram.page(k) for k in pin.keys]

    def _lease_disk(self, rec: Record, disk: DiskTier, keys: bytes, local: dict[int, PageData],
                    tokens: TokenArray) -> Lease | None:
        """Read and verify without the lock (the file is pinned), then publish under it.
        Pages the RAM tier holds (``local``) are not read; ``keys``: the pages the disk
        tier counts for it. The file's own tokens must begin ``tokens`` (the request's):
        a head matched them by its id alone."""
        e = self.e
        bad: str | None = None
        moved = False
        bad_page: PageKey | None = None
        gone_page = False  # the page is missing, not refused
        data: memoryview | None = None
        buf: mmap.mmap | None = None
        other = False
        t0 = time.perf_counter()
        try:
            stored = disk.read_file(rec, keys, [i in local for i in range(rec.n_keys)])
            read = stored.record
            if read.matches(tokens):
                pages: list[PageData] = [local[i] if p is None else p
                                         for i, p in enumerate(stored.pages)]
                data, buf = self._assemble_checked(read, stored.rest, pages)
                e.costs.note_read(disk.name, rec.nbytes, time.perf_counter() - t0)
            else:  # another prompt with the same 128-bit id: not a bad file, not a hit
                other = True
        except BadPageFile as err:
            bad, bad_page, gone_page = str(err), err.key, err.missing
            moved = disk.quarantine_page(err.key, bad)
        except (BadFile, BadState) as err:
            bad = str(err)
            moved = disk.quarantine_file(rec.id, bad)
        except OSError as err:  # e.g. purged by hand while we ran
            bad = str(err)
            log.warning("disk: reading %s failed: %s", rec.id, err)
        else:
            disk.utime(rec.id)
        with e.lock:
            disk.unpin(rec.id)
            if other:
                log.warning("pool: checkpoint %s holds other tokens than the request whose "
                            "hash found it: a miss", rec.id)
                return None
            if bad is not None or data is None:
                disk.quarantined += moved
                gone = [] if bad_page is None else disk.drop_page(bad_page)
                if rec.id not in gone:
                    disk.forget(rec.id)
                    gone.append(rec.id)
                heads = [entry.record for entry_id in gone
                         if (entry := e.entries.get(entry_id)) is not None]
                for entry_id in gone:
                    e.settle(entry_id)
                if bad_page is not None:  # those no tier holds now were dropped for it
                    e.lost.note(disk.name, bad_page.hex(),
                                "missing" if gone_page else "refused",
                                [_head(r) for r in heads if r.id not in e.entries],
                                e.counts.dropped)
                return None
            pin: Pin | None = None
            entry = e.entries.get(rec.id)
            now = rec if entry is None else entry.record  # its role may be newer than the file's
            if (read.role, read.preview) != (now.role, now.preview):
                read = dataclasses.replace(read, role=now.role, preview=now.preview)
            promote = entry is not None and not e.in_memory(rec.id)
            if promote and entry is not None and self.put_ram(entry, read, stored.rest, pages):
                entry.record = read  # in memory again: whole again
                e.index.replace(read)
                e.counts.promotions += 1
                pin = e.ram.pin(rec.id)
            if entry is not None:
                e.hit(entry, disk.name)
            else:  # removed while we read: the bytes are still exactly this record's state
                e.counts.hit(disk.name)
            return Lease(self, read, disk.name, data, pin, buf, rest_logits(stored.rest))

    def put_ram(self, entry: Entry, rec: CheckpointRecord, rest: Buffer,
                pages: Sequence[PageData]) -> bool:
        """Store a state read from disk or a store (``rec``: its whole record) in the
        RAM tier (lock held)."""
        return self.e.ram.put(rec.id, bytes(rest), rec.rest_nbytes + rec.token_bytes,
                              self.e.cls(entry), rec.page_keys,
                              [page_nbytes(p) for p in pages],
                              lambda i: bytes(page_bytes(pages[i])))

    def release(self, pin: Pin | None, spare: mmap.mmap | None = None) -> None:
        """A lease is closed: its buffer kept for the next assembly, its pin let go."""
        if spare is not None:  # kept for the next: no page faults next time
            self.e.spare.give(spare)
        if pin is not None:
            with self.e.cond:
                self.e.ram.unpin(pin)
                self.e.cond.notify_all()

    def holds(self, chain: PageChain, n: int, tenant: str) -> bool:
        """Whether a FULL state after exactly ``chain.tokens[:n]`` is cached, in any local
        tier (the index and the tokens only: nothing is read)."""
        e = self.e
        e.check_chain(chain, tenant)
        with e.lock:
            for rec in e.index.candidates(chain, kind=Kind.FULL, owner=Owner.TARGET,
                                          lane=None, max_n=n):
                return rec.n == n
            return False

    def match_depth(self, chain: PageChain) -> int:
        """Tokens of ``chain`` (whole pages) that some cached checkpoint also starts with.

        Hashes only: a hint for where a branch point goes, never a proof of a match.
        """
        with self.e.lock:
            return self.e.index.depth(chain) * chain.page_size


def _head(rec: Record) -> RecordHead:
    return rec.head() if isinstance(rec, CheckpointRecord) else rec


def _same(arr: Any, chain: PageChain) -> bool:
    return len(arr) == len(chain) and bool((arr == chain.tokens).all())
