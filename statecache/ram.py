"""RAM tier: state bytes under a hard byte budget, evicted by class then LRU.

Each unpinned entry sits in exactly one OrderedDict (its eviction class, oldest
first); pinned entries sit in none, so eviction never scans and never touches them.
An entry removed while pinned, or evicted into the hands of the disk writer, is
"doomed": it keeps its bytes, counted in the budget, until its last pin goes.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from statecache.records import Role
from statecache.sizes import format_size

log = logging.getLogger(__name__)


class EvictionClass(enum.IntEnum):
    """Evicted in this order; LRU within a class."""

    COLD = 0  # end-of-reply never hit
    PERIODIC = 1
    WARM = 2  # branch, replay, and end-of-reply entries that were hit
    KEPT = 3  # a client asked to keep it (a cache breakpoint) and its time is not up


def eviction_class(role: Role, hits: int, kept: bool = False) -> EvictionClass:
    if kept:
        return EvictionClass.KEPT
    if role is Role.PERIODIC:
        return EvictionClass.PERIODIC
    if role is Role.END_OF_REPLY and hits == 0:
        return EvictionClass.COLD
    return EvictionClass.WARM


@dataclass(slots=True, eq=False)
class Pin:
    """One entry's bytes; a lease holds it so a removed entry stays valid until released."""

    entry_id: str
    data: bytes | bytearray
    cost: int  # state bytes + token bytes
    cls: EvictionClass
    pins: int = 0
    doomed: bool = False  # removed while pinned: freed on the last unpin


# Told of each eviction; returns True to keep the bytes (the slot stays, doomed and
# pinned once for the caller, who unpins it when done: the disk writer does so).
EvictCallback = Callable[[Pin], bool]


class RamTier:
    def __init__(self, budget: int, on_evict: EvictCallback | None = None) -> None:
        if budget < 0:
            raise ValueError(f"ram budget must be >= 0, got {budget}")
        self.budget = budget
        self.used = 0  # every byte held, including removed-but-leased entries
        self.pinned = 0  # bytes of entries that cannot be evicted now
        self.leaving = 0  # bytes of doomed entries: freed as their last pin goes
        self.evictions = 0
        self._on_evict = on_evict
        self._slots: dict[str, Pin] = {}
        self._doomed: set[Pin] = set()
        self._lru: dict[EvictionClass, OrderedDict[str, None]] = {
            c: OrderedDict() for c in EvictionClass
        }

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._slots

    def get(self, entry_id: str) -> bytes | bytearray | None:
        slot = self._slots.get(entry_id)
        return None if slot is None else slot.data

    def put(self, entry_id: str, data: bytes | bytearray, cost: int, cls: EvictionClass) -> bool:
        """Store ``data``, evicting others first; False if it does not fit.

        Over the whole budget or blocked by live pins: False with nothing changed. Else
        it evicts exactly what makes room once doomed bytes are freed, and returns
        False if those are still held (try again when they go).
        """
        if entry_id in self._slots:
            raise RuntimeError(f"ram: {entry_id} is already stored")
        if cost > self.budget:
            return False
        if self.budget - (self.pinned - self.leaving) < cost:
            log.info(
                "ram: refused %s (%s): the rest of the budget is pinned",
                entry_id,
                format_size(cost),
            )
            return False
        while self.used - self.leaving + cost > self.budget:
            if not self._evict_one():
                raise RuntimeError("ram: evictable bytes ran out before the budget was met")
        if self.used + cost > self.budget:
            return False
        self._slots[entry_id] = Pin(entry_id, data, cost, cls)
        self._lru[cls][entry_id] = None
        self.used += cost
        return True

    def touch(self, entry_id: str, cls: EvictionClass) -> None:
        """Mark as most recently used, possibly in a new class."""
        slot = self._slots[entry_id]
        if slot.pins == 0:
            del self._lru[slot.cls][entry_id]
            self._lru[cls][entry_id] = None
        slot.cls = cls

    def pin(self, entry_id: str) -> Pin:
        slot = self._slots[entry_id]
        if slot.pins == 0:
            del self._lru[slot.cls][entry_id]
            self.pinned += slot.cost
        slot.pins += 1
        return slot

    def pin_slot(self, slot: Pin) -> None:
        """One more pin on a slot that already holds one (a doomed slot has no id here)."""
        if slot.pins <= 0:
            raise RuntimeError(f"ram: {slot.entry_id} is not pinned")
        slot.pins += 1

    def unpin(self, slot: Pin) -> None:
        if slot.pins <= 0:
            raise RuntimeError(f"ram: unpinning {slot.entry_id} which is not pinned")
        slot.pins -= 1
        if slot.pins:
            return
        self.pinned -= slot.cost
        if slot.doomed:
            self._doomed.remove(slot)
            self.used -= slot.cost
            self.leaving -= slot.cost
        else:
            self._lru[slot.cls][slot.entry_id] = None  # released = most recently used

    def remove(self, entry_id: str) -> bool:
        """Drop an entry; a pinned one keeps its bytes until its last lease closes."""
        slot = self._slots.pop(entry_id, None)
        if slot is None:
            return False
        if slot.pins:
            self._doom(slot)
        else:
            del self._lru[slot.cls][entry_id]
            self.used -= slot.cost
        return True

    def _doom(self, slot: Pin) -> None:
        slot.doomed = True
        self._doomed.add(slot)
        self.leaving += slot.cost

    def ids(self) -> Iterator[str]:
        return iter(self._slots)

    def eviction_order(self) -> Iterator[str]:
        """Ids in the order they would be evicted."""
        for cls in EvictionClass:
            yield from self._lru[cls]

    def _evict_one(self) -> bool:
        for cls in EvictionClass:
            lru = self._lru[cls]
            if lru:
                entry_id, _ = lru.popitem(last=False)
                slot = self._slots.pop(entry_id)
                self.evictions += 1
                if self._on_evict is not None and self._on_evict(slot):
                    slot.pins = 1
                    self.pinned += slot.cost
                    self._doom(slot)
                else:
                    self.used -= slot.cost
                return True
        return False

    def sanity_check(self) -> None:
        live = list(self._slots.values())
        total = sum(s.cost for s in live) + sum(s.cost for s in self._doomed)
        if total != self.used:
            raise RuntimeError(f"ram: {self.used} bytes accounted, entries hold {total}")
        if self.used > self.budget:
            raise RuntimeError(f"ram: {self.used} bytes used over a budget of {self.budget}")
        pinned = sum(s.cost for s in live if s.pins) + sum(s.cost for s in self._doomed)
        if pinned != self.pinned:
            raise RuntimeError(f"ram: {self.pinned} pinned bytes accounted, {pinned} held")
        listed = 0
        for cls, lru in self._lru.items():
            for entry_id in lru:
                slot = self._slots.get(entry_id)
                if slot is None or slot.cls is not cls or slot.pins:
                    raise RuntimeError(f"ram: {entry_id} misplaced in eviction class {cls.name}")
                listed += 1
        if listed + sum(1 for s in live if s.pins) != len(live):
            raise RuntimeError("ram: an unpinned entry is missing from the eviction lists")
        if any(not s.pins or not s.doomed for s in self._doomed):
            raise RuntimeError("ram: a removed entry still holds bytes with no lease")
        if sum(s.cost for s in self._doomed) != self.leaving:
            raise RuntimeError(f"ram: {self.leaving} doomed bytes accounted, wrong sum")
