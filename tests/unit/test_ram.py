from __future__ import annotations

from statecache.records import Role
from statecache.tiers.policy import EvictionClass, eviction_class
from statecache.tiers.ram import RamTier
from statecache.tiers.rampages import Pin

COLD, PERIODIC, WARM = EvictionClass.COLD, EvictionClass.PERIODIC, EvictionClass.WARM


def test_eviction_class_of_roles() -> None:
    assert eviction_class(Role.END_OF_REPLY, 0) is COLD
    assert eviction_class(Role.END_OF_REPLY, 1) is WARM  # a hit end-of-reply is valuable
    assert eviction_class(Role.PERIODIC, 3) is PERIODIC
    assert eviction_class(Role.BRANCH, 0) is WARM
    assert eviction_class(Role.REPLAY, 0) is WARM


def test_exact_eviction_order_with_pins() -> None:
    evicted: list[str] = []

    def on_evict(slot: Pin) -> bool:
        evicted.append(slot.entry_id)
        return False  # the bytes go

    ram = RamTier(5, on_evict=on_evict)
    # Five entries of one byte fill the budget.
    for name, cls in [("a", COLD), ("b", PERIODIC), ("c", WARM), ("d", COLD), ("e", PERIODIC)]:
        assert ram.put(name, b"x", 1, cls)
        ram.sanity_check()
    # Class first (cold, periodic, warm), LRU within a class.
    assert list(ram.eviction_order()) == ["a", "d", "b", "e", "c"]
    # Using b makes it the most recent periodic entry.
    ram.touch("b", PERIODIC)
    assert list(ram.eviction_order()) == ["a", "d", "e", "b", "c"]
    # A lease pins a: it leaves the eviction lists.
    pin = ram.pin("a")
    assert list(ram.eviction_order()) == ["d", "e", "b", "c"]
    # Five new warm entries push out everything but the pinned one, in order.
    for name in "fghij":
        assert ram.put(name, b"x", 1, WARM)
        ram.sanity_check()
    assert evicted == ["d", "e", "b", "c", "f"]
    assert "a" in ram and ram.used == 5
    # Unpinned, a returns as the most recently used of its class (cold: first to go).
    ram.unpin(pin)
    assert list(ram.eviction_order()) == ["a", "g", "h", "i", "j"]
    ram.sanity_check()


def test_too_big_or_all_pinned_is_refused_without_change() -> None:
    ram = RamTier(10)
    assert not ram.put("huge", b"x" * 11, 11, WARM)
    assert ram.put("a", b"x" * 6, 6, WARM)
    pin = ram.pin("a")
    # 5 bytes needed, only 4 free and nothing evictable.
    assert not ram.put("b", b"x" * 5, 5, WARM)
    assert ram.used == 6 and list(ram.ids()) == ["a"]
    ram.unpin(pin)
    assert ram.put("b", b"x" * 5, 5, WARM)
    assert list(ram.ids()) == ["b"]
    ram.sanity_check()


def test_removing_a_pinned_entry_frees_bytes_on_release() -> None:
    ram = RamTier(10)
    ram.put("a", b"x" * 4, 4, WARM)
    pin = ram.pin("a")
    assert ram.remove("a")
    assert "a" not in ram and ram.used == 4  # still held by the lease
    ram.sanity_check()
    # The same id can come back while the old bytes are still leased.
    assert ram.put("a", b"y" * 4, 4, WARM)
    assert ram.used == 8
    ram.unpin(pin)
    assert ram.used == 4 and ram.get("a") == b"yyyy"
    ram.sanity_check()


def test_evicted_bytes_kept_for_the_writer_count_until_released() -> None:
    # The pool keeps an evicted state not yet on disk: it stays in the byte count,
    # pinned once, until the writer has written it.
    kept: list[Pin] = []

    def keep_a(slot: Pin) -> bool:
        if slot.entry_id == "a":
            kept.append(slot)
            return True
        return False

    ram = RamTier(10, on_evict=keep_a)
    assert ram.put("a", b"x" * 4, 4, COLD)
    assert ram.put("b", b"x" * 4, 4, WARM)
    # c needs 4 of the 2 free bytes: a (cold) goes first, kept; nothing else is
    # evicted, but a's bytes still count, so c must wait.
    assert not ram.put("c", b"x" * 4, 4, WARM)
    assert [s.entry_id for s in kept] == ["a"] and "a" not in ram and "b" in ram
    assert (ram.used, ram.leaving, ram.pinned) == (8, 4, 4)
    ram.sanity_check()
    # Still waiting: b is not evicted for nothing.
    assert not ram.put("c", b"x" * 4, 4, WARM)
    assert "b" in ram
    # A lease on the kept slot, then the writer lets go: the bytes stay for the lease.
    ram.pin_slot(kept[0])
    ram.unpin(kept[0])
    assert ram.used == 8
    ram.unpin(kept[0])
    assert (ram.used, ram.leaving, ram.pinned) == (4, 0, 0)
    assert ram.put("c", b"x" * 4, 4, WARM)
    assert sorted(ram.ids()) == ["b", "c"]
    ram.sanity_check()
