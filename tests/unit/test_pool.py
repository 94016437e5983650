from __future__ import annotations

import random

import pytest

from statecache.kvpages import REST_HEAD_BYTES as H
from statecache.records import Kind, Owner, Role
from tests.unit.conftest import PoolFactory, put

T = list(range(1, 41))  # 40 tokens = 10 pages of 4


def ids_in(pool, tier: str) -> set[str]:  # type: ignore[no-untyped-def]
    return {d["id"] for d in pool.describe() if tier in d["tiers"]}


def test_deepest_hit_and_lease_pins(make_pool: PoolFactory) -> None:
    pool = make_pool(disk=None)
    r8 = put(pool, T[:8], b"a" * 10)
    r13 = put(pool, T[:13], b"b" * 10)
    chain = pool.chain(T)
    with pool.lookup(T, chain) as lease:
        assert lease is not None
        assert lease.record.id == r13.id and lease.tier == "ram"
        assert bytes(lease.data) == b"b" * 10
        assert pool.stats().pinned_bytes == 10 + H + 13 * 4
    assert pool.stats().pinned_bytes == 0
    # max_n stops short of n=13 (the engine keeps a token to decode).
    lease = pool.lookup(T, chain, max_n=12)
    assert lease is not None and lease.record.id == r8.id
    lease.close()
    # A request that diverges at token 9 can only use n=8.
    other = T[:9] + [99] * 10
    lease = pool.lookup(other, pool.chain(other, prev=chain))
    assert lease is not None and lease.record.n == 8
    lease.close()
    assert pool.lookup([5, 6, 7], pool.chain([5, 6, 7])) is None
    s = pool.stats()
    assert (s.tier("ram").hits, s.counts.misses, s.counts.hits_by_role[Role.REPLAY]) == (3, 1, 3)
    pool.sanity_check()


def test_refresh_keeps_one_entry_and_the_stronger_role(make_pool: PoolFactory) -> None:
    pool = make_pool(disk=None)
    a = put(pool, T[:8], b"x" * 10, role=Role.PERIODIC)
    b = put(pool, T[:8], b"x" * 10, role=Role.BRANCH)
    c = put(pool, T[:8], b"x" * 10, role=Role.END_OF_REPLY)
    assert a.id == b.id == c.id
    assert [d["role"] for d in pool.describe()] == ["branch"]
    assert pool.stats().counts.refreshes == 2


def test_pool_eviction_order_and_write_through(make_pool: PoolFactory) -> None:
    # Each entry costs 20 state bytes + H (a state kept whole, statecache.kvpages) + 4*8
    # token bytes = 52 + H; the budget holds 4.
    pool = make_pool(ram=4 * (52 + H), disk=100_000)
    recs = {}
    for i, role in enumerate([Role.BRANCH, Role.END_OF_REPLY, Role.PERIODIC, Role.REPLAY]):
        recs[i] = put(pool, [100 + i] + T[:7], bytes([i]) * 20, role=role)
    # FULL states reach the disk in the background, in the order they came.
    pool.flush()
    assert list(pool.disk.ids()) == [recs[i].id for i in range(4)]  # type: ignore[union-attr]
    # Hit entry 1 (end-of-reply): it moves to the warm class, and to the disk's MRU end.
    toks = [101] + T[:7]
    pool.lookup(toks, pool.chain(toks)).close()  # type: ignore[union-attr]
    # Four branch entries push out: periodic 2, then the warm class in LRU order 0, 3, 1.
    gone: list[str] = []
    for i, victim in zip(range(4, 8), (2, 0, 3, 1), strict=True):
        recs[i] = put(pool, [100 + i] + T[:7], bytes([i]) * 20, role=Role.BRANCH)
        gone.append(recs[victim].id)
        assert ids_in(pool, "ram") == {r.id for r in recs.values()} - set(gone)
    pool.flush()
    assert ids_in(pool, "disk") == {r.id for r in recs.values()}
    s = pool.stats()
    ram = s.tier("ram")
    assert (ram.evictions, ram.bytes, s.counts.disk_writes) == (4, 4 * (52 + H), 8)
    # A disk hit is promoted back into RAM, evicting the oldest: entry 4 (on disk already).
    toks = [100] + T[:7]
    with pool.lookup(toks, pool.chain(toks)) as lease:  # type: ignore[union-attr]
        assert lease.tier == "disk" and bytes(lease.data) == bytes([0]) * 20
    assert recs[0].id in ids_in(pool, "ram") and pool.stats().counts.promotions == 1
    assert recs[4].id not in ids_in(pool, "ram")
    # Disk LRU order: 0..3 written, 1 used, 4..7 written, 0 used.
    disk_order = [recs[i].id for i in (2, 3, 1, 4, 5, 6, 7, 0)]
    assert list(pool.disk.ids()) == disk_order  # type: ignore[union-attr]


def test_partial_entries_never_reach_disk_and_drop_with_their_lane(
    make_pool: PoolFactory,
) -> None:
    pool = make_pool(ram=2 * (52 + H))
    p0 = put(pool, T[:8], b"p" * 20, kind=Kind.PARTIAL, lane=0)
    put(pool, T[:8], b"q" * 20, kind=Kind.PARTIAL, lane=1)
    lease = pool.lookup(T, pool.chain(T), kind=Kind.PARTIAL, lane=0)
    assert lease is not None and lease.record.id == p0.id
    lease.close()
    assert pool.lookup(T, pool.chain(T), kind=Kind.PARTIAL, lane=2) is None
    assert pool.drop_lane(0) == 1
    assert pool.lookup(T, pool.chain(T), kind=Kind.PARTIAL, lane=0) is None
    # Evicting a partial entry drops it; flush writes nothing.
    put(pool, T[:9], b"f" * 16)
    put(pool, T[:10], b"g" * 12)
    assert pool.stats().entries == 2 and pool.stats().counts.spills == 0
    assert pool.flush() == 2
    assert all(d["kind"] == "full" for d in pool.describe())


