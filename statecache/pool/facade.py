"""CheckpointPool: the index, the RAM tier and the disk tier behind one lock.

A FULL state is stored as its rest and its KV pages (``statecache.kvpages``): each tier
holds a page once for all the checkpoints that name it, and a lookup assembles the
state llama.cpp reads back, checked against the digest of the state that was saved.

An entry whose state is in memory keeps its whole record; one held on disk alone keeps
only the record's head (``RecordHead``: no tokens, page hashes or page keys, which its
record file holds), so what the pool keeps per checkpoint on disk does not grow with its
length. A hit on disk reads the whole record back from the file, authenticated, and
compares its tokens with the request's before the state is used.

Invariants (checked by ``sanity_check``): every entry is in the index and in at least
one of: the RAM tier, the disk tier, the spill set (FULL states evicted from RAM
before they reached the disk, kept in RAM's byte count until written); every tier id
is an entry; an entry in memory has its whole record, one on disk alone its head;
PARTIAL entries are never on disk; every page an entry names is held by
each tier that holds the entry, and each page's count of references equals the
entries that name it; the bytes each tier accounts equal what it holds (each page
once) and stay within its budget; a file being written is reserved on disk; the
remote tier's write queue holds at most ``queue_bytes``, counted exactly.

Nothing slow runs under the lock that ``describe``/``get``/``stats`` take from the
event loop: disk reads, MAC checks, writes and fsyncs happen with the entry pinned and
the lock released, then the result is published under the lock again. FULL states are
written in the background as they arrive (``statecache.pool.writer``), so a crash loses
seconds of checkpoints; ``close`` writes the rest.

With ``[cache.remote]`` a third tier, shared by several proxies, sits behind the two
(``statecache.tiers.remote``): new FULL states go out to it in the background, and
``full_offers`` / ``take`` let the planner weigh each tier's copy by what it costs
to fetch (``statecache.costs``) before anything is read. A state taken from the
store joins the RAM tier as an entry of this pool, never sent back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import mmap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from statecache.buffers import Spare
from statecache.config import CacheConfig
from statecache.costs import Costs
from statecache.formats.diskfmt import BadFile, file_name, valid_id
from statecache.formats.trust import Untrusted, load_key
from statecache.kvpages import (
    BadState,
    PageData,
    PageKey,
    Split,
    assemble,
    key_bytes,
    page_bytes,
    page_nbytes,
    rest_info,
    rest_logits,
    split,
    unpack_keys,
    whole_state,
)
from statecache.pages import PageChain, PageHash, TokenArray, Tokens, as_tokens, namespace_hash
from statecache.pool.index import Index
from statecache.pool.lease import Buffer, Lease
from statecache.pool.stats import Counts, PoolStats
from statecache.pool.writer import WriteJob, Writer
from statecache.records import (
    CheckpointRecord,
    EntryStats,
    Kind,
    Owner,
    Record,
    Role,
    new_record,
)
from statecache.sizes import format_size
from statecache.tiers.dirlock import DirLock
from statecache.tiers.disk import BadPageFile, DiskTier
from statecache.tiers.opendisk import open_disk
from statecache.tiers.policy import ByClass, EvictionClass
from statecache.tiers.ram import Pin, RamTier, State, Whole
from statecache.tiers.remote import RemoteHit, RemoteTier
from statecache.tiers.tier import Tier

log = logging.getLogger(__name__)

# How long an insert waits for the writer to free RAM held by spilled states.
_SPILL_WAIT_S = 10.0


@dataclass(slots=True, frozen=True)
class Offer:
    """A FULL state the pool could start a prompt from, not read yet."""

    tier: str  # ram | disk | remote
    n: int
    nbytes: int
    hit: RemoteHit | None = None  # for the remote tier


@dataclass(slots=True, eq=False)
class _Entry:
    record: Record  # whole while its state is in memory, its head on disk alone
    stats: EntryStats
    no_disk: bool = False  # the disk refused or evicted it: never written again

    def cls(self, policy: ByClass, now: float) -> EvictionClass:
        return policy.rank(self.record.role, self.stats.hits, self.stats.keep_until > now)




class CheckpointPool:
    def __init__(
        self,
        cfg: CacheConfig,
        fingerprint: str,
        *,
        state_format: int = 1,
        kv_sections: int = 0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.state_format = state_format
        # KV caches a FULL state of this model starts with (MemoryInfo.kv_sections):
        # 0 keeps every state whole
        self.kv_sections = kv_sections
        self.page_size = cfg.page_size
        self._clock = clock
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._close_lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._kept: dict[str, float] = {}  # entries a client asked to keep: until when
        self._by_lane: dict[int, set[str]] = {}
        self._namespaces: dict[str, PageHash] = {}
        self._index = Index()
        self.counts = Counts()  # under the lock
        self._warned: set[str] = set()
        self._ram = RamTier(cfg.ram_budget, on_evict=self._on_ram_evict,
                            on_free=self._spare_state, policy=ByClass())
        self._spilling: dict[str, Pin] = {}  # evicted FULL states waiting for the disk
        # the buffer a closed lease's state was assembled in, or a state kept whole
        # that RAM let go: the next assembly or state kept whole is written into it
        self._spare = Spare()
        self._writing: dict[str, WriteJob] = {}
        self._writer = Writer(self._cond, self._claim_queued, self._run_write)
        self._disk: DiskTier | None = None
        self._dir_lock: DirLock | None = None
        self.disk_status = "disabled in the config"
        if cfg.disk_enabled:
            self._open_disk()
        self.costs = Costs()
        self._remote: RemoteTier | None = None
        self.remote_status = "off"
        if cfg.remote.url:
            self._open_remote()

    def _open_remote(self) -> None:
        rc = self.cfg.remote
        key_path = Path(rc.secret_path or self.cfg.secret_path).expanduser()
        try:
            key = load_key(key_path)
        except (Untrusted, OSError) as e:
            self.remote_status = f"off: its key {key_path}: {e}"
            log.warning("pool: the remote tier is off: %s", self.remote_status)
            return
        self._remote = RemoteTier(rc, key, self.fingerprint, state_format=self.state_format,
                                  page_size=self.page_size, level=self.cfg.compress_level)
        self._remote.ping()
        self.remote_status = self._remote.status

    def _open_disk(self) -> None:
        opened = open_disk(
            self.cfg, self.fingerprint, state_format=self.state_format,
            on_evict=self._on_disk_evict,
        )
        if isinstance(opened, str):
            self.disk_status = opened
            log.warning("pool: the disk tier is off: %s", opened)
            return
        self._disk, self._dir_lock = opened
        self._disk.scan(self._found_on_disk)
        self.disk_status = "ok"
        log.info("pool: %d checkpoints found on disk in %s", len(self._disk), self._disk.path)

    def _found_on_disk(self, rec: CheckpointRecord) -> None:
        """A record the disk tier found at start: indexed by its head (its tokens and
        pages stay in its file)."""
        self._add(_Entry(rec.head(), EntryStats(last_used=rec.created)), rec.page_hashes)

    # -- lookups -----------------------------------------------------------------------

    def namespace(self, tenant: str = "") -> PageHash:
        """h_0 for ``tenant`` (an empty tenant means the configured one)."""
        return self._exact_namespace(tenant or self.cfg.tenant)

    def _exact_namespace(self, tenant: str) -> PageHash:
        ns = self._namespaces.get(tenant)
        if ns is None:
            ns = self._namespaces[tenant] = namespace_hash(self.fingerprint, tenant)
        return ns

    def chain(
        self, tokens: Tokens, tenant: str = "", prev: PageChain | None = None
    ) -> PageChain:
        """Page hashes of ``tokens``; with ``prev``, pages shared with it are not rehashed."""
        ns = self.namespace(tenant)
        if prev is not None and prev.namespace == ns and prev.page_size == self.page_size:
            return prev.for_tokens(tokens)
        return PageChain(ns, self.page_size, tokens)

    def lookup(
        self,
        tokens: Tokens,
        chain: PageChain,
        *,
        kind: Kind = Kind.FULL,
        owner: Owner = Owner.TARGET,
        lane: int | None = None,
        max_n: int | None = None,
        tenant: str = "",
    ) -> Lease | None:
        """The deepest usable checkpoint with ``n <= max_n``, pinned; None on a miss."""
        if chain.namespace != self.namespace(tenant) or chain.page_size != self.page_size:
            raise ValueError("chain was built for another tenant or page size")
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
            with self._lock:
                rec = self._pick(chain, kind, owner, lane, limit, tried)
                if rec is None:
                    self.counts.misses += 1
                    return None
                disk = self._disk
                if self._in_memory(rec.id):
                    whole = _whole(rec)
                    pin, rest, pages = self._pin_memory(whole)
                    state = pin.whole
                else:
                    assert disk is not None and rec.id in disk
                    disk.pin(rec.id)
                    keys = disk.keys(rec.id)
                    local = self._ram_pages(unpack_keys(keys))
            tried.add(rec.id)
            if pin is not None:
                got = self._assemble(whole, rest, pages, state)
                if got is not None:
                    return Lease(self, whole, "ram", got[0], pin, got[1], rest_logits(rest))
                self._release(pin)
                self.remove(rec.id)
                continue
            assert disk is not None
            lease = self._lease_disk(rec, disk, keys, local, chain.tokens)
            if lease is not None:
                return lease

    def _assemble(self, rec: CheckpointRecord, rest: Buffer, pages: Sequence[PageData],
                  state: State | None = None) -> tuple[memoryview, mmap.mmap | None] | None:
        """The state llama.cpp reads back and the buffer it was assembled in (None: a
        view of ``rest``, a state kept whole there, or ``state``, one kept whole in RAM
        and only checked), or None (logged, counted) if it is not the one that was
        saved."""
        try:
            if state is not None:
                return whole_state(rest, state), None
            return self._assemble_checked(rec, rest, pages)
        except BadState as e:
            log.error("pool: checkpoint %s does not assemble (%s): a miss", rec.id, e)
            with self._lock:
                self.counts.bad_states += 1
            return None

    def _assemble_checked(self, rec: CheckpointRecord, rest: Buffer, pages: Sequence[PageData]
                          ) -> tuple[memoryview, mmap.mmap | None]:
        """As ``_assemble``, raising BadState; the buffer goes back if it fails."""
        info = rest_info(rest)
        buf = self._spare.take(info.nbytes) if info.sections else None
        try:
            return assemble(rest, pages, buf, rec.token_array()), buf
        except BadState:
            self._spare.give(buf)
            raise

    def _ram_pages(self, keys: tuple[PageKey, ...]) -> dict[int, PageData]:
        """The pages of ``keys`` the RAM tier holds, by index (lock held)."""
        return {i: self._ram.page(k) for i, k in enumerate(keys) if self._ram.has_page(k)}

    def _pick(
        self,
        chain: PageChain,
        kind: Kind,
        owner: Owner,
        lane: int | None,
        limit: int,
        tried: set[str],
    ) -> Record | None:
        """The deepest candidate not yet tried; at equal depth, a copy in memory first."""
        on_disk: Record | None = None
        for rec in self._index.candidates(chain, kind=kind, owner=owner, lane=lane, max_n=limit):
            if rec.id in tried:
                continue
            if on_disk is not None and rec.n != on_disk.n:
                break
            entry = self._entries.get(rec.id)
            if entry is None or entry.record is not rec:
                raise RuntimeError(f"pool: index holds {rec.id} but the entry differs")
            if self._in_memory(rec.id):
                return rec
            if not self._on_disk(rec.id):
                raise RuntimeError(f"pool: entry {rec.id} is in no tier")
            on_disk = on_disk or rec
        return on_disk

    def _pin_memory(self, rec: CheckpointRecord) -> tuple[Pin, Buffer, list[PageData]]:
        """Pin a state held in memory: its rest and its pages (lock held)."""
        if rec.id in self._ram:
            pin = self._ram.pin(rec.id)
        else:
            pin = self._spilling[rec.id]
            self._ram.pin_slot(pin)
        self._hit(self._entries[rec.id], "ram")
        return pin, pin.data, [self._ram.page(k) for k in pin.keys]

    def _lease_disk(self, rec: Record, disk: DiskTier, keys: bytes, local: dict[int, PageData],
                    tokens: TokenArray) -> Lease | None:
        """Read and verify without the lock (the file is pinned), then publish under it.
        Pages the RAM tier holds (``local``) are not read; ``keys``: the pages the disk
        tier counts for it. The file's own tokens must begin ``tokens`` (the request's):
        a head matched them by its id alone."""
        bad: str | None = None
        moved = False
        bad_page: PageKey | None = None
        data: memoryview | None = None
        buf: mmap.mmap | None = None
        other = False
        t0 = time.perf_counter()
        try:
            stored = disk.read_file(rec, keys, [i in local for i in range(rec.n_keys)])
            whole = stored.record
            if whole.matches(tokens):
                pages: list[PageData] = [local[i] if p is None else p
                                         for i, p in enumerate(stored.pages)]
                data, buf = self._assemble_checked(whole, stored.rest, pages)
                self.costs.note_read("disk", rec.nbytes, time.perf_counter() - t0)
            else:  # another prompt with the same 128-bit id: not a bad file, not a hit
                other = True
        except BadPageFile as e:
            bad, bad_page = str(e), e.key
            moved = disk.quarantine_page(e.key, bad)
        except (BadFile, BadState) as e:
            bad = str(e)
            moved = disk.quarantine_file(rec.id, bad)
        except OSError as e:  # e.g. purged by hand while we ran
            bad = str(e)
            log.warning("disk: reading %s failed: %s", rec.id, e)
        else:
            disk.utime(rec.id)
        with self._lock:
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
                for entry_id in gone:
                    self._settle(entry_id)
                return None
            pin: Pin | None = None
            entry = self._entries.get(rec.id)
            now = rec if entry is None else entry.record  # its role may be newer than the file's
            if (whole.role, whole.preview) != (now.role, now.preview):
                whole = dataclasses.replace(whole, role=now.role, preview=now.preview)
            promote = entry is not None and not self._in_memory(rec.id)
            if promote and entry is not None and self._put_ram(entry, whole, stored.rest,
                                                               pages):
                entry.record = whole  # in memory again: whole again
                self._index.replace(whole)
                self.counts.promotions += 1
                pin = self._ram.pin(rec.id)
            if entry is not None:
                self._hit(entry, "disk")
            else:  # removed while we read: the bytes are still exactly this record's state
                self.counts.hit("disk")
            return Lease(self, whole, "disk", data, pin, buf, rest_logits(stored.rest))

    def _put_ram(self, entry: _Entry, rec: CheckpointRecord, rest: Buffer,
                 pages: Sequence[PageData], cls: EvictionClass | None = None) -> bool:
        """Store a state read from disk or the store (``rec``: its whole record) in the
        RAM tier (lock held)."""
        return self._ram.put(rec.id, bytes(rest), rec.rest_nbytes + rec.token_bytes,
                             self._cls(entry) if cls is None else cls, rec.page_keys,
                             [page_nbytes(p) for p in pages],
                             lambda i: bytes(page_bytes(pages[i])))

    def _hit(self, entry: _Entry, tier: str) -> None:
        rec = entry.record
        entry.stats.hits += 1
        entry.stats.last_used = self._clock()
        if rec.id in self._ram:
            self._ram.touch(rec.id, self._cls(entry))
        if self._disk is not None and rec.id in self._disk:
            self._disk.touch(rec.id)
        self.counts.hit(tier, rec.role)

    def _release(self, pin: Pin | None, spare: mmap.mmap | None = None) -> None:
        if spare is not None:  # kept for the next: no page faults next time
            self._spare.give(spare)
        if pin is not None:
            with self._cond:
                self._ram.unpin(pin)
                self._cond.notify_all()

    def _spare_state(self, state: object) -> None:
        """A state kept whole that RAM let go: its buffer may be the next one."""
        self._spare.give(state)

    def full_offers(
        self, tokens: Tokens, chain: PageChain, *, max_n: int, tenant: str = ""
    ) -> list[Offer]:
        """FULL states usable for ``tokens`` with ``n <= max_n``, nothing read: the
        deepest in memory, a deeper one on disk, deeper ones in the shared store (one
        round trip to its index). ``take`` reads the one the planner picks."""
        if chain.namespace != self.namespace(tenant) or chain.page_size != self.page_size:
            raise ValueError("chain was built for another tenant or page size")
        limit = min(max_n, len(chain))
        offers: list[Offer] = []
        with self._lock:
            for rec in self._index.candidates(chain, kind=Kind.FULL, owner=Owner.TARGET,
                                              lane=None, max_n=limit):
                tier = "ram" if self._in_memory(rec.id) else "disk"
                if not offers or (tier == "ram" and rec.n == offers[-1].n):
                    offers.append(Offer(tier, rec.n, rec.nbytes))
                if tier == "ram":
                    break  # anything shallower than a copy in memory costs more
            remote = self._remote
        deepest = max((o.n for o in offers), default=0)
        if remote is not None and limit > deepest:
            offers += [Offer("remote", h.n, h.nbytes, h)
                       for h in remote.probe(chain, min_n=deepest, max_n=limit)]
        return offers

    def take(
        self, offer: Offer, tokens: Tokens, chain: PageChain, *, tenant: str = ""
    ) -> Lease | None:
        """Read ``offer`` (checked as any lookup is); None when it is gone or refused.

        A local offer gives the deepest local state at or below its ``n`` (so a copy
        evicted since is replaced by what is there now)."""
        if offer.hit is None:
            return self.lookup(tokens, chain, kind=Kind.FULL, max_n=offer.n, tenant=tenant)
        remote = self._remote
        if remote is None:
            return None
        t0 = time.perf_counter()
        got = remote.fetch(offer.hit, as_tokens(tokens), tenant or self.cfg.tenant,
                           self._local_pages)
        assembled = None if got is None else self._assemble(got[0], got[1], got[2])
        if got is None or assembled is None:
            with self._lock:
                self.counts.store_misses += 1
            return None
        rec, rest, pages = got
        data, buf = assembled
        logits = rest_logits(rest)
        self.costs.note_read("remote", rec.nbytes, time.perf_counter() - t0)
        with self._lock:
            self.counts.hit("remote")
            entry = self._entries.get(rec.id)
            if entry is None:  # joins RAM as this pool's own entry (never sent back)
                entry = _Entry(rec, EntryStats(last_used=self._clock(), hits=1))
                if self._put_ram(entry, rec, rest, pages):
                    self._add(entry)
                    self._queue_write(entry)
                    return Lease(self, rec, "remote", data, self._ram.pin(rec.id), buf,
                                 logits=logits)
        return Lease(self, rec, "remote", data, None, buf, logits=logits)

    def _local_pages(self, keys: tuple[PageKey, ...]) -> dict[int, Buffer]:
        """The pages of ``keys`` the local tiers hold (RAM, else read from disk), by index:
        the shared tier fetches only the others."""
        with self._lock:
            held = self._ram_pages(keys)
            disk = self._disk
            on_disk = [] if disk is None else [
                i for i, k in enumerate(keys) if i not in held and disk.has_page(k)]
        out: dict[int, Buffer] = {i: page_bytes(p) for i, p in held.items()}
        for i in on_disk:
            assert disk is not None
            # gone or bad: the store's copy is fetched instead
            with contextlib.suppress(BadFile, OSError):
                out[i] = disk.read_page(keys[i])
        return out

    # -- changes -----------------------------------------------------------------------

    def insert(
        self,
        *,
        kind: Kind,
        owner: Owner,
        lane: int | None,
        tokens: Tokens,
        role: Role,
        data: Buffer | mmap.mmap,
        tenant: str = "",
        preview: str = "",
        keep_s: float = 0.0,
        logits: npt.NDArray[np.float32] | None = None,
        owned: bool = False,
    ) -> Record | None:
        """Store a copy of ``data`` as the state after ``tokens``; its record (the head
        of one held on disk alone, if that state was there already), None if refused.
        ``logits``: the last row's after ``tokens``, kept with the state (a lease gives
        them back), so a prompt that ends there needs no token decoded again.
        ``owned``: ``data`` is a buffer from ``state_buffer`` holding exactly the state,
        handed over (the caller never touches it again): kept as it is, not copied,
        where RAM keeps the state whole.

        A FULL state that RAM cannot take (a RAM budget smaller than the state) is
        written straight to disk, in this thread, without the lock. ``keep_s``: a client
        asked to keep it that long (a cache breakpoint): it is evicted after every entry
        that nobody asked to keep, until then.
        """
        if owned and not isinstance(data, mmap.mmap):
            raise TypeError("an owned state is a buffer from state_buffer")
        now = self._clock()
        rec = new_record(
            kind=kind,
            owner=owner,
            lane=lane,
            tokens=tokens,
            fingerprint=self.fingerprint,
            tenant=tenant or self.cfg.tenant,
            state_format=self.state_format,
            nbytes=memoryview(data).nbytes,
            role=role,
            created=now,
            page_size=self.page_size,
            preview=preview,
        )
        # a buffer RAM may keep as the whole state: the one handed over, or a copy
        state: State | None = data if isinstance(data, mmap.mmap) and owned else None
        try:
            with self._lock:
                entry = self._entries.get(rec.id)
                if entry is not None:  # the same state again: nothing to cut or copy
                    self._expire_kept(now)
                    self._keep(entry, now + keep_s)
                    return self._refresh(entry, rec, now)
            # Cut, hashed and copied before taking the lock: 16 MiB take milliseconds. A
            # FULL state of the target is kept whole, its pages views into it (RAM hosts
            # it: a lookup of it assembles nothing); else only the pages RAM lacks are
            # copied.
            sp = self._split(rec, data, logits)
            rec = dataclasses.replace(rec, keys=key_bytes(sp.keys), rest_nbytes=len(sp.rest))
            whole: Whole | None = None
            with self._lock:
                host = self._paged(rec) and self._ram.would_host(sp.keys)
            if host:
                if state is None:  # into the spare: no page faults, unlike a new buffer
                    src = memoryview(data).cast("B")
                    state = self._spare.take(src.nbytes)
                    memoryview(state)[:] = src
                parts = sp.moved(state)
                whole = None if parts is None else Whole(state, parts)
            return self._store(rec, sp, whole, now, keep_s)
        finally:
            if state is not None:
                with self._lock:
                    kept = self._ram.whole_of(rec.id) is state
                if not kept:
                    self._spare.give(state)  # the next state is written into it

    @property
    def keeps_whole(self) -> bool:
        """Whether RAM may keep a FULL state of the target whole (states are cut into
        pages: the model has KV sections)."""
        return self.kv_sections > 0

    def state_buffer(self, nbytes: int) -> mmap.mmap:
        """A buffer of ``nbytes`` for a FULL state to be inserted ``owned``: written
        there by llama.cpp, kept whole by RAM without a copy."""
        return self._spare.take(nbytes)

    def _store(self, rec: CheckpointRecord, sp: Split, whole: Whole | None, now: float,
               keep_s: float) -> Record | None:
        """``insert``'s second half: into RAM (keeping ``whole`` where it may), else
        straight to disk."""
        with self._lock:
            missing = [] if whole is not None else self._ram.missing(sp.keys)
        copies = {i: sp.page(i) for i in missing}

        def source(i: int) -> bytes:
            page = copies.get(i)
            return page if page is not None else sp.page(i)

        sizes = [sp.page_size(i) for i in range(len(sp.keys))]
        cost = rec.rest_nbytes + rec.token_bytes
        deadline = time.monotonic() + _SPILL_WAIT_S
        with self._cond:
            self._expire_kept(now)
            shared: list[PageData] | None = None
            while True:
                entry = self._entries.get(rec.id)
                if entry is not None:
                    self._keep(entry, now + keep_s)
                    return self._refresh(entry, rec, now)
                entry = _Entry(rec, EntryStats(last_used=now))
                if self._ram.put(rec.id, sp.rest, cost, self._keep(entry, now + keep_s),
                                 sp.keys, sizes, source, whole):
                    self._add(entry)
                    self.counts.inserts += 1
                    self._queue_write(entry)
                    if self._remote is None:
                        return rec
                    shared = [self._ram.page(k) for k in sp.keys]
                    break
                left = deadline - time.monotonic()
                if not (self._spilling and self._writer.running and left > 0):
                    break
                self._cond.wait(left)  # the writer frees RAM as spilled states land
            if shared is None:
                pages: list[PageData] = [source(i) for i in range(len(sp.keys))]
                job = self._claim_direct(entry, sp.rest, pages)
                if job is None:
                    self.counts.refused += 1
                    if cost + sum(sizes) > self._ram.budget:
                        self._warn_once(
                            "too-big",
                            "pool: refused a %s %s state: it exceeds the RAM budget of %s%s",
                            format_size(rec.nbytes),
                            rec.kind.value,
                            format_size(self._ram.budget),
                            "" if self._disk is None else " and the disk took none",
                        )
                    return None
        if shared is not None:  # in RAM; the store gets copies, made without the lock
            self._share(rec, sp.rest, shared)
            return rec
        self._share(rec, sp.rest, pages)
        assert job is not None
        return rec if self._run_write(job) else None

    def _paged(self, rec: CheckpointRecord) -> bool:
        """Whether ``rec``'s state is cut into KV pages (a FULL state of the target)."""
        return rec.kind is Kind.FULL and rec.owner is Owner.TARGET and self.keeps_whole

    def _split(self, rec: CheckpointRecord, data: Buffer | mmap.mmap,
               logits: npt.NDArray[np.float32] | None = None) -> Split:
        """A FULL state of the target cut into its rest and KV pages; any other state
        kept whole (a rest without pages). The logits go at the rest's end."""
        return split(data, sections=self.kv_sections if self._paged(rec) else 0,
                     page_size=self.page_size, chain=rec.page_hashes,
                     tokens=rec.token_array(), logits=logits)

    def _share(self, rec: CheckpointRecord, rest: bytes, pages: list[PageData]) -> None:
        if self._remote is not None and rec.kind is Kind.FULL and rec.owner is Owner.TARGET:
            self._remote.put(rec, rest, [bytes(page_bytes(p)) for p in pages])

    def _claim_direct(self, entry: _Entry, rest: bytes, pages: list[PageData]
                      ) -> WriteJob | None:
        rec = _whole(entry.record)
        if rec.kind is not Kind.FULL or self._disk is None or rec.id in self._writing:
            return None
        if rec.rest_nbytes + rec.token_bytes > self._ram.budget:
            self._warn_once(
                "ram-small",
                "pool: the RAM budget of %s is smaller than a %s state: such states go "
                "straight to disk",
                format_size(self._ram.budget),
                format_size(rec.nbytes),
            )
        job = self._claim(entry, rest, pages, None)
        if job is not None:
            job.direct = True
            self.counts.direct_writes += 1
        return job

    def _refresh(self, entry: _Entry, rec: CheckpointRecord, now: float) -> Record:
        old = entry.record
        if self._ram.policy.stronger(rec.role, old.role):
            entry.record = dataclasses.replace(old, role=rec.role, preview=rec.preview)
            self._index.replace(entry.record)
        entry.stats.last_used = now
        if old.id in self._ram:
            self._ram.touch(old.id, self._cls(entry))
        # A copy only on disk stays there: its bytes are the same state.
        self.counts.refreshes += 1
        return entry.record

    def holds(self, chain: PageChain, n: int, *, tenant: str = "") -> bool:
        """Whether a FULL state after exactly ``chain.tokens[:n]`` is cached, in any local
        tier (the index and the tokens only: nothing is read)."""
        if chain.namespace != self.namespace(tenant) or chain.page_size != self.page_size:
            raise ValueError("chain was built for another tenant or page size")
        with self._lock:
            for rec in self._index.candidates(chain, kind=Kind.FULL, owner=Owner.TARGET,
                                              lane=None, max_n=n):
                return rec.n == n
            return False

    def keep(self, chain: PageChain, n: int, seconds: float, *, tenant: str = "") -> bool:
        """Keep the FULL state after ``chain.tokens[:n]`` for ``seconds`` more, above
        ordinary entries (a client's cache breakpoint on a prefix already cached); False
        when the pool holds no such state."""
        if chain.namespace != self.namespace(tenant) or chain.page_size != self.page_size:
            raise ValueError("chain was built for another tenant or page size")
        now = self._clock()
        with self._lock:
            for rec in self._index.candidates(chain, kind=Kind.FULL, owner=Owner.TARGET,
                                              lane=None, max_n=n):
                if rec.n != n:
                    return False
                entry = self._entries[rec.id]
                cls = self._keep(entry, now + seconds)
                if rec.id in self._ram:
                    self._ram.touch(rec.id, cls)
                return True
            return False

    def _keep(self, entry: _Entry, until: float) -> EvictionClass:
        """Keep ``entry`` until ``until`` at least; its eviction class now."""
        now = self._clock()
        if until > now and until > entry.stats.keep_until:
            entry.stats.keep_until = until
            self._kept[entry.record.id] = until
            self.counts.kept += 1
        return self._cls(entry)

    def _cls(self, entry: _Entry) -> EvictionClass:
        return entry.cls(self._ram.policy, self._clock())

    def _expire_kept(self, now: float) -> None:
        """Entries whose keeping time is up go back to their own eviction class."""
        for entry_id, until in list(self._kept.items()):
            if until > now:
                continue
            del self._kept[entry_id]
            entry = self._entries.get(entry_id)
            if entry is not None and entry_id in self._ram:
                self._ram.touch(entry_id, entry.cls(self._ram.policy, now))

    def drop_lane(self, lane: int, above: int = -1, owner: Owner | None = None) -> int:
        """Forget the partial checkpoints of ``lane`` past position ``above`` (its KV changed),
        of one ``owner`` (target or draft context) or, by default, of both.

        After the lane is cut back to ``above`` tokens, partial states at or below it
        still match its KV; ``above=-1`` forgets them all.
        """
        with self._lock:
            ids = [i for i in self._by_lane.get(lane, ())
                   if self._entries[i].record.n > above
                   and (owner is None or self._entries[i].record.owner is owner)]
            for entry_id in ids:
                self._remove(entry_id)
            return len(ids)

    def match_depth(self, chain: PageChain) -> int:
        """Tokens of ``chain`` (whole pages) that some cached checkpoint also starts with.

        Hashes only: a hint for where a branch point goes, never a proof of a match.
        """
        with self._lock:
            return self._index.depth(chain) * chain.page_size

    def remove(self, entry_id: str) -> bool:
        with self._lock:
            if entry_id not in self._entries:
                return False
            self._remove(entry_id)
            return True

    def flush(self) -> int:
        """Wait until every FULL entry held only in RAM is on disk; returns how many
        of them were written while this call waited (by it or by the writer)."""
        with self._cond:
            if self._disk is None:
                return 0
            dirty = [i for i, e in self._entries.items() if self._dirty(e)]
            for entry_id in dirty:
                if entry_id not in self._writing:
                    self._writer.enqueue(entry_id)
            while self._writer.running and any(
                i in self._writer.queue or i in self._writing for i in dirty
            ):
                self._cond.wait(0.5)
        for entry_id in dirty:  # what a stopped or broken writer left: written here
            with self._cond:
                while entry_id in self._writing:
                    self._cond.wait(0.5)
                self._writer.discard(entry_id)
                job = self._claim_queued(entry_id)
            if job is not None:
                self._run_write(job)
        with self._lock:
            return sum(1 for i in dirty if self._on_disk(i))

    def close(self) -> None:
        """Write every FULL state to disk, then release RAM and the disk directory.

        A second call (or one racing the first) waits for the first and loses nothing.
        """
        with self._close_lock:
            if self._remote is not None:
                self._remote.close()
                self._remote = None
                self.remote_status = "closed"
            self._writer.stop()
            self.flush()
            with self._cond:
                while self._writing:  # a direct write of an insert racing this close
                    self._cond.wait(0.5)
                for entry_id in list(self._ram.ids()):
                    self._ram.remove(entry_id)
                for pin in self._spilling.values():  # only states whose write failed
                    self._ram.unpin(pin)
                self._spilling.clear()
                self._entries.clear()
                self._by_lane.clear()
                self._index = Index()
                self._writer.queue.clear()
                if self._dir_lock is not None:
                    self._dir_lock.release()
                    self._dir_lock = None
                if self._disk is not None:
                    self.disk_status = "closed"
                self._disk = None

    # -- the disk writer ---------------------------------------------------------------

    def _dirty(self, entry: _Entry) -> bool:
        rec = entry.record
        return (
            rec.kind is Kind.FULL
            and not entry.no_disk
            and self._in_memory(rec.id)
            and not self._on_disk(rec.id)
        )

    def _queue_write(self, entry: _Entry) -> None:
        if self._disk is not None and self._writer.usable and self._dirty(entry):
            self._writer.enqueue(entry.record.id)

    def _claim_queued(self, entry_id: str) -> WriteJob | None:
        """A write of a state in memory: pin its bytes and reserve its files (lock held)."""
        entry = self._entries.get(entry_id)
        if entry is None or not self._dirty(entry) or entry_id in self._writing:
            return None
        if entry_id in self._ram:
            pin = self._ram.pin(entry_id)
        else:
            pin = self._spilling[entry_id]
            self._ram.pin_slot(pin)
        job = self._claim(entry, pin.data, [self._ram.page(k) for k in pin.keys], pin)
        if job is None:
            self._ram.unpin(pin)
            self._end_spill(entry_id)  # the disk cannot take it: a spilled state is lost
        return job

    def _claim(self, entry: _Entry, rest: Buffer, pages: list[PageData], pin: Pin | None
               ) -> WriteJob | None:
        disk = self._disk
        if disk is None:
            return None
        rec = _whole(entry.record)
        which = disk.reserve(rec, [page_nbytes(p) for p in pages])
        if which is None:
            entry.no_disk = True
            return None
        job = WriteJob(rec, rest, pages, which, pin, disk)
        self._writing[entry.record.id] = job
        return job

    def _run_write(self, job: WriteJob) -> bool:
        """Write the files without the lock, then publish them under the lock."""
        error: OSError | None = None
        written: tuple[int, dict[PageKey, int]] | None = None
        try:
            written = job.disk.write_file(job.record, job.data, job.pages, job.which)
        except OSError as e:
            error = e
        finally:
            with self._cond:
                ok = self._finish_write(job, written)
                self._cond.notify_all()
        if error is not None:
            self._warn_once(
                "write",
                "disk: writing %s failed: %s (later failures are logged at debug level)",
                job.record.id,
                error,
            )
        return ok

    def _finish_write(self, job: WriteJob, written: tuple[int, dict[PageKey, int]] | None
                      ) -> bool:
        entry_id = job.record.id
        del self._writing[entry_id]
        entry = self._entries.get(entry_id)
        ok = False
        if written is not None and (entry is not None or job.direct):
            ok = job.disk.commit(entry_id, *written)
            if ok:
                self.counts.disk_writes += 1
                if entry is None:  # written straight to disk: held there alone
                    self._add(_Entry(job.record, EntryStats(last_used=job.record.created)))
                    self._settle(entry_id)
            elif entry is not None:
                entry.no_disk = True
        else:
            job.disk.cancel(entry_id)
            if written is not None:  # removed while being written: the file is not wanted
                (job.disk.path / file_name(entry_id)).unlink(missing_ok=True)
            else:
                self.counts.disk_write_errors += 1
                if entry is not None:
                    entry.no_disk = True
        if job.pin is not None:
            self._ram.unpin(job.pin)
        self._end_spill(entry_id)
        return ok

    def _end_spill(self, entry_id: str) -> None:
        """Release a spilled state's RAM bytes (it is on disk now, or lost)."""
        pin = self._spilling.pop(entry_id, None)
        if pin is not None:
            self._ram.unpin(pin)
            self._settle(entry_id)

    # -- bookkeeping -------------------------------------------------------------------

    def _warn_once(self, key: str, msg: str, *args: object) -> None:
        if key in self._warned:
            log.debug(msg, *args)
        else:
            self._warned.add(key)
            log.warning(msg, *args)

    def _add(self, entry: _Entry, path: tuple[PageHash, ...] | None = None) -> None:
        """Index an entry (``path``: its page hashes, for a head)."""
        rec = entry.record
        self._entries[rec.id] = entry
        self._index.add(rec, self._exact_namespace(rec.tenant), path)
        if rec.lane is not None:
            self._by_lane.setdefault(rec.lane, set()).add(rec.id)

    def _forget(self, entry_id: str) -> None:
        entry = self._entries.pop(entry_id)
        self._kept.pop(entry_id, None)
        self._index.remove(entry_id)
        self._writer.discard(entry_id)
        lane = entry.record.lane
        if lane is not None:
            ids = self._by_lane[lane]
            ids.discard(entry_id)
            if not ids:
                del self._by_lane[lane]

    def _in_memory(self, entry_id: str) -> bool:
        return entry_id in self._ram or entry_id in self._spilling

    def _on_disk(self, entry_id: str) -> bool:
        return self._disk is not None and entry_id in self._disk

    def _settle(self, entry_id: str) -> None:
        """After an entry's state left memory or the disk: forget an entry no tier holds
        any more; keep only the head of one held on disk alone."""
        entry = self._entries.get(entry_id)
        if entry is None or self._in_memory(entry_id):
            return
        if not self._on_disk(entry_id):
            self._forget(entry_id)
        elif isinstance(entry.record, CheckpointRecord):
            entry.record = entry.record.head()
            self._index.replace(entry.record)

    def _remove(self, entry_id: str) -> None:
        self._ram.remove(entry_id)
        pin = self._spilling.pop(entry_id, None)
        if pin is not None:
            self._ram.unpin(pin)
        if self._disk is not None:
            self._disk.remove(entry_id)
        self._forget(entry_id)

    def _on_ram_evict(self, slot: Pin) -> bool:
        """Keep (True) the bytes of a FULL state not yet on disk, for the writer."""
        entry_id = slot.entry_id
        entry = self._entries[entry_id]
        if self._disk is not None and self._writer.usable and self._dirty_evicted(entry):
            self._spilling[entry_id] = slot
            self.counts.spills += 1
            self._writer.enqueue(entry_id)
            return True
        self._settle(entry_id)
        return False

    def _dirty_evicted(self, entry: _Entry) -> bool:
        rec = entry.record
        return rec.kind is Kind.FULL and not entry.no_disk and not self._on_disk(rec.id)

    def _on_disk_evict(self, entry_id: str) -> None:
        entry = self._entries.get(entry_id)
        if entry is not None:
            entry.no_disk = True  # least valuable by the disk's LRU: no rewrite, no churn
        self._settle(entry_id)

    # -- reports -----------------------------------------------------------------------

    def _describe(self, entry: _Entry) -> dict[str, Any]:
        rec = entry.record
        tiers = [
            t
            for t, ok in (("ram", self._in_memory(rec.id)), ("disk", self._on_disk(rec.id)))
            if ok
        ]
        out = rec.to_json()
        out.update(last_used=entry.stats.last_used, hits=entry.stats.hits, tiers=tiers)
        if entry.stats.keep_until > self._clock():
            out["kept_until"] = entry.stats.keep_until
        if self._ram.hosts(rec.id):
            out["whole"] = True  # kept whole in RAM: a hit assembles nothing
        return out

    def describe(self) -> list[dict[str, Any]]:
        with self._lock:
            out = [self._describe(e) for e in self._entries.values()]
        out.sort(key=lambda d: d["last_used"], reverse=True)
        return out

    def page_hashes(self) -> Mapping[str, tuple[PageHash, ...]]:
        """Each entry's page hashes, read from the index when asked: entries that share a
        hash share the tokens up to that page."""
        with self._lock:
            return self._index.paths()

    def get(self, entry_id: str) -> dict[str, Any] | None:
        if not isinstance(entry_id, str) or not valid_id(entry_id):
            return None
        with self._lock:
            entry = self._entries.get(entry_id)
            return None if entry is None else self._describe(entry)

    def stats(self) -> PoolStats:
        with self._lock:
            now = self._clock()
            ram, disk = self._ram, self._disk
            local: list[Tier] = [ram] if disk is None else [ram, disk]
            figures = [t.stats() for t in local]
            counts = self.counts.copy()
            out = dict(entries=len(self._entries), pinned_bytes=ram.pinned,
                       whole_states=ram.whole_states, whole_bytes=ram.whole_bytes,
                       quarantined=0 if disk is None else disk.quarantined,
                       write_queue=len(self._writer) + len(self._writing),
                       kept_entries=sum(1 for u in self._kept.values() if u > now))
            remote = self._remote
        tiers: list[Tier] = local if remote is None else [*local, remote]
        if remote is not None:
            figures.append(remote.stats())
        bw = self.costs.measured_bandwidth
        filled = tuple(dataclasses.replace(f, hits=counts.hits.get(t.name, 0),
                                           bandwidth=None if t.prior_bandwidth is None
                                           else bw(t.name))
                       for t, f in zip(tiers, figures, strict=True))
        off = {cls.label: why for cls, why, on in ((DiskTier, self.disk_status, disk),
                                                   (RemoteTier, self.remote_status, remote))
               if on is None}
        return PoolStats(**out, prefill_tps=self.costs.measured_prefill(), counts=counts,
                         tiers=filled, off=off)

    def sanity_check(self) -> None:
        with self._lock:
            self._ram.sanity_check()
            self._index.sanity_check()
            disk_ids: set[str] = set()
            if self._disk is not None:
                self._disk.sanity_check()
                disk_ids = set(self._disk.ids())
                if set(self._disk.reserved_ids()) != set(self._writing):
                    raise RuntimeError("pool: disk reservations differ from the writes running")
            elif self._writing:
                raise RuntimeError("pool: writes running without a disk tier")
            ram_ids = set(self._ram.ids())
            spill_ids = set(self._spilling)
            if not (ram_ids | disk_ids | spill_ids) <= set(self._entries):
                raise RuntimeError("pool: a tier holds an id that is not an entry")
            if ram_ids & spill_ids:
                raise RuntimeError("pool: a spilled state is still in the RAM tier")
            for entry_id, pin in self._spilling.items():
                if not pin.doomed or pin.pins < 1 or pin.entry_id != entry_id:
                    raise RuntimeError(f"pool: spilled state {entry_id} is not held")
            if len(self._index) != len(self._entries):
                raise RuntimeError(
                    f"pool: {len(self._index)} indexed, {len(self._entries)} entries"
                )
            lanes: dict[int, set[str]] = {}
            homes = ram_ids | disk_ids | spill_ids
            for entry_id, entry in self._entries.items():
                rec = entry.record
                if rec.id != entry_id or entry_id not in self._index:
                    raise RuntimeError(f"pool: entry {entry_id} is not indexed")
                if entry_id not in homes:
                    raise RuntimeError(f"pool: entry {entry_id} is in no tier")
                if rec.kind is Kind.PARTIAL and (entry_id in disk_ids or entry_id in spill_ids):
                    raise RuntimeError(f"pool: partial entry {entry_id} is on disk")
                slot = self._spilling.get(entry_id) or (
                    self._ram.slot(entry_id) if entry_id in ram_ids else None)
                whole = isinstance(rec, CheckpointRecord)
                if whole != (slot is not None):
                    raise RuntimeError(f"pool: entry {entry_id} is {'' if whole else 'not '}"
                                       f"whole, its state {'not ' if slot is None else ''}"
                                       f"in memory")
                if isinstance(rec, CheckpointRecord) and slot is not None \
                        and slot.keys != rec.page_keys:
                    raise RuntimeError(f"pool: entry {entry_id} names other pages in RAM")
                if entry_id in disk_ids and self._disk is not None and (
                        len(self._disk.keys(entry_id)) != 16 * rec.n_keys
                        or isinstance(rec, CheckpointRecord)
                        and self._disk.keys(entry_id) != rec.keys):
                    raise RuntimeError(f"pool: entry {entry_id} names other pages on disk")
                if rec.lane is not None:
                    lanes.setdefault(rec.lane, set()).add(entry_id)
            if lanes != self._by_lane:
                raise RuntimeError("pool: the lane map disagrees with the entries")
            for entry_id, until in self._kept.items():
                kept = self._entries.get(entry_id)
                if kept is None or kept.stats.keep_until != until:
                    raise RuntimeError(f"pool: kept entry {entry_id} disagrees with its stats")
            remote = self._remote
        if remote is not None:
            remote.sanity_check()


def _whole(rec: Record) -> CheckpointRecord:
    """The whole record of an entry whose state is in memory (never a head)."""
    if not isinstance(rec, CheckpointRecord):
        raise RuntimeError(f"pool: entry {rec.id} is in memory with its head alone")
    return rec


def _same(arr: Any, chain: PageChain) -> bool:
    return len(arr) == len(chain) and bool((arr == chain.tokens).all())
