"""The pool's figures, typed: what happened since it started (``Counts``, kept under the
pool's lock) and what it holds now (``PoolStats``, with each tier's ``TierStats``).
``/metrics`` (proxy/meters.py) maps them field by field; the live page draws them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from statecache.records import Role
from statecache.tiers.tier import TierStats


@dataclass(slots=True)
class Counts:
    """Events since the pool started."""

    inserts: int = 0
    refreshes: int = 0  # a state inserted again: its entry used, nothing stored
    misses: int = 0  # lookups that found nothing usable
    spills: int = 0  # FULL states RAM let go before the disk had them, kept for the writer
    promotions: int = 0  # states read from disk that joined RAM again
    refused: int = 0  # states no tier took
    kept: int = 0  # entries a client's cache breakpoint asked to keep
    bad_states: int = 0  # states that did not assemble into the one saved (a miss)
    store_misses: int = 0  # offers of a store behind the local tiers that could not be used
    direct_writes: int = 0  # states larger than the RAM budget, written straight to disk
    disk_writes: int = 0
    disk_write_errors: int = 0
    hits: dict[str, int] = field(default_factory=dict)  # by the tier that served them
    # checkpoints dropped because a page they need went missing or was refused, by that
    dropped: dict[str, int] = field(default_factory=dict)
    hits_by_role: dict[Role, int] = field(default_factory=lambda: dict.fromkeys(Role, 0))

    def hit(self, tier: str, role: Role | None = None) -> None:
        """A lookup served from ``tier``, of an entry of ``role`` (None: not one of this
        pool's entries, as a state a store gave or one removed while it was read)."""
        self.hits[tier] = self.hits.get(tier, 0) + 1
        if role is not None:
            self.hits_by_role[role] += 1

    def copy(self) -> Counts:
        return dataclasses.replace(self, hits=dict(self.hits), dropped=dict(self.dropped),
                                   hits_by_role=dict(self.hits_by_role))


@dataclass(slots=True, frozen=True)
class PoolStats:
    """The pool at one moment (``CheckpointPool.stats``)."""

    entries: int
    kept_entries: int  # entries kept now for a client's breakpoint
    pinned_bytes: int  # of RAM's bytes, those leases and writes hold
    whole_states: int  # states RAM keeps whole beside their pages
    whole_bytes: int
    quarantined: int  # files the disk tier moved aside
    write_queue: int  # states waiting for the disk writer (and those being written)
    prefill_tps: float  # measured prefill rate (0: not yet)
    counts: Counts
    tiers: tuple[TierStats, ...]  # nearest first: RAM, disk, the stores behind
    off: tuple[TierStats, ...] = ()  # the tiers that are not open: zero, and why

    def tier(self, name: str) -> TierStats:
        """The figures of the tier called ``name`` (open or off); KeyError where the pool
        has no place for it."""
        for t in (*self.tiers, *self.off):
            if t.name == name:
                return t
        raise KeyError(name)

    def to_json(self) -> dict[str, object]:
        counts = {f.name: getattr(self.counts, f.name) for f in dataclasses.fields(Counts)}
        counts["hits_by_role"] = {r.value: n for r, n in self.counts.hits_by_role.items()}
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(counts=counts, tiers=[t.to_json() for t in self.tiers],
                   off=[t.to_json() for t in self.off])
        return out
