"""CheckpointPool: the index, the RAM tier and the disk tier behind one lock.

Invariants (checked by ``sanity_check``): every entry is in the index and in at
least one tier; every tier id is an entry; PARTIAL entries are never on disk;
the bytes each tier accounts equal what it holds and stay within its budget.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from statecache.config import CacheConfig
from statecache.disk import DiskTier
from statecache.diskfmt import valid_id
from statecache.index import Index
from statecache.lease import Buffer, Lease
from statecache.pages import PageChain, PageHash, Tokens, as_tokens, namespace_hash
from statecache.ram import EvictionClass, Pin, RamTier, eviction_class
from statecache.records import (
    ROLE_STRENGTH,
    CheckpointRecord,
    EntryStats,
    Kind,
    Owner,
    Role,
    new_record,
)

log = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class _Entry:
    record: CheckpointRecord
    stats: EntryStats

    @property
    def cls(self) -> EvictionClass:
        return eviction_class(self.record.role, self.stats.hits)


class CheckpointPool:
    def __init__(
        self,
        cfg: CacheConfig,
        fingerprint: str,
        *,
        state_format: int = 1,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cfg = cfg
        self.fingerprint = fingerprint
        self.state_format = state_format
        self.page_size = cfg.page_size
        self._clock = clock
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._by_lane: dict[int, set[str]] = {}
        self._namespaces: dict[str, PageHash] = {}
        self._index = Index()
        self._counts: Counter[str] = Counter()
        self._ram = RamTier(cfg.ram_budget, on_evict=self._on_ram_evict)
        self._disk: DiskTier | None = None
        if cfg.disk_enabled:
            self._disk = DiskTier(
                Path(cfg.disk_path).expanduser(),
                cfg.disk_budget,
                fingerprint,
                state_format=state_format,
                page_size=cfg.page_size,
                on_evict=self._on_disk_evict,
            )
            for rec in self._disk.scan():
                self._add(_Entry(rec, EntryStats(last_used=rec.created)))
            log.info("pool: %d checkpoints found on disk in %s", len(self._disk), cfg.disk_path)

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
        with self._lock:
            group: list[CheckpointRecord] = []
            for rec in self._index.candidates(
                chain, kind=kind, owner=owner, lane=lane, max_n=limit
            ):
                if group and rec.n != group[0].n:
                    lease = self._try_group(group)
                    if lease is not None:
                        return lease
                    group = []
                group.append(rec)
            lease = self._try_group(group) if group else None
            if lease is None:
                self._counts["misses"] += 1
            return lease

    def _try_group(self, group: list[CheckpointRecord]) -> Lease | None:
        # Equal depth: RAM before disk.
        group.sort(key=lambda r: r.id not in self._ram)
        for rec in group:
            lease = self._try(rec)
            if lease is not None:
                return lease
        return None

    def _try(self, rec: CheckpointRecord) -> Lease | None:
        entry = self._entries.get(rec.id)
        if entry is None or entry.record is not rec:
            raise RuntimeError(f"pool: index holds {rec.id} but the entry differs")
        pin: Pin | None = None
        if rec.id in self._ram:
            tier = "ram"
            pin = self._ram.pin(rec.id)
            data: Buffer = pin.data
        elif self._disk is not None and rec.id in self._disk:
            tier = "disk"
            got = self._disk.read(rec.id)
            if got is None:
                self._forget_if_homeless(rec.id)
                return None
            data = got
            if self._ram.put(rec.id, got, rec.nbytes + rec.token_bytes, entry.cls):
                self._counts["promotions"] += 1
                pin = self._ram.pin(rec.id)
        else:
            raise RuntimeError(f"pool: entry {rec.id} is in no tier")
        entry.stats.hits += 1
        entry.stats.last_used = self._clock()
        if rec.id in self._ram:
            self._ram.touch(rec.id, entry.cls)
        if self._disk is not None and rec.id in self._disk:
            self._disk.touch(rec.id)
        self._counts[f"hits_{tier}"] += 1
        self._counts["hits_role_" + rec.role.value.replace("-", "_")] += 1
        return Lease(self, rec, tier, data, pin)

    def _release(self, pin: Pin | None) -> None:
        if pin is not None:
            with self._lock:
                self._ram.unpin(pin)

    # -- changes -----------------------------------------------------------------------

    def insert(
        self,
        *,
        kind: Kind,
        owner: Owner,
        lane: int | None,
        tokens: Tokens,
        role: Role,
        data: Buffer,
        tenant: str = "",
        preview: str = "",
    ) -> CheckpointRecord | None:
        """Store a copy of ``data`` as the state after ``tokens``; None if refused."""
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
        with self._lock:
            entry = self._entries.get(rec.id)
            if entry is not None:
                return self._refresh(entry, rec, now)
            blob = bytes(data)
            entry = _Entry(rec, EntryStats(last_used=now))
            if not self._ram.put(rec.id, blob, rec.nbytes + rec.token_bytes, entry.cls):
                self._counts["refused"] += 1
                return None
            self._add(entry)
            self._counts["inserts"] += 1
            return rec

    def _refresh(self, entry: _Entry, rec: CheckpointRecord, now: float) -> CheckpointRecord:
        old = entry.record
        if ROLE_STRENGTH[rec.role] > ROLE_STRENGTH[old.role]:
            entry.record = dataclasses.replace(old, role=rec.role, preview=rec.preview)
            self._index.replace(entry.record)
        entry.stats.last_used = now
        if old.id in self._ram:
            self._ram.touch(old.id, entry.cls)
        # A copy only on disk stays there: its bytes are the same state.
        self._counts["refreshes"] += 1
        return entry.record

    def drop_lane(self, lane: int, above: int = -1) -> int:
        """Forget the partial checkpoints of ``lane`` past position ``above`` (its KV changed).

        After the lane is cut back to ``above`` tokens, partial states at or below it
        still match its KV; ``above=-1`` forgets them all.
        """
        with self._lock:
            ids = [i for i in self._by_lane.get(lane, ()) if self._entries[i].record.n > above]
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
        """Write every FULL entry held only in RAM to disk; returns how many were written."""
        if self._disk is None:
            return 0
        written = 0
        with self._lock:
            for entry_id in list(self._entries):
                entry = self._entries.get(entry_id)
                data = self._ram.get(entry_id)
                if entry is None or data is None or entry.record.kind is not Kind.FULL:
                    continue
                if entry_id not in self._disk and self._disk.write(entry.record, data):
                    written += 1
        return written

    def close(self) -> None:
        """Flush to disk, then release the RAM tier."""
        with self._lock:
            self.flush()
            for entry_id in list(self._ram.ids()):
                self._ram.remove(entry_id)
                self._forget_if_homeless(entry_id)

    # -- bookkeeping -------------------------------------------------------------------

    def _add(self, entry: _Entry) -> None:
        rec = entry.record
        self._entries[rec.id] = entry
        self._index.add(rec, self._exact_namespace(rec.tenant))
        if rec.lane is not None:
            self._by_lane.setdefault(rec.lane, set()).add(rec.id)

    def _forget(self, entry_id: str) -> None:
        entry = self._entries.pop(entry_id)
        self._index.remove(entry_id)
        lane = entry.record.lane
        if lane is not None:
            ids = self._by_lane[lane]
            ids.discard(entry_id)
            if not ids:
                del self._by_lane[lane]

    def _forget_if_homeless(self, entry_id: str) -> None:
        in_disk = self._disk is not None and entry_id in self._disk
        if entry_id in self._entries and entry_id not in self._ram and not in_disk:
            self._forget(entry_id)

    def _remove(self, entry_id: str) -> None:
        self._ram.remove(entry_id)
        if self._disk is not None:
            self._disk.remove(entry_id)
        self._forget(entry_id)

    def _on_ram_evict(self, entry_id: str, data: bytes | bytearray) -> None:
        entry = self._entries[entry_id]
        self._counts["evictions"] += 1
        disk = self._disk
        spill = entry.record.kind is Kind.FULL and disk is not None and entry_id not in disk
        if spill and disk is not None and disk.write(entry.record, data):
            self._counts["spills"] += 1
        self._forget_if_homeless(entry_id)

    def _on_disk_evict(self, entry_id: str) -> None:
        self._counts["disk_evictions"] += 1
        self._forget_if_homeless(entry_id)

    # -- reports -----------------------------------------------------------------------

    def _describe(self, entry: _Entry) -> dict[str, Any]:
        rec = entry.record
        tiers = [
            t for t, ok in (("ram", rec.id in self._ram), ("disk", self._on_disk(rec.id))) if ok
        ]
        out = rec.to_json()
        out.update(last_used=entry.stats.last_used, hits=entry.stats.hits, tiers=tiers)
        return out

    def _on_disk(self, entry_id: str) -> bool:
        return self._disk is not None and entry_id in self._disk

    def describe(self) -> list[dict[str, Any]]:
        with self._lock:
            out = [self._describe(e) for e in self._entries.values()]
        out.sort(key=lambda d: d["last_used"], reverse=True)
        return out

    def get(self, entry_id: str) -> dict[str, Any] | None:
        if not isinstance(entry_id, str) or not valid_id(entry_id):
            return None
        with self._lock:
            entry = self._entries.get(entry_id)
            return None if entry is None else self._describe(entry)

    def stats(self) -> dict[str, int]:
        with self._lock:
            disk = self._disk
            out: dict[str, int] = {
                "entries": len(self._entries),
                "ram_entries": len(self._ram),
                "ram_bytes": self._ram.used,
                "ram_budget": self._ram.budget,
                "ram_pinned_bytes": self._ram.pinned,
                "disk_entries": len(disk) if disk is not None else 0,
                "disk_bytes": disk.used if disk is not None else 0,
                "disk_budget": disk.budget if disk is not None else 0,
                "quarantined": disk.quarantined if disk is not None else 0,
            }
            for key in (
                "inserts",
                "refreshes",
                "misses",
                "hits_ram",
                "hits_disk",
                "evictions",
                "disk_evictions",
                "spills",
                "promotions",
                "refused",
            ):
                out[key] = self._counts[key]
            for role in Role:
                key = "hits_role_" + role.value.replace("-", "_")
                out[key] = self._counts[key]
            return out

    def sanity_check(self) -> None:
        with self._lock:
            self._ram.sanity_check()
            self._index.sanity_check()
            disk_ids: set[str] = set()
            if self._disk is not None:
                self._disk.sanity_check()
                disk_ids = set(self._disk.ids())
            ram_ids = set(self._ram.ids())
            if not (ram_ids | disk_ids) <= set(self._entries):
                raise RuntimeError("pool: a tier holds an id that is not an entry")
            if len(self._index) != len(self._entries):
                raise RuntimeError(
                    f"pool: {len(self._index)} indexed, {len(self._entries)} entries"
                )
            lanes: dict[int, set[str]] = {}
            for entry_id, entry in self._entries.items():
                rec = entry.record
                if rec.id != entry_id or entry_id not in self._index:
                    raise RuntimeError(f"pool: entry {entry_id} is not indexed")
                if entry_id not in ram_ids and entry_id not in disk_ids:
                    raise RuntimeError(f"pool: entry {entry_id} is in no tier")
                if rec.kind is Kind.PARTIAL and entry_id in disk_ids:
                    raise RuntimeError(f"pool: partial entry {entry_id} is on disk")
                if rec.lane is not None:
                    lanes.setdefault(rec.lane, set()).add(entry_id)
            if lanes != self._by_lane:
                raise RuntimeError("pool: the lane map disagrees with the entries")


def _same(arr: Any, chain: PageChain) -> bool:
    return len(arr) == len(chain) and bool((arr == chain.tokens).all())
