"""The record every room of the pool shares: its entries, its tiers and its one lock.

An entry is a checkpoint the pool holds in one tier or more: its record (whole while its
state is in memory, its head while the state is on disk alone) and its use. The rooms
(reads, inserts, the disk writer, the report) each change it under ``lock`` and keep
its invariants (written at the top of pool/facade.py, checked by the report's
``sanity_check``); the bookkeeping they share is here: adding and forgetting an entry,
where it is held, and ``settle``, which decides what is left of an entry once its state
left a tier.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from statecache.buffers import Spare
from statecache.config import CacheConfig
from statecache.costs import Costs
from statecache.pages import PageChain, PageHash, namespace_hash
from statecache.pool.index import Index
from statecache.pool.lost import Lost
from statecache.pool.stats import Counts
from statecache.records import CheckpointRecord, EntryStats, Owner, Record
from statecache.tiers.disk import DiskTier
from statecache.tiers.policy import EvictionClass
from statecache.tiers.ram import RamTier
from statecache.tiers.rampages import Pin
from statecache.tiers.remote import RemoteTier
from statecache.tiers.tier import Store, TierStats

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class Entry:
    record: Record  # whole while its state is in memory, its head on disk alone
    stats: EntryStats
    no_disk: bool = False  # the disk refused or evicted it: never written again


class Entries:
    """The pool's shared state. Every attribute but the configuration is read and
    changed under ``lock``; nothing slow runs while it is held."""

    def __init__(self, cfg: CacheConfig, fingerprint: str, ram: RamTier, spare: Spare, *,
                 state_format: int, clock: Callable[[], float]) -> None:
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.state_format = state_format
        self.page_size = cfg.page_size
        self.clock = clock
        self.lock = threading.RLock()
        self.cond = threading.Condition(self.lock)  # a write or a spill ended
        self.entries: dict[str, Entry] = {}
        self.kept: dict[str, float] = {}  # entries a client asked to keep: until when
        self.by_lane: dict[int, set[str]] = {}
        self.namespaces: dict[str, PageHash] = {}
        self.index = Index()
        self.counts = Counts()
        self.lost = Lost()  # checkpoints dropped for a page: why the next request missed
        self.warned: set[str] = set()
        self.ram = ram
        # the buffer a closed lease's state was assembled in, or a state kept whole
        # that RAM let go: the next assembly or state kept whole is written into it
        self.spare = spare
        self.spilling: dict[str, Pin] = {}  # evicted FULL states waiting for the disk
        # ids of FULL states waiting for the disk writer, oldest first (never bytes: a
        # queued state is in RAM, live or spilled, so the RAM budget bounds the queue)
        self.queue: OrderedDict[str, None] = OrderedDict()
        self.writing: set[str] = set()  # ids whose files are being written
        self.disk: DiskTier | None = None
        self.remote: RemoteTier | None = None  # the shared tier of [cache.remote]
        # the tiers behind the local ones, nearest first: the shared tier (while it is
        # open), then any the pool was given
        self.stores: list[Store] = []
        # each tier's state in words ("ok", or why it is off)
        self.disk_status = "disabled in the config"
        self.remote_status = "off"
        self.costs = Costs()

    @property
    def off(self) -> tuple[TierStats, ...]:
        """The figures of the tiers the pool has a place for that are not open (its
        status says why): zero, so a dashboard's series of them stay."""
        off = [] if self.disk is not None else [DiskTier.off(self.disk_status)]
        return tuple(off) if self.remote is not None else (*off,
                                                           RemoteTier.off(self.remote_status))

    # -- names -------------------------------------------------------------------------

    def namespace(self, tenant: str = "") -> PageHash:
        """h_0 for ``tenant`` (an empty tenant means the configured one)."""
        return self.exact_namespace(tenant or self.cfg.tenant)

    def exact_namespace(self, tenant: str) -> PageHash:
        ns = self.namespaces.get(tenant)
        if ns is None:
            ns = self.namespaces[tenant] = namespace_hash(self.fingerprint, tenant)
        return ns

    def check_chain(self, chain: PageChain, tenant: str) -> None:
        if chain.namespace != self.namespace(tenant) or chain.page_size != self.page_size:
            raise ValueError("chain was built for another tenant or page size")

    # -- where an entry is -------------------------------------------------------------

    def store(self, name: str) -> Store | None:
        """The store called ``name``, if the pool holds it."""
        return next((s for s in self.stores if s.name == name), None)

    def in_memory(self, entry_id: str) -> bool:
        return entry_id in self.ram or entry_id in self.spilling

    def on_disk(self, entry_id: str) -> bool:
        return self.disk is not None and entry_id in self.disk

    def add(self, entry: Entry, path: tuple[PageHash, ...] | None = None) -> None:
        """Index an entry (``path``: its page hashes, for a head)."""
        rec = entry.record
        self.entries[rec.id] = entry
        self.index.add(rec, self.exact_namespace(rec.tenant), path)
        if rec.lane is not None:
            self.by_lane.setdefault(rec.lane, set()).add(rec.id)

    def forget(self, entry_id: str) -> None:
        entry = self.entries.pop(entry_id)
        self.kept.pop(entry_id, None)
        self.index.remove(entry_id)
        self.queue.pop(entry_id, None)
        lane = entry.record.lane
        if lane is not None:
            ids = self.by_lane[lane]
            ids.discard(entry_id)
            if not ids:
                del self.by_lane[lane]

    def settle(self, entry_id: str) -> None:
        """After an entry's state left memory or the disk: forget an entry no tier holds
        any more; keep only the head of one held on disk alone."""
        entry = self.entries.get(entry_id)
        if entry is None or self.in_memory(entry_id):
            return
        if not self.on_disk(entry_id):
            self.forget(entry_id)
        elif isinstance(entry.record, CheckpointRecord):
            entry.record = entry.record.head()
            self.index.replace(entry.record)

    def remove(self, entry_id: str) -> None:
        """Out of every tier and the index (a pinned state stays until its lease goes)."""
        self.ram.remove(entry_id)
        pin = self.spilling.pop(entry_id, None)
        if pin is not None:
            self.ram.unpin(pin)
        if self.disk is not None:
            self.disk.remove(entry_id)
        self.forget(entry_id)

    def drop_lane(self, lane: int, above: int, owner: Owner | None) -> int:
        """Remove the partial states of ``lane`` past ``above``, of ``owner`` (None: both);
        how many."""
        with self.lock:
            ids = [i for i in self.by_lane.get(lane, ())
                   if self.entries[i].record.n > above
                   and (owner is None or self.entries[i].record.owner is owner)]
            for entry_id in ids:
                self.remove(entry_id)
            return len(ids)

    def disk_evicted(self, entry_id: str) -> None:
        """The disk tier let ``entry_id`` go (its budget)."""
        entry = self.entries.get(entry_id)
        if entry is not None:
            entry.no_disk = True  # least valuable by the disk's LRU: no rewrite, no churn
        self.settle(entry_id)

    # -- use ---------------------------------------------------------------------------

    def cls(self, entry: Entry, now: float | None = None) -> EvictionClass:
        """The entry's eviction class now, by the RAM tier's policy."""
        now = self.clock() if now is None else now
        return self.ram.policy.rank(entry.record.role, entry.stats.hits,
                                    entry.stats.keep_until > now)

    def hit(self, entry: Entry, tier: str) -> None:
        rec = entry.record
        entry.stats.hits += 1
        entry.stats.last_used = self.clock()
        if rec.id in self.ram:
            self.ram.touch(rec.id, self.cls(entry))
        if self.disk is not None and rec.id in self.disk:
            self.disk.touch(rec.id)
        self.counts.hit(tier, rec.role)

    def keep(self, entry: Entry, until: float) -> EvictionClass:
        """Keep ``entry`` until ``until`` at least; its eviction class now."""
        now = self.clock()
        if until > now and until > entry.stats.keep_until:
            entry.stats.keep_until = until
            self.kept[entry.record.id] = until
            self.counts.kept += 1
        return self.cls(entry)

    def expire_kept(self, now: float) -> None:
        """Entries whose keeping time is up go back to their own eviction class."""
        for entry_id, until in list(self.kept.items()):
            if until > now:
                continue
            del self.kept[entry_id]
            entry = self.entries.get(entry_id)
            if entry is not None and entry_id in self.ram:
                self.ram.touch(entry_id, self.cls(entry, now))

    def warn_once(self, key: str, msg: str, *args: object) -> None:
        if key in self.warned:
            log.debug(msg, *args)
        else:
            self.warned.add(key)
            log.warning(msg, *args)


def whole(rec: Record) -> CheckpointRecord:
    """The whole record of an entry whose state is in memory (never a head)."""
    if not isinstance(rec, CheckpointRecord):
        raise RuntimeError(f"pool: entry {rec.id} is in memory with its head alone")
    return rec
