"""CheckpointPool: the index and the tiers (RAM, disk, the shared store) behind one face
and one lock.

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

The pool works in rooms that share one record, ``Entries`` (pool/entries.py: the
entries, the tiers, the lock, and ``settle``): reads (pool/reads.py: lookups and
leases), offers (pool/offers.py: what each tier could start a prompt from, and
``take``), inserts (pool/inserts.py), the disk writer (pool/writer.py) and the report
(pool/report.py: ``stats``, ``describe``, ``sanity_check``); pool/opening.py opens the
tiers and closes them. This face hands each call to its room.

With ``[cache.remote]`` a third tier, shared by several proxies, sits behind the two
(``statecache.tiers.remote``): new FULL states go out to it in the background, and
``full_offers`` / ``take`` let the planner weigh each tier's copy by what it costs
to fetch (``statecache.costs``) before anything is read. A state taken from the
store joins the RAM tier as an entry of this pool, never sent back.
"""

from __future__ import annotations

import logging
import mmap
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from statecache.buffers import Buffer, Spare
from statecache.config import CacheConfig
from statecache.costs import Costs
from statecache.pages import PageChain, PageHash, Tokens, as_tokens
from statecache.pool.entries import Entries
from statecache.pool.inserts import Inserts
from statecache.pool.lease import Lease
from statecache.pool.offers import Offer, Offers
from statecache.pool.opening import close_tiers, open_tiers
from statecache.pool.reads import Reads
from statecache.pool.report import Report
from statecache.pool.stats import PoolStats
from statecache.pool.writer import DiskWriter
from statecache.records import Kind, Owner, Record, Role
from statecache.tiers.disk import DiskTier
from statecache.tiers.policy import ByClass
from statecache.tiers.ram import RamTier
from statecache.tiers.rampages import Pin
from statecache.tiers.remote import RemoteTier
from statecache.tiers.tier import Store

log = logging.getLogger(__name__)


