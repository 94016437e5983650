"""A conversation's KV held once in RAM: checkpoints name pages, pages are counted once
and freed with their last checkpoint, eviction chooses checkpoints (page size 4,
states written the way llama.cpp writes them: tests/unit/kvstate.py)."""

from __future__ import annotations

import mmap
import random
from pathlib import Path

import pytest

from statecache.kvpages import split
from statecache.pages import PageChain, namespace_hash
from statecache.records import Kind, Owner, Role
from tests.unit.conftest import FP, PoolFactory, put
from tests.unit.kvstate import conversation_state, page_bytes

PAGE = page_bytes(4)


def tokens(conv: int, n: int) -> list[int]:
    return [1000 * (conv + 1) + i for i in range(n)]


def rest(conv: int, n: int) -> int:
    """The bytes of a checkpoint's rest (its own bytes beside its tokens and pages)."""
    chain = PageChain(namespace_hash(FP, ""), 4, tokens(conv, n)).hashes
    return len(split(conversation_state(n, conv=conv), sections=1, page_size=4,
                     chain=chain).rest)


def extra(conv: int, n: int) -> int:
    """What a checkpoint kept whole costs beyond its rest and pages: its state's other
    bytes (headers, cell metadata, a partial page, the recurrent part)."""
    return len(conversation_state(n, conv=conv)) - (n // 4) * PAGE


def save(pool, conv: int, n: int, role: Role = Role.REPLAY):  # type: ignore[no-untyped-def]
    return put(pool, tokens(conv, n), conversation_state(n, conv=conv), role=role)


def whole_ids(pool) -> set[str]:  # type: ignore[no-untyped-def]
    """The checkpoints RAM keeps whole (a hit hands over the state saved)."""
    return {d["id"] for d in pool.describe() if d.get("whole")}


def lease_of(pool, toks: list[int], n: int):  # type: ignore[no-untyped-def]
    lease = pool.lookup(toks + [7], pool.chain(toks + [7]), max_n=n)
    assert lease is not None and lease.record.n == n
    return lease


def state_of(pool, conv: int, n: int) -> bytes | None:  # type: ignore[no-untyped-def]
    """The state after exactly ``n`` tokens, or None (a miss, or only a shorter one)."""
    toks = tokens(conv, n) + [7, 7]
    lease = pool.lookup(toks, pool.chain(toks), max_n=n)
    if lease is None:
        return None
    with lease:
        return bytes(lease.data) if lease.record.n == n else None


def test_checkpoints_of_one_conversation_hold_its_kv_once(make_pool: PoolFactory) -> None:
    pool = make_pool(ram=1 << 20, disk=None, kv_sections=1)
    ns = [8, 16, 24, 32, 40]  # 2 .. 10 pages
    recs = [save(pool, 0, n) for n in ns]
    s = pool.stats()
    # ten pages, each held once, whatever the number of checkpoints that name them
    assert (s.tier("ram").pages, s.tier("ram").page_bytes) == (10, 10 * PAGE)
    assert [r.n_keys for r in recs] == [2, 4, 6, 8, 10]
    own = sum(rest(0, n) + 4 * n for n in ns)
    assert s.tier("ram").bytes == own + 10 * PAGE + extra(0, 40)  # the newest is kept whole
    whole = sum(len(conversation_state(n)) for n in ns)
    assert s.tier("ram").bytes < whole * 0.45  # the states whole: every page 3 times on average
    for n in ns:  # each assembles to exactly the state that was saved
        assert state_of(pool, 0, n) == conversation_state(n)
    pool.sanity_check()


def test_eviction_chooses_checkpoints_and_a_page_goes_with_its_last_user(
    make_pool: PoolFactory,
) -> None:
    # A at 16 and 32 tokens (A16's 4 pages are A32's first 4), B at 32: the budget holds
    # exactly these.
    budget = (rest(0, 16) + 64) + (rest(0, 32) + 128) + (rest(1, 32) + 128) + 16 * PAGE \
        + extra(0, 32) + extra(1, 32)  # A32 and B32 kept whole, A16 not (A32 hosts its pages)
    pool = make_pool(ram=budget, disk=None, kv_sections=1)
    a16, a32, b32 = save(pool, 0, 16), save(pool, 0, 32), save(pool, 1, 32)
    assert pool.stats().tier("ram").bytes == budget
    # C at 8 tokens: the oldest checkpoint, A16, goes first but frees only its own bytes
    # (A32 names its pages); A32 goes next, and its 8 pages with it. B stays.
    c8 = save(pool, 2, 8)
    held = {d["id"] for d in pool.describe()}
    assert held == {b32.id, c8.id} and pool.stats().tier("ram").evictions == 2
    assert pool.stats().tier("ram").pages == 8 + 2
    assert state_of(pool, 1, 32) == conversation_state(32, conv=1)
    assert pool.stats().tier("ram").bytes == (rest(1, 32) + 128) + (rest(2, 8) + 32) + 10 * PAGE \
        + extra(1, 32) + extra(2, 8)
    del a16, a32


def test_a_leased_checkpoint_keeps_its_pages_while_others_go(make_pool: PoolFactory) -> None:
    budget = (rest(0, 16) + 64) + (rest(0, 32) + 128) + (rest(1, 32) + 128) + 16 * PAGE \
        + extra(0, 32) + extra(1, 32)
    pool = make_pool(ram=budget, disk=None, kv_sections=1)
    a16, a32, b32 = save(pool, 0, 16), save(pool, 0, 32), save(pool, 1, 32)
    toks = tokens(0, 32) + [5]
    lease = pool.lookup(toks, pool.chain(toks))
    assert lease is not None and lease.record.id == a32.id
    # pinned: A32 (kept whole) and every page it names (A16's too) are out of eviction's reach
    assert pool.stats().pinned_bytes == rest(0, 32) + 128 + 8 * PAGE + extra(0, 32)
    c8 = save(pool, 2, 8)  # A16 goes (its own bytes only), then B32 (its 8 pages)
    assert {d["id"] for d in pool.describe()} == {a32.id, c8.id}
    assert pool.stats().tier("ram").pages == 8 + 2
    assert bytes(lease.data) == conversation_state(32)
    lease.close()
    assert pool.stats().pinned_bytes == 0
    del a16, b32


def test_a_removed_checkpoint_under_lease_keeps_its_pages_counted(
    make_pool: PoolFactory,
) -> None:
    pool = make_pool(ram=1 << 20, disk=None, kv_sections=1)
    a16 = save(pool, 0, 16)
    toks = tokens(0, 16) + [5]
    lease = pool.lookup(toks, pool.chain(toks))
    assert lease is not None
    assert pool.remove(a16.id)
    s = pool.stats()
    assert (s.entries, s.tier("ram").pages) == (0, 4)  # gone, its bytes leased
    a16b = save(pool, 0, 16)  # the same state again: its pages are those still held
    assert a16b.id == a16.id and pool.stats().tier("ram").pages == 4
    lease.close()
    assert pool.stats().tier("ram").pages == 4 and state_of(pool, 0, 16) == conversation_state(16)
    pool.remove(a16b.id)
    assert pool.stats().tier("ram").pages == 0 and pool.stats().tier("ram").bytes == 0


def test_ram_hits_assemble_in_one_buffer_and_never_into_a_state_kept_whole(
    make_pool: PoolFactory,
) -> None:
    # The first hit that assembles does so into a new buffer; once its lease is closed,
    # the next assembles into that one (a new buffer of 80 MB costs its page faults
    # every time: 20 ms of a 50 ms restore). A state kept whole (the newest of each
    # conversation, and one under a page) is a view of RAM's own bytes, never handed
    # out as a buffer to write the next state into.
    pool = make_pool(ram=1 << 20, disk=None, kv_sections=1)
    _, a40, _, b24 = save(pool, 0, 32), save(pool, 0, 40), save(pool, 1, 16), save(pool, 1, 24)
    part = pool.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=tokens(2, 3),
                       role=Role.REPLAY, data=conversation_state(3, conv=2))
    assert part is not None and part.n_keys == 0  # under a page: kept whole

    def hit(conv: int, n: int) -> object:
        with lease_of(pool, tokens(conv, n), n) as lease:
            assert bytes(lease.data) == conversation_state(n, conv=conv)
            return lease.data.obj

    assert whole_ids(pool) == {a40.id, b24.id}
    first = hit(0, 32)
    assert isinstance(first, mmap.mmap)
    assert hit(1, 16) is first and hit(0, 32) is first
    for conv, n in ((2, 3), (0, 40), (1, 24)):
        assert hit(conv, n) is not first
    assert hit(1, 16) is first  # no state kept whole became the spare
    assert state_of(pool, 2, 3) == conversation_state(3, conv=2)


