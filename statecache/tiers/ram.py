"""RAM tier: checkpoints and the KV pages they share, under a hard byte budget, evicted
as its policy says (``statecache.tiers.policy``: by class, then least recently used).

An entry is its rest (``statecache.kvpages``: everything of a state but its KV pages)
and the keys of its pages; each page is held once, with a count of the entries that
refer to it, and its bytes go with the last of them. Eviction chooses entries, never
pages.

Each unpinned entry sits in the policy's order (one ordered map per eviction class,
oldest first); pinned entries sit in none, so eviction never scans and never touches
them.
An entry removed while pinned, or evicted into the hands of the disk writer, is
"doomed": it keeps its bytes and its pages, counted in the budget, until its last pin
goes.

A FULL entry may also keep its whole state (a *host*): its pages are then views into
that state, not copies, so a lookup of it hands llama.cpp the state as saved, with no
assembly, and the only bytes it costs beyond its pages are the state's others (its
``extra``). A host hosts every page it names; a new host takes over the pages of the
hosts before it (a conversation's newer state holds its older one's pages), which
keep their rests and lose their whole states, and a page whose host goes while
others still name it is copied out of it.

Entries' slots and their shared pages are statecache.tiers.rampages. Byte counts,
kept in step by ``_hold``/``_let_go``/``_pin``/``_unpin``/``_doom`` (each page's change
comes back from ``SharedPages`` as bytes) and recounted by ``sanity_check``:
``used`` is every entry's own bytes (live or doomed) plus every page's; ``pinned``
the own bytes of pinned entries plus the pages any of them refers to; ``leaving`` the
own bytes of doomed entries plus the pages only doomed entries refer to (freed when
their last pins go).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator, Sequence

from statecache.kvpages import PageData, PageKey
from statecache.sizes import format_size
from statecache.tiers.policy import ByClass, EvictionClass
from statecache.tiers.rampages import Pin, SharedPages, State, Whole
from statecache.tiers.tier import TierStats

log = logging.getLogger(__name__)

# Told of each eviction; returns True to keep the bytes (the slot stays, doomed and
# pinned once for the caller, who unpins it when done: the disk writer does so).
EvictCallback = Callable[[Pin], bool]
# The bytes of the page a new entry refers to, by its index in the entry's keys.
PageSource = Callable[[int], bytes]
# Told of each whole state RAM lets go (no page is a view into it any more).
FreeCallback = Callable[[State], None]


class RamTier:
    name = "ram"
    label = "RAM"
    prior_bandwidth: float | None = None  # a state in memory is not read: nothing to fetch

    def __init__(self, budget: int, on_evict: EvictCallback | None = None,
                 on_free: FreeCallback | None = None, policy: ByClass | None = None) -> None:
        if budget < 0:
            raise ValueError(f"ram budget must be >= 0, got {budget}")
        self.budget = budget
        self.used = 0  # every byte held, including removed-but-leased entries
        self.pinned = 0  # bytes that cannot be evicted now
        self.leaving = 0  # bytes freed as the last pins of doomed entries go
        self.whole_states = 0  # entries kept whole
        self.whole_bytes = 0  # their whole states' bytes (their pages' among them)
        self.evictions = 0
        self._on_evict = on_evict
        self._on_free = on_free
        self._slots: dict[str, Pin] = {}
        self._doomed: set[Pin] = set()
        self._pages = SharedPages()
        # what goes first, and the order of what may go (pinned entries are not in it)
        self.policy = policy if policy is not None else ByClass()

    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, entry_id: object) -> bool:
        return entry_id in self._slots

    @property
    def pages(self) -> int:
        return len(self._pages)

    @property
    def page_bytes(self) -> int:
        """Of ``used``, the pages'."""
        return self._pages.bytes

    def get(self, entry_id: str) -> bytes | bytearray | None:
        slot = self._slots.get(entry_id)
        return None if slot is None else slot.data

    def slot(self, entry_id: str) -> Pin:
        return self._slots[entry_id]

    def has_page(self, key: PageKey) -> bool:
        return key in self._pages

    def page(self, key: PageKey) -> PageData:
        """A page's bytes, as one buffer or as its parts (immutable: valid after the
        page is freed)."""
        return self._pages.data(key)

    def whole_of(self, entry_id: str) -> State | None:
        """The entry's whole state, where it keeps one."""
        slot = self._slots.get(entry_id)
        return None if slot is None else slot.whole

    def hosts(self, entry_id: str) -> bool:
        """Whether the entry keeps its whole state."""
        return self.whole_of(entry_id) is not None

    def would_host(self, keys: Sequence[PageKey]) -> bool:
        """Whether a new entry naming ``keys`` would keep its whole state (room aside)."""
        return self._pages.would_host(keys, self._pages.hosts_of(keys))

    def missing(self, keys: Sequence[PageKey]) -> list[int]:
        """Indices of ``keys`` whose pages this tier does not hold."""
        return self._pages.missing(keys)

    def put(self, entry_id: str, data: bytes | bytearray, cost: int, cls: EvictionClass,
            keys: Sequence[PageKey] = (), sizes: Sequence[int] = (),
            source: PageSource | None = None, whole: Whole | None = None) -> bool:
        """Store an entry: ``data`` and the pages ``keys`` (of ``sizes`` bytes; those
        not held yet come from ``source``), evicting others first; False if it does
        not fit. With ``whole``, the entry keeps its whole state and hosts its pages
        (views into it), unless a host of one of them is pinned: then it is stored
        as without.

        Over the whole budget or blocked by live pins: False with nothing changed. Else
        it evicts exactly what makes room once doomed bytes are freed, and returns
        False if those are still held (try again when they go).
        """
        if entry_id in self._slots:
            raise RuntimeError(f"ram: {entry_id} is already stored")
        if len(keys) != len(sizes) or len(set(keys)) != len(keys):
            raise RuntimeError("ram: page keys and sizes disagree, or a key repeats")
        olds = self._pages.hosts_of(keys)
        if whole is not None and (len(whole.parts) != len(keys)
                                  or not self._pages.would_host(keys, olds)):
            whole = None
        # what the entry adds, what it pins while it is being stored, and the bytes of
        # shared pages that leave no more once it refers to them
        new, pins, back = self._pages.cost(keys, sizes)
        new, pins = new + cost, pins + cost
        extra = 0 if whole is None else len(whole.state) - sum(sizes)
        if extra < 0:
            raise RuntimeError("ram: a whole state smaller than its pages")
        if new + extra > self.budget or \
                self.budget - (self.pinned - self.leaving) < pins + extra - back:
            whole, extra = None, 0  # room for its pages, not for its state as well
        cost, new, pins = cost + extra, new + extra, pins + extra
        if new > self.budget:
            return False
        if self.budget - (self.pinned - self.leaving) < pins - back:
            log.info("ram: refused %s (%s): the rest of the budget is pinned", entry_id,
                     format_size(new))
            return False
        # In, pinned, so that eviction keeps its pages; out again if room never comes.
        slot = Pin(entry_id, data, cost, cls, tuple(keys))
        for i, key in enumerate(keys):
            if key not in self._pages:
                if whole is not None:
                    blob: PageData = whole.parts[i]
                elif source is None:
                    raise RuntimeError(f"ram: page {key.hex()} is neither held nor given")
                else:
                    blob = source(i)
                self._pages.add(key, blob, sizes[i])
                self.used += sizes[i]
            if whole is not None:  # the same bytes (its key names them), now its view
                self._pages.view(key, whole.parts[i], slot)
        if whole is not None:
            slot.whole, slot.extra = whole.state, extra
            self.whole_states += 1
            self.whole_bytes += len(whole.state)
            for old in olds:
                self._demote(old)
        self._slots[entry_id] = slot
        self.used += cost
        self._hold(slot)
        self._pin(slot)
        while self.used - self.leaving > self.budget:
            if not self._evict_one():
                raise RuntimeError("ram: evictable bytes ran out before the budget was met")
        if self.used > self.budget:
            self._unpin(slot)
            self.remove(entry_id)
            return False
        self._unpin(slot)
        return True

    def touch(self, entry_id: str, cls: EvictionClass) -> None:
        """Mark as most recently used, possibly in a new class."""
        slot = self._slots[entry_id]
        if slot.pins == 0:
            self.policy.move(entry_id, slot.cls, cls)
        slot.cls = cls

    def pin(self, entry_id: str) -> Pin:
        slot = self._slots[entry_id]
        if slot.pins == 0:
            self._pin(slot)
        else:
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
        if slot.pins > 1:
            slot.pins -= 1
            return
        self._unpin(slot)
        if slot.doomed:
            self._doomed.remove(slot)
            self.used -= slot.cost
            self.leaving -= slot.cost
            self._let_go(slot, was_live=False)

    def remove(self, entry_id: str) -> bool:
        """Drop an entry; a pinned one keeps its bytes until its last lease closes."""
        slot = self._slots.pop(entry_id, None)
        if slot is None:
            return False
        if slot.pins:
            self._doom(slot)
        else:
            self.policy.remove(entry_id, slot.cls)
            self.used -= slot.cost
            self._let_go(slot, was_live=True)
        return True

    def ids(self) -> Iterator[str]:
        return iter(self._slots)

    def eviction_order(self) -> Iterator[str]:
        """Ids in the order they would be evicted."""
        return self.policy.order()

    def stats(self) -> TierStats:
        return TierStats(self.name, self.label, entries=len(self._slots), bytes=self.used,
                         budget=self.budget, pages=len(self._pages),
                         page_bytes=self.page_bytes, evictions=self.evictions)

    # -- the one place counts change --------------------------------------------------

    def _hold(self, slot: Pin) -> None:
        """A new live, unpinned entry refers to its pages."""
        self.leaving -= self._pages.hold(slot.keys)

    def _let_go(self, slot: Pin, *, was_live: bool) -> None:
        """An entry's references go (it was removed unpinned, or its last pin went)."""
        freed, leaving = self._pages.let_go(slot, was_live=was_live)
        self.used -= freed
        self.leaving += leaving
        self._drop_whole(slot)

    def _demote(self, slot: Pin) -> None:
        """A host (live, unpinned) whose pages a newer host took over keeps its rest
        only; pages of its own that the newer one lacks are copied out of its state."""
        self._pages.copy_out_of(slot)
        self.used -= slot.extra
        slot.cost -= slot.extra
        slot.extra = 0
        self._drop_whole(slot)

    def _drop_whole(self, slot: Pin) -> None:
        state = slot.whole
        if state is not None:
            self.whole_states -= 1
            self.whole_bytes -= len(state)
            slot.whole = None
            if self._on_free is not None:
                self._on_free(state)

    def _pin(self, slot: Pin) -> None:
        """First pin: out of the eviction lists, its bytes and pages pinned."""
        if self._slots.get(slot.entry_id) is slot:
            self.policy.discard(slot.entry_id, slot.cls)
        slot.pins = 1
        self.pinned += slot.cost + self._pages.pin(slot.keys)

    def _unpin(self, slot: Pin) -> None:
        """Last pin: back in its eviction list unless doomed."""
        slot.pins = 0
        self.pinned -= slot.cost + self._pages.unpin(slot.keys)
        if not slot.doomed:
            self.policy.add(slot.entry_id, slot.cls)  # released = most recently used

    def _doom(self, slot: Pin) -> None:
        slot.doomed = True
        self._doomed.add(slot)
        self.leaving += slot.cost + self._pages.doom(slot.keys)

    def _evict_one(self) -> bool:
        entry_id = self.policy.victim()
        if entry_id is None:
            return False
        slot = self._slots.pop(entry_id)
        self.evictions += 1
        if self._on_evict is not None and self._on_evict(slot):
            self._pin(slot)
            self._doom(slot)
        else:
            self.used -= slot.cost
            self._let_go(slot, was_live=True)
        return True

    def sanity_check(self) -> None:
        live = list(self._slots.values())
        every = live + list(self._doomed)
        pages, pinned_pages, leaving_pages = self._pages.check(every, set(every))
        wholes = [s.whole for s in every if s.whole is not None]
        if (len(wholes), sum(map(len, wholes))) != (self.whole_states, self.whole_bytes):
            raise RuntimeError(f"ram: {self.whole_states} whole states of {self.whole_bytes} "
                               "bytes accounted, entries hold others")
        for s in every:
            if s.whole is None and s.extra:
                raise RuntimeError(f"ram: {s.entry_id} counts a whole state it lacks")
        total = sum(s.cost for s in every) + pages
        if total != self.used:
            raise RuntimeError(f"ram: {self.used} bytes accounted, entries hold {total}")
        if self.used > self.budget:
            raise RuntimeError(f"ram: {self.used} bytes used over a budget of {self.budget}")
        pinned = sum(s.cost for s in every if s.pins) + pinned_pages
        if pinned != self.pinned:
            raise RuntimeError(f"ram: {self.pinned} pinned bytes accounted, {pinned} held")
        leaving = sum(s.cost for s in self._doomed) + leaving_pages
        if leaving != self.leaving:
            raise RuntimeError(f"ram: {self.leaving} doomed bytes accounted, {leaving} held")
        listed = 0
        for cls, entry_id in self.policy.listed():
            slot = self._slots.get(entry_id)
            if slot is None or slot.cls is not cls or slot.pins:
                raise RuntimeError(f"ram: {entry_id} misplaced in eviction class {cls.name}")
            listed += 1
        if listed + sum(1 for s in live if s.pins) != len(live):
            raise RuntimeError("ram: an unpinned entry is missing from the eviction lists")
        if any(not s.pins or not s.doomed for s in self._doomed):
            raise RuntimeError("ram: a removed entry still holds bytes with no lease")
