"""Storing a checkpoint: cut it into its rest and KV pages, put it in RAM (each page
once for every entry that names it; the newest state of a conversation kept whole,
its pages views into it), queue it for the disk, share it with the stores.

The cutting, hashing and copying happen before the lock is taken (16 MiB take
milliseconds); only the bookkeeping runs under it. A state that RAM cannot take (a RAM
budget smaller than the state) is written straight to disk, in the caller's thread,
without the lock. The same state inserted again is a refresh: its entry is used,
nothing is stored twice.
"""

from __future__ import annotations

import dataclasses
import mmap
import time

import numpy as np
import numpy.typing as npt

from statecache.buffers import Buffer
from statecache.kvpages import PageData, Split, key_bytes, page_bytes, split
from statecache.pages import PageChain, Tokens
from statecache.pool.entries import Entries, Entry
from statecache.pool.writer import DiskWriter, WriteJob
from statecache.records import CheckpointRecord, EntryStats, Kind, Owner, Record, Role, new_record
from statecache.sizes import format_size
from statecache.tiers.rampages import State, Whole

# How long an insert waits for the writer to free RAM held by spilled states.
_SPILL_WAIT_S = 10.0


class Inserts:
    def __init__(self, e: Entries, writer: DiskWriter, kv_sections: int) -> None:
        self.e = e
        self.writer = writer
        # KV caches a FULL state of this model starts with (MemoryInfo.kv_sections):
        # 0 keeps every state whole
        self.kv_sections = kv_sections

    def insert(self, *, kind: Kind, owner: Owner, lane: int | None, tokens: Tokens, role: Role,
               data: Buffer | mmap.mmap, tenant: str, preview: str, keep_s: float,
               logits: npt.NDArray[np.float32] | None, owned: bool) -> Record | None:
        """``CheckpointPool.insert``."""
        if owned and not isinstance(data, mmap.mmap):
            raise TypeError("an owned state is a buffer from state_buffer")
        e = self.e
        now = e.clock()
        rec = new_record(
            kind=kind,
            owner=owner,
            lane=lane,
            tokens=tokens,
            fingerprint=e.fingerprint,
            tenant=tenant or e.cfg.tenant,
            state_format=e.state_format,
            nbytes=memoryview(data).nbytes,
            role=role,
            created=now,
            page_size=e.page_size,
            preview=preview,
        )
        # a buffer RAM may keep as the whole state: the one handed over, or a copy
        state: State | None = data if isinstance(data, mmap.mmap) and owned else None
        try:
            with e.lock:
                entry = e.entries.get(rec.id)
                if entry is not None:  # the same state again: nothing to cut or copy
                    e.expire_kept(now)
                    e.keep(entry, now + keep_s)
                    return self._refresh(entry, rec, now)
            # Cut, hashed and copied before taking the lock. A FULL state of the target
            # is kept whole, its pages views into it (RAM hosts it: a lookup of it
            # assembles nothing); else only the pages RAM lacks are copied.
            sp = self._split(rec, data, logits)
            rec = dataclasses.replace(rec, keys=key_bytes(sp.keys), rest_nbytes=len(sp.rest))
            whole: Whole | None = None
            with e.lock:
                host = self._paged(rec) and e.ram.would_host(sp.keys)
            if host:
                if state is None:  # into the spare: no page faults, unlike a new buffer
                    src = memoryview(data).cast("B")
                    state = e.spare.take(src.nbytes)
                    memoryview(state)[:] = src
                parts = sp.moved(state)
                whole = None if parts is None else Whole(state, parts)
            return self._store(rec, sp, whole, now, keep_s)
        finally:
            if state is not None:
                with e.lock:
                    kept = e.ram.whole_of(rec.id) is state
                if not kept:
                    e.spare.give(state)  # the next state is written into it

    def _store(self, rec: CheckpointRecord, sp: Split, whole: Whole | None, now: float,
               keep_s: float) -> Record | None:
        """``insert``'s second half: into RAM (keeping ``whole`` where it may), else
        straight to disk."""
        e = self.e
        with e.lock:
            missing = [] if whole is not None else e.ram.missing(sp.keys)
        copies = {i: sp.page(i) for i in missing}

        def source(i: int) -> bytes:
            page = copies.get(i)
            return page if page is not None else sp.page(i)

        sizes = [sp.page_size(i) for i in range(len(sp.keys))]
        cost = rec.rest_nbytes + rec.token_bytes
        deadline = time.monotonic() + _SPILL_WAIT_S
        job: WriteJob | None = None
        with e.cond:
            e.expire_kept(now)
            shared: list[PageData] | None = None
            while True:
                entry = e.entries.get(rec.id)
                if entry is not None:
                    e.keep(entry, now + keep_s)
                    return self._refresh(entry, rec, now)
                entry = Entry(rec, EntryStats(last_used=now))
                if e.ram.put(rec.id, sp.rest, cost, e.keep(entry, now + keep_s),
                             sp.keys, sizes, source, whole):
                    e.add(entry)
                    e.counts.inserts += 1
                    self.writer.queue_write(entry)
                    if not e.stores:
                        return rec
                    shared = [e.ram.page(k) for k in sp.keys]
                    break
                left = deadline - time.monotonic()
                if not (e.spilling and self.writer.running and left > 0):
                    break
                e.cond.wait(left)  # the writer frees RAM as spilled states land
            if shared is None:
                pages: list[PageData] = [source(i) for i in range(len(sp.keys))]
                job = self.writer.claim_direct(entry, sp.rest, pages)
                if job is None:
                    e.counts.refused += 1
                    if cost + sum(sizes) > e.ram.budget:
                        e.warn_once(
                            "too-big",
                            "pool: refused a %s %s state: it exceeds the RAM budget of %s%s",
                            format_size(rec.nbytes),
                            rec.kind.value,
                            format_size(e.ram.budget),
                            "" if e.disk is None else " and the disk took none",
                        )
                    return None
        if shared is not None:  # in RAM; the store gets copies, made without the lock
            self._share(rec, sp.rest, shared)
            return rec
        self._share(rec, sp.rest, pages)
        assert job is not None
        return rec if self.writer.run(job) else None

    def _paged(self, rec: CheckpointRecord) -> bool:
        """Whether ``rec``'s state is cut into KV pages (a FULL state of the target)."""
        return rec.kind is Kind.FULL and rec.owner is Owner.TARGET and self.kv_sections > 0

    def _split(self, rec: CheckpointRecord, data: Buffer | mmap.mmap,
               logits: npt.NDArray[np.float32] | None = None) -> Split:
        """A FULL state of the target cut into its rest and KV pages; any other state
        kept whole (a rest without pages). The logits go at the rest's end."""
        return split(data, sections=self.kv_sections if self._paged(rec) else 0,
                     page_size=self.e.page_size, chain=rec.page_hashes,
                     tokens=rec.token_array(), logits=logits)

    def _share(self, rec: CheckpointRecord, rest: bytes, pages: list[PageData]) -> None:
        """A FULL state of the target goes to every store: each page copied the first
        time a store asks for it (one a store holds queued already is not asked for)."""
        stores = self.e.stores
        if stores and rec.kind is Kind.FULL and rec.owner is Owner.TARGET:
            copies: dict[int, bytes] = {}

            def page(i: int) -> bytes:
                got = copies.get(i)
                if got is None:
                    got = copies[i] = bytes(page_bytes(pages[i]))
                return got

            for store in stores:
                store.put(rec, rest, page)

    def _refresh(self, entry: Entry, rec: CheckpointRecord, now: float) -> Record:
        e = self.e
        old = entry.record
        if e.ram.policy.stronger(rec.role, old.role):
            entry.record = dataclasses.replace(old, role=rec.role, preview=rec.preview)
            e.index.replace(entry.record)
        entry.stats.last_used = now
        if old.id in e.ram:
            e.ram.touch(old.id, e.cls(entry))
        # A copy only on disk stays there: its bytes are the same state.
        e.counts.refreshes += 1
        return entry.record

    def keep(self, chain: PageChain, n: int, seconds: float, tenant: str) -> bool:
        """``CheckpointPool.keep``."""
        e = self.e
        e.check_chain(chain, tenant)
        now = e.clock()
        with e.lock:
            for rec in e.index.candidates(chain, kind=Kind.FULL, owner=Owner.TARGET,
                                          lane=None, max_n=n):
                if rec.n != n:
                    return False
                entry = e.entries[rec.id]
                cls = e.keep(entry, now + seconds)
                if rec.id in e.ram:
                    e.ram.touch(rec.id, cls)
                return True
            return False