def test_the_newest_state_of_a_conversation_is_handed_over_as_saved(
    make_pool: PoolFactory,
) -> None:
    # The newest checkpoint is kept whole and its pages are views into it: a hit on it
    # gives llama.cpp the very bytes that were saved (no assembly, no copy), the pages
    # are not held twice, and the older checkpoints assemble from views into it.
    pool = make_pool(ram=1 << 20, disk=None, kv_sections=1)
    a8, a16, a24 = (save(pool, 0, n) for n in (8, 16, 24))
    assert whole_ids(pool) == {a24.id}
    with lease_of(pool, tokens(0, 24), 24) as lease:
        kept = lease.data.obj
        assert kept is not None and bytes(kept) == conversation_state(24)
        assert lease.data.nbytes == len(kept)  # the state itself, not a copy in a buffer
    with lease_of(pool, tokens(0, 24), 24) as lease:
        assert lease.data.obj is kept
    s = pool.stats()
    assert s.tier("ram").page_bytes == 6 * PAGE
    assert s.tier("ram").bytes == sum(rest(0, n) + 4 * n for n in (8, 16, 24)) + 6 * PAGE \
        + extra(0, 24)
    for n in (8, 16):
        with lease_of(pool, tokens(0, n), n) as lease:
            assert lease.data.obj is not kept
            assert bytes(lease.data) == conversation_state(n)
    a32 = save(pool, 0, 32)  # the newer state takes the pages over; 24 keeps its rest only
    assert whole_ids(pool) == {a32.id}
    with lease_of(pool, tokens(0, 24), 24) as lease:
        assert bytes(lease.data) == conversation_state(24)
    assert pool.stats().tier("ram").bytes == sum(rest(0, n) + 4 * n for n in (8, 16, 24, 32)) \
        + 8 * PAGE + extra(0, 32)
    # An older state saved after (a hybrid's replay points, converted at a hand-off) is
    # not kept whole, and takes nothing over: copying it whole would buy nothing.
    a20 = save(pool, 0, 20)
    s = pool.stats()
    assert (s.whole_states, s.whole_bytes) == (1, len(conversation_state(32)))
    assert [d.get("whole", False) for d in pool.describe() if d["id"] in (a20.id, a32.id)] \
        == [d["id"] == a32.id for d in pool.describe() if d["id"] in (a20.id, a32.id)]
    assert whole_ids(pool) == {a32.id}
    with lease_of(pool, tokens(0, 20), 20) as lease:
        assert bytes(lease.data) == conversation_state(20)
    pool.sanity_check()


