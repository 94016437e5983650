"""Which checkpoint a tier lets go first: the eviction policy, one object the RAM tier
is given (``RamTier(policy=...)``), holding its rules and its order.

``ByClass``, the policy the pool uses, evicts by class, then least recently used
within a class. An entry's class comes from what it is and how it was used: an
end-of-reply state never hit goes first (the next turn usually renders the reply
otherwise), then periodic states, then the rest (branch and replay points, and
end-of-reply states that were hit); a state a client asked to keep (a cache
breakpoint) goes last while its time runs. The order lives in a data structure: one
ordered map per class, oldest first, so choosing a victim never scans; an entry that
is pinned is in none.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from collections.abc import Iterator

from statecache.records import Role


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


# A role evicted later than another (a refreshed entry keeps the stronger of the two).
_STRENGTH: dict[Role, int] = {
    Role.END_OF_REPLY: 0,
    Role.PERIODIC: 1,
    Role.REPLAY: 2,
    Role.BRANCH: 3,
}


class ByClass:
    """Evict by ``EvictionClass``, least recently used first within a class."""

    def __init__(self) -> None:
        self._lru: dict[EvictionClass, OrderedDict[str, None]] = {
            c: OrderedDict() for c in EvictionClass}

    @staticmethod
    def rank(role: Role, hits: int, kept: bool) -> EvictionClass:
        """The class of an entry of ``role``, hit ``hits`` times, kept by a client or not."""
        return eviction_class(role, hits, kept)

    @staticmethod
    def stronger(new: Role, old: Role) -> bool:
        """Whether an entry stored again as ``new`` is evicted later than as ``old``."""
        return _STRENGTH[new] > _STRENGTH[old]

    def add(self, entry_id: str, cls: EvictionClass) -> None:
        """``entry_id`` is evictable, the most recently used of ``cls``."""
        self._lru[cls][entry_id] = None

    def remove(self, entry_id: str, cls: EvictionClass) -> None:
        del self._lru[cls][entry_id]

    def discard(self, entry_id: str, cls: EvictionClass) -> None:
        self._lru[cls].pop(entry_id, None)

    def move(self, entry_id: str, old: EvictionClass, new: EvictionClass) -> None:
        """Used again, perhaps in another class: the most recently used of ``new``."""
        del self._lru[old][entry_id]
        self._lru[new][entry_id] = None

    def victim(self) -> str | None:
        """The next entry to go, out of the order (None: nothing is evictable)."""
        for lru in self._lru.values():
            if lru:
                return lru.popitem(last=False)[0]
        return None

    def order(self) -> Iterator[str]:
        """Every evictable id, in the order they would go."""
        for lru in self._lru.values():
            yield from lru

    def listed(self) -> Iterator[tuple[EvictionClass, str]]:
        """Each evictable id with the class it is listed in (``sanity_check``)."""
        for cls, lru in self._lru.items():
            for entry_id in lru:
                yield cls, entry_id
