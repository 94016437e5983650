"""What the pool says of itself: its checkpoints (``describe``, for /admin/checkpoints,
``statecache inspect`` and the live page), its figures (``stats``, typed:
pool/stats.py) and ``sanity_check``, which checks every invariant written at the top
of pool/facade.py and each tier's own; the tests call it after every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from statecache.formats.diskfmt import valid_id
from statecache.pages import PageHash
from statecache.pool.entries import Entries, Entry
from statecache.pool.stats import PoolStats
from statecache.records import CheckpointRecord, Kind
from statecache.tiers.tier import Tier


class Report:
    def __init__(self, e: Entries) -> None:
        self.e = e

    def local(self) -> list[Tier]:
        """The tiers of this process, nearest first (lock held)."""
        e = self.e
        return [e.ram] if e.disk is None else [e.ram, e.disk]

    def _describe(self, entry: Entry) -> dict[str, Any]:
        e = self.e
        rec = entry.record
        held = {e.ram.name: e.in_memory(rec.id)}
        if e.disk is not None:
            held[e.disk.name] = rec.id in e.disk
        out = rec.to_json()
        out.update(last_used=entry.stats.last_used, hits=entry.stats.hits,
                   tiers=[name for name, ok in held.items() if ok])
        if entry.stats.keep_until > e.clock():
            out["kept_until"] = entry.stats.keep_until
        if e.ram.hosts(rec.id):
            out["whole"] = True  # kept whole in RAM: a hit assembles nothing
        return out

    def describe(self) -> list[dict[str, Any]]:
        with self.e.lock:
            out = [self._describe(entry) for entry in self.e.entries.values()]
        out.sort(key=lambda d: d["last_used"], reverse=True)
        return out

    def page_hashes(self) -> Mapping[str, tuple[PageHash, ...]]:
        """Each entry's page hashes, read from the index when asked: entries that share a
        hash share the tokens up to that page."""
        with self.e.lock:
            return self.e.index.paths()

    def get(self, entry_id: str) -> dict[str, Any] | None:
        if not isinstance(entry_id, str) or not valid_id(entry_id):
            return None
        with self.e.lock:
            entry = self.e.entries.get(entry_id)
            return None if entry is None else self._describe(entry)

    def stats(self) -> PoolStats:
        e = self.e
        with e.lock:
            now = e.clock()
            ram, disk = e.ram, e.disk
            tiers = self.local()
            figures = [t.stats() for t in tiers]
            counts = e.counts.copy()
            out = dict(entries=len(e.entries), pinned_bytes=ram.pinned,
                       whole_states=ram.whole_states, whole_bytes=ram.whole_bytes,
                       quarantined=0 if disk is None else disk.quarantined,
                       write_queue=len(e.queue) + len(e.writing),
                       kept_entries=sum(1 for u in e.kept.values() if u > now))
            stores = list(e.stores)
            off = e.off
        for store in stores:  # each with its own lock: asked without the pool's
            tiers.append(store)
            figures.append(store.stats())
        bw = e.costs.measured_bandwidth
        filled = tuple(dataclasses.replace(f, hits=counts.hits.get(t.name, 0),
                                           bandwidth=None if t.prior_bandwidth is None
                                           else bw(t.name))
                       for t, f in zip(tiers, figures, strict=True))
        return PoolStats(**out, prefill_tps=e.costs.measured_prefill(), counts=counts,
                         tiers=filled, off=off)

    def sanity_check(self) -> None:
        e = self.e
        with e.lock:
            e.ram.sanity_check()
            e.index.sanity_check()
            disk_ids: set[str] = set()
            if e.disk is not None:
                e.disk.sanity_check()
                disk_ids = set(e.disk.ids())
                if set(e.disk.reserved_ids()) != e.writing:
                    raise RuntimeError("pool: disk reservations differ from the writes running")
            elif e.writing:
                raise RuntimeError("pool: writes running without a disk tier")
            ram_ids = set(e.ram.ids())
            spill_ids = set(e.spilling)
            if not (ram_ids | disk_ids | spill_ids) <= set(e.entries):
                raise RuntimeError("pool: a tier holds an id that is not an entry")
            if ram_ids & spill_ids:
                raise RuntimeError("pool: a spilled state is still in the RAM tier")
            for entry_id, pin in e.spilling.items():
                if not pin.doomed or pin.pins < 1 or pin.entry_id != entry_id:
                    raise RuntimeError(f"pool: spilled state {entry_id} is not held")
            if len(e.index) != len(e.entries):
                raise RuntimeError(f"pool: {len(e.index)} indexed, {len(e.entries)} entries")
            self._check_entries(ram_ids, disk_ids, spill_ids)
            stores = list(e.stores)
        for store in stores:
            store.sanity_check()

    def _check_entries(self, ram_ids: set[str], disk_ids: set[str], spill_ids: set[str]
                       ) -> None:
        """Each entry against the tiers that hold it, the lane map and the kept map."""
        e = self.e
        lanes: dict[int, set[str]] = {}
        homes = ram_ids | disk_ids | spill_ids
        for entry_id, entry in e.entries.items():
            rec = entry.record
            if rec.id != entry_id or entry_id not in e.index:
                raise RuntimeError(f"pool: entry {entry_id} is not indexed")
            if entry_id not in homes:
                raise RuntimeError(f"pool: entry {entry_id} is in no tier")
            if rec.kind is Kind.PARTIAL and (entry_id in disk_ids or entry_id in spill_ids):
                raise RuntimeError(f"pool: partial entry {entry_id} is on disk")
            slot = e.spilling.get(entry_id) or (
                e.ram.slot(entry_id) if entry_id in ram_ids else None)
            whole = isinstance(rec, CheckpointRecord)
            if whole != (slot is not None):
                raise RuntimeError(f"pool: entry {entry_id} is {'' if whole else 'not '}"
                                   f"whole, its state {'not ' if slot is None else ''}"
                                   f"in memory")
            if isinstance(rec, CheckpointRecord) and slot is not None \
                    and slot.keys != rec.page_keys:
                raise RuntimeError(f"pool: entry {entry_id} names other pages in RAM")
            if entry_id in disk_ids and e.disk is not None and (
                    len(e.disk.keys(entry_id)) != 16 * rec.n_keys
                    or isinstance(rec, CheckpointRecord) and e.disk.keys(entry_id) != rec.keys):
                raise RuntimeError(f"pool: entry {entry_id} names other pages on disk")
            if rec.lane is not None:
                lanes.setdefault(rec.lane, set()).add(entry_id)
        if lanes != e.by_lane:
            raise RuntimeError("pool: the lane map disagrees with the entries")
        for entry_id, until in e.kept.items():
            kept = e.entries.get(entry_id)
            if kept is None or kept.stats.keep_until != until:
                raise RuntimeError(f"pool: kept entry {entry_id} disagrees with its stats")