def test_pages_outlive_the_state_they_were_views_of(make_pool: PoolFactory) -> None:
    # The state kept whole goes (removed, or evicted) while older checkpoints still name
    # its pages: they are copied out of it first, and those checkpoints assemble as saved.
    pool = make_pool(ram=1 << 20, disk=None, kv_sections=1)
    save(pool, 0, 16)
    a32 = save(pool, 0, 32)
    assert pool.remove(a32.id)
    pool.sanity_check()
    assert pool.stats().tier("ram").bytes == rest(0, 16) + 64 + 4 * PAGE
    assert state_of(pool, 0, 16) == conversation_state(16)
    assert state_of(pool, 0, 32) is None
    # evicted: the budget holds A16 and A32 whole, not a third state
    budget = (rest(0, 16) + 64) + (rest(0, 32) + 128) + 8 * PAGE + extra(0, 32)
    pool = make_pool(ram=budget, disk=None, kv_sections=1)
    a16 = save(pool, 0, 16)
    a32 = save(pool, 0, 32, role=Role.PERIODIC)  # evicted before A16, a replay
    save(pool, 1, 4)
    held = {d["id"] for d in pool.describe()}
    assert a32.id not in held and a16.id in held
    assert state_of(pool, 0, 16) == conversation_state(16)