def test_caller_mistakes_are_value_errors(make_pool: PoolFactory) -> None:
    pool = make_pool(disk=None)
    with pytest.raises(ValueError):
        pool.insert(
            kind=Kind.PARTIAL, owner=Owner.TARGET, lane=None, tokens=T, role=Role.BRANCH, data=b"x"
        )
    with pytest.raises(ValueError):
        pool.insert(
            kind=Kind.FULL, owner=Owner.TARGET, lane=1, tokens=T, role=Role.BRANCH, data=b"x"
        )
    with pytest.raises(ValueError):
        pool.lookup(T, pool.chain(T[:5]))
    with pytest.raises(ValueError):
        pool.lookup(T, pool.chain(T, tenant="other"))
    assert pool.get("../../etc/passwd") is None and not pool.remove("nope")


def test_too_big_is_refused(make_pool: PoolFactory) -> None:
    pool = make_pool(ram=100, disk=None)
    assert (
        pool.insert(
            kind=Kind.FULL,
            owner=Owner.TARGET,
            lane=None,
            tokens=T,
            role=Role.BRANCH,
            data=b"x" * 100,
        )
        is None
    )
    assert pool.stats().counts.refused == 1 and pool.stats().entries == 0


def test_restart_serves_hits_from_disk(make_pool: PoolFactory) -> None:
    pool = make_pool()
    rec = put(pool, T[:13], b"state" * 4)
    put(pool, T[:9], b"p" * 8, kind=Kind.PARTIAL, lane=0)
    pool.close()
    again = make_pool()
    # Only the full one comes back; it hangs in the index at the right depth.
    assert [d["id"] for d in again.describe()] == [rec.id]
    with again.lookup(T, again.chain(T)) as lease:  # type: ignore[union-attr]
        assert lease.tier == "disk" and bytes(lease.data) == b"state" * 4
        assert lease.record.n == 13 and lease.record.page_hashes == rec.page_hashes
    again.close()
    # Another model's pool over the same directory sees nothing (and leaves it be).
    other = make_pool(fingerprint="other-model")
    assert other.disk_status == "ok" and other.describe() == []


def test_tenants_do_not_see_each_other(make_pool: PoolFactory) -> None:
    pool = make_pool(disk=None)
    pool.insert(
        kind=Kind.FULL,
        owner=Owner.TARGET,
        lane=None,
        tokens=T[:8],
        role=Role.BRANCH,
        data=b"x",
        tenant="alice",
    )
    assert pool.lookup(T, pool.chain(T, tenant="bob"), tenant="bob") is None
    lease = pool.lookup(T, pool.chain(T, tenant="alice"), tenant="alice")
    assert lease is not None
    lease.close()


def test_random_workload_never_exceeds_ram_budget(make_pool: PoolFactory) -> None:
    rnd = random.Random(1234)
    budget = 3000
    pool = make_pool(ram=budget, disk=20_000)
    stored: dict[str, bytes] = {}
    held = []
    prefixes = [[rnd.randrange(50) for _ in range(rnd.randrange(4, 40))] for _ in range(6)]
    for step in range(400):
        base = rnd.choice(prefixes)
        if rnd.random() < 0.5:
            # Save a state somewhere along a shared prefix.
            toks = base[: rnd.randrange(1, len(base) + 1)]
            data = bytes([step % 256]) * rnd.randrange(1, 400)
            kind = rnd.choice([Kind.FULL, Kind.PARTIAL])
            before = pool.stats().counts.inserts
            rec = pool.insert(
                kind=kind,
                owner=Owner.TARGET,
                lane=rnd.randrange(2) if kind is Kind.PARTIAL else None,
                tokens=toks,
                role=rnd.choice(list(Role)),
                data=data,
            )
            if rec is not None and pool.stats().counts.inserts > before:
                stored[rec.id] = data  # new entry (a refresh keeps the old bytes)
        else:
            # A request: the prefix plus a new turn.
            toks = base + [rnd.randrange(50) for _ in range(3)]
            kind, lane = rnd.choice([(Kind.FULL, None), (Kind.PARTIAL, 0), (Kind.PARTIAL, 1)])
            lease = pool.lookup(toks, pool.chain(toks), kind=kind, lane=lane, max_n=len(toks) - 1)
            if lease is not None:
                # What comes back is exactly what was stored under that id, for a prefix.
                assert bytes(lease.data) == stored[lease.record.id]
                assert list(lease.record.token_array()) == toks[: lease.record.n]
                if rnd.random() < 0.3 and len(held) < 3:
                    held.append(lease)
                else:
                    lease.close()
        if held and rnd.random() < 0.2:
            held.pop(0).close()
        measured = sum(d["rest_nbytes"] + 4 * d["n"] for d in pool.describe()
                       if "ram" in d["tiers"])
        assert measured <= pool.stats().tier("ram").bytes <= budget
        pool.sanity_check()
    for lease in held:
        lease.close()
    s = pool.stats()
    assert s.tier("ram").evictions > 0 and s.tier("ram").hits > 0 and s.counts.disk_writes > 0