class CheckpointPool:
    def __init__(
        self,
        cfg: CacheConfig,
        fingerprint: str,
        *,
        state_format: int = 1,
        kv_sections: int = 0,
        clock: Callable[[], float] = time.time,
        stores: Sequence[Store] = (),
    ) -> None:
        """``stores``: tiers behind the local ones besides ``[cache.remote]``'s, nearest
        first (closed with the pool)."""
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.state_format = state_format
        # KV caches a FULL state of this model starts with (MemoryInfo.kv_sections):
        # 0 keeps every state whole
        self.kv_sections = kv_sections
        self.page_size = cfg.page_size
        spare = Spare()
        ram = RamTier(cfg.ram_budget, on_evict=self._evicted, on_free=spare.give,
                      policy=ByClass())
        self._e = e = Entries(cfg, fingerprint, ram, spare, state_format=state_format,
                              clock=clock)
        self._writer = DiskWriter(e)
        self._reads = Reads(e)
        self._offers = Offers(e, self._reads, self._writer)
        self._inserts = Inserts(e, self._writer, kv_sections)
        self._report = Report(e)
        self._close_lock = threading.Lock()
        self._dir_lock = open_tiers(e, stores)

    def _evicted(self, slot: Pin) -> bool:
        """RAM evicts ``slot``: whether the disk writer keeps its bytes until written."""
        return self._writer.keep_evicted(slot)

    # -- what the pool is ---------------------------------------------------------------

    @property
    def costs(self) -> Costs:
        """What reaching a prefix costs from each tier, measured (the planner's input)."""
        return self._e.costs

    @property
    def disk_status(self) -> str:
        return self._e.disk_status

    @property
    def remote_status(self) -> str:
        return self._e.remote_status

    @property
    def disk(self) -> DiskTier | None:
        """The disk tier (None while it is off), for tools and tests that look at it."""
        return self._e.disk

    @property
    def remote(self) -> RemoteTier | None:
        """The shared tier (None while it is off)."""
        return self._e.remote

    @property
    def keeps_whole(self) -> bool:
        """Whether RAM may keep a FULL state of the target whole (states are cut into
        pages: the model has KV sections)."""
        return self.kv_sections > 0

    def namespace(self, tenant: str = "") -> PageHash:
        """h_0 for ``tenant`` (an empty tenant means the configured one)."""
        return self._e.namespace(tenant)

    def chain(
        self, tokens: Tokens, tenant: str = "", prev: PageChain | None = None
    ) -> PageChain:
        """Page hashes of ``tokens``; with ``prev``, pages shared with it are not rehashed."""
        ns = self.namespace(tenant)
        if prev is not None and prev.namespace == ns and prev.page_size == self.page_size:
            return prev.for_tokens(tokens)
        return PageChain(ns, self.page_size, tokens)

    # -- reads ---------------------------------------------------------------------------

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
        return self._reads.lookup(tokens, chain, kind=kind, owner=owner, lane=lane,
                                  max_n=max_n, tenant=tenant)

    def full_offers(
        self, tokens: Tokens, chain: PageChain, *, max_n: int, tenant: str = ""
    ) -> list[Offer]:
        """FULL states usable for ``tokens`` with ``n <= max_n``, nothing read: the
        deepest in memory, a deeper one on disk, deeper ones in each store (one round
        trip to the shared tier's index). ``take`` reads the one the planner picks."""
        return self._offers.full_offers(tokens, chain, max_n=max_n, tenant=tenant)

    def take(
        self, offer: Offer, tokens: Tokens, chain: PageChain, *, tenant: str = ""
    ) -> Lease | None:
        """Read ``offer`` (checked as any lookup is); None when it is gone or refused.

        A local offer gives the deepest local state at or below its ``n`` (so a copy
        evicted since is replaced by what is there now)."""
        return self._offers.take(offer, tokens, chain, tenant=tenant)

    def holds(self, chain: PageChain, n: int, *, tenant: str = "") -> bool:
        """Whether a FULL state after exactly ``chain.tokens[:n]`` is cached, in any local
        tier (the index and the tokens only: nothing is read)."""
        return self._reads.holds(chain, n, tenant)

    def dropped_cause(self, tokens: Tokens, *, tenant: str = "") -> str | None:
        """Why ``tokens`` missed where a checkpoint dropped for a page would have served
        them ("page missing", "page refused"; told once), or None (pool/lost.py)."""
        with self._e.lock:
            return self._e.lost.cause(as_tokens(tokens), tenant)

    def match_depth(self, chain: PageChain) -> int:
        """Tokens of ``chain`` (whole pages) that some cached checkpoint also starts with.

        Hashes only: a hint for where a branch point goes, never a proof of a match.
        """
        return self._reads.match_depth(chain)

    # -- changes -------------------------------------------------------------------------

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
        return self._inserts.insert(kind=kind, owner=owner, lane=lane, tokens=tokens,
                                    role=role, data=data, tenant=tenant, preview=preview,
                                    keep_s=keep_s, logits=logits, owned=owned)

    def state_buffer(self, nbytes: int) -> mmap.mmap:
        """A buffer of ``nbytes`` for a FULL state to be inserted ``owned``: written
        there by llama.cpp, kept whole by RAM without a copy."""
        return self._e.spare.take(nbytes)

    def keep(self, chain: PageChain, n: int, seconds: float, *, tenant: str = "") -> bool:
        """Keep the FULL state after ``chain.tokens[:n]`` for ``seconds`` more, above
        ordinary entries (a client's cache breakpoint on a prefix already cached); False
        when the pool holds no such state."""
        return self._inserts.keep(chain, n, seconds, tenant)

    def drop_lane(self, lane: int, above: int = -1, owner: Owner | None = None) -> int:
        """Forget the partial checkpoints of ``lane`` past position ``above`` (its KV changed),
        of one ``owner`` (target or draft context) or, by default, of both.

        After the lane is cut back to ``above`` tokens, partial states at or below it
        still match its KV; ``above=-1`` forgets them all.
        """
        return self._e.drop_lane(lane, above, owner)

    def remove(self, entry_id: str) -> bool:
        e = self._e
        with e.lock:
            if entry_id not in e.entries:
                return False
            e.remove(entry_id)
            return True

    def hold_writes(self, on: bool) -> None:
        """The engine prefills (``on``): the disk writer and the shared store's wait until
        it stops (at most ``tiers.background.HOLD_MAX_S``), so a checkpoint's write takes
        no core from the prefill."""
        self._writer.hold(on)
        if self._e.remote is not None:
            self._e.remote.hold(on)

    def flush(self) -> int:
        """Wait until every FULL entry held only in RAM is on disk; returns how many
        of them were written while this call waited (by it or by the writer)."""
        return self._writer.flush()

    def close(self) -> None:
        """Write every FULL state to disk, then release RAM and the disk directory.

        A second call (or one racing the first) waits for the first and loses nothing.
        """
        with self._close_lock:
            close_tiers(self._e, self._writer, self._dir_lock)
            self._dir_lock = None

    # -- reports -------------------------------------------------------------------------

    def describe(self) -> list[dict[str, Any]]:
        return self._report.describe()

    def page_hashes(self) -> Mapping[str, tuple[PageHash, ...]]:
        """Each entry's page hashes, read from the index when asked: entries that share a
        hash share the tokens up to that page."""
        return self._report.page_hashes()

    def get(self, entry_id: str) -> dict[str, Any] | None:
        return self._report.get(entry_id)

    def stats(self) -> PoolStats:
        return self._report.stats()

    def sanity_check(self) -> None:
        self._report.sanity_check()