def test_a_conversation_that_shares_a_prefix_takes_its_pages_over(
    make_pool: PoolFactory,
) -> None:
    # B began with A's first 16 tokens. Saved after A, B is kept whole and hosts every
    # page it names, the shared ones too; A keeps its rest, and its own pages are copied
    # out of its state, which goes. Both give back exactly what was saved.
    pool = make_pool(ram=1 << 20, disk=None, kv_sections=1)
    save(pool, 0, 32)
    b_toks = tokens(0, 16) + tokens(1, 32)[16:]
    b_state = conversation_state(32, conv=1, shared=16, base=0)
    b = put(pool, b_toks, b_state)
    assert whole_ids(pool) == {b.id}
    s = pool.stats()
    assert s.tier("ram").pages == 4 + 4 + 4  # the shared four held once
    assert s.tier("ram").bytes == (rest(0, 32) + 128) + (len(_rest(b_toks, b_state)) + 128) \
        + 12 * PAGE + len(b_state) - 8 * PAGE
    with lease_of(pool, b_toks, 32) as lease:
        assert bytes(lease.data) == b_state
    with lease_of(pool, tokens(0, 32), 32) as lease:
        assert bytes(lease.data) == conversation_state(32)
    pool.sanity_check()


def test_a_state_under_lease_keeps_its_pages_and_the_next_is_stored_as_pages(
    make_pool: PoolFactory,
) -> None:
    # While A32's whole state is read by a lease, A40 (which names A32's pages) cannot take
    # them over: it is stored as pages, copied. The next state after the lease is kept whole.
    pool = make_pool(ram=1 << 20, disk=None, kv_sections=1)
    a32 = save(pool, 0, 32)
    lease = lease_of(pool, tokens(0, 32), 32)
    kept = lease.data.obj
    save(pool, 0, 40)
    assert whole_ids(pool) == {a32.id}
    assert lease.data.obj is kept and bytes(lease.data) == conversation_state(32)
    lease.close()
    with lease_of(pool, tokens(0, 40), 40) as l40:
        assert l40.data.obj is not kept  # assembled
        assert bytes(l40.data) == conversation_state(40)
    with lease_of(pool, tokens(0, 32), 32) as l32:
        assert l32.data.obj is kept  # still whole: nothing newer took it over
    a48 = save(pool, 0, 48)
    assert whole_ids(pool) == {a48.id}
    for n in (32, 40, 48):
        with lease_of(pool, tokens(0, n), n) as lease:
            assert bytes(lease.data) == conversation_state(n)
    pool.sanity_check()


def _rest(toks: list[int], state: bytes) -> bytes:
    chain = PageChain(namespace_hash(FP, ""), 4, toks).hashes
    return split(state, sections=1, page_size=4, chain=chain).rest


def test_disk_hits_assemble_in_one_buffer_too(make_pool: PoolFactory, tmp_path: Path) -> None:
    writer = make_pool(ram=1 << 20, disk=1 << 20, path=tmp_path / "d", kv_sections=1)
    save(writer, 0, 32), save(writer, 1, 16)
    writer.flush()
    writer.close()
    pool = make_pool(ram=1, disk=1 << 20, path=tmp_path / "d", kv_sections=1)

    def hit(conv: int, n: int) -> object:
        toks = tokens(conv, n) + [7]
        lease = pool.lookup(toks, pool.chain(toks), max_n=n)
        assert lease is not None and lease.record.n == n and lease.tier == "disk"
        with lease:
            assert bytes(lease.data) == conversation_state(n, conv=conv)
            return lease.data.obj

    first = hit(0, 32)
    assert hit(1, 16) is first and hit(0, 32) is first


def test_partial_and_unpaged_states_are_kept_whole(make_pool: PoolFactory) -> None:
    pool = make_pool(ram=1 << 20, disk=None, kv_sections=1)
    part = pool.insert(kind=Kind.PARTIAL, owner=Owner.TARGET, lane=0, tokens=tokens(0, 16),
                       role=Role.REPLAY, data=conversation_state(16))
    assert part is not None and part.n_keys == 0
    assert pool.stats().tier("ram").pages == 0


def test_random_conversations_keep_every_invariant(make_pool: PoolFactory) -> None:
    # Growing checkpoints of a few conversations, leases held across inserts, removals,
    # a RAM budget that forces eviction and a small disk: every lookup gives the state
    # that was saved, and the invariants (every page named is held, counts equal the
    # references, budgets equal the bytes held) hold after every step.
    rnd = random.Random(2024)
    pool = make_pool(ram=14_000, disk=40_000, kv_sections=1)
    held = []
    for _ in range(300):
        conv = rnd.randrange(4)
        n = rnd.randrange(1, 11) * 4 + rnd.choice([0, 0, 1, 3])
        r = rnd.random()
        if r < 0.45:
            data: object = conversation_state(n, conv=conv)
            owned = rnd.random() < 0.5  # as the engine saves: into a buffer handed over
            if owned:
                buf = pool.state_buffer(len(data))
                memoryview(buf)[:] = data
                data = buf
            pool.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=tokens(conv, n),
                        role=rnd.choice(list(Role)), data=data, owned=owned)
            # on disk before the next step: what the writer pins meanwhile decides whether
            # RAM has room to keep a state whole, and where the next lookup finds it
            pool.flush()
        elif r < 0.9:
            toks = tokens(conv, n) + [3]
            lease = pool.lookup(toks, pool.chain(toks), max_n=n)
            if lease is not None:
                m = lease.record.n
                assert bytes(lease.data) == conversation_state(m, conv=conv)
                if rnd.random() < 0.3 and len(held) < 3:
                    held.append(lease)
                else:
                    lease.close()
        else:
            ids = [d["id"] for d in pool.describe()]
            if ids:
                pool.remove(rnd.choice(ids))
        if held and rnd.random() < 0.25:
            held.pop(0).close()
        pool.sanity_check()
        s = pool.stats()
        assert s.tier("ram").bytes <= 14_000 and s.tier("disk").bytes <= 40_000
    for lease in held:
        lease.close()
    s = pool.stats()
    assert s.tier("ram").evictions > 0 and s.tier("ram").hits > 0 and s.counts.disk_writes > 0
    assert s.tier("disk").hits > 0 and s.whole_states > 0


def test_a_state_handed_over_is_kept_as_it_is(make_pool: PoolFactory) -> None:
    # The engine asks the pool for a buffer, llama.cpp writes the state there, and the pool
    # keeps that very buffer as the state kept whole: no copy. One it does not keep (an
    # older state of a conversation) is the buffer of the next.
    pool = make_pool(ram=1 << 20, disk=None, kv_sections=1)

    def handed(conv: int, n: int) -> tuple[object, str]:
        state = conversation_state(n, conv=conv)
        buf = pool.state_buffer(len(state))
        memoryview(buf)[:] = state
        rec = pool.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None,
                          tokens=tokens(conv, n), role=Role.REPLAY, data=buf, owned=True)
        assert rec is not None
        pool.sanity_check()
        return buf, rec.id

    buf32, a32 = handed(0, 32)
    assert whole_ids(pool) == {a32}
    with lease_of(pool, tokens(0, 32), 32) as lease:
        assert lease.data.obj is buf32 and bytes(lease.data) == conversation_state(32)
    buf16, a16 = handed(0, 16)  # older: RAM keeps its rest, the buffer comes back
    assert whole_ids(pool) == {a32}
    assert pool.state_buffer(8) is buf16
    buf40, a40 = handed(0, 40)  # newer: takes A32's pages over, A32's buffer comes back
    assert whole_ids(pool) == {a40}
    assert pool.state_buffer(8) is buf32
    for n in (16, 32, 40):
        assert state_of(pool, 0, n) == conversation_state(n)
    with pytest.raises(TypeError):
        pool.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=tokens(1, 8),
                    role=Role.REPLAY, data=conversation_state(8, conv=1), owned=True)
    del a16
