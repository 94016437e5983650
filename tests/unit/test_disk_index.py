"""What the pool keeps in memory of a checkpoint held on disk alone: its record's head,
not its tokens, page hashes or page keys (issue 28, item 6). Lookups still find it (by
the trie and its id), read the whole record back from its file and compare its tokens
with the request's; a record file changed after it was indexed is a miss, never a wrong
state. Real files, page size 4 (tests/unit/conftest.py)."""

from __future__ import annotations

import gc
import tracemalloc
from pathlib import Path

from statecache.formats.diskfmt import read_meta, write_checkpoint
from statecache.pages import PageChain, namespace_hash
from statecache.pool.index import Index
from statecache.records import CheckpointRecord, RecordHead, Role
from tests.unit.conftest import PoolFactory
from tests.unit.kvstate import conversation_state
from tests.unit.test_disk_pages import record_file, saved
from tests.unit.test_index import hits, rec
from tests.unit.test_pool_pages import PAGE, rest, save, state_of, tokens

NS = namespace_hash("m", "")


def heads(pool) -> dict[str, RecordHead]:  # type: ignore[no-untyped-def]
    return {i: e.record for i, e in pool._e.entries.items() if isinstance(e.record, RecordHead)}


def test_a_pool_opened_on_many_checkpoints_holds_little_for_each(
    make_pool: PoolFactory,
) -> None:
    # One conversation, a checkpoint every 100 tokens up to 2,000 (page size 4): 20
    # records naming 5,250 pages in all, 500 of them distinct.
    ns = list(range(100, 2001, 100))
    first = make_pool(disk=1 << 24, kv_sections=1)
    for n in ns:
        save(first, 0, n)
    first.close()
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        pool = make_pool(disk=1 << 24, kv_sections=1)
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(heads(pool)) == len(pool.describe()) == 20
    named = sum(n // 4 for n in ns)
    # Per page a record names: its packed page key (16 bytes); per distinct page: a node
    # of the trie and the disk's count; per record: its head and bookkeeping. Whole
    # records held besides their tokens (4 bytes a token, 16 a page) a tuple of page
    # hashes and one of page keys (about 57 bytes a page each): some 1.1 MB here.
    assert held < 24 * named + 400 * 500 + 2_000 * len(ns), held
    assert state_of(pool, 0, 2000) == conversation_state(2000)
    pool.sanity_check()


def test_a_state_evicted_from_ram_is_found_on_disk_by_its_head(
    make_pool: PoolFactory,
) -> None:
    # RAM holds the 40's state and nothing more (its pages include the others')
    pool = make_pool(ram=rest(0, 40) + 4 * 40 + 10 * PAGE, disk=1 << 20, kv_sections=1)
    recs = {n: save(pool, 0, n) for n in (8, 24)}
    assert pool.flush() == 2
    recs[40] = save(pool, 0, 40)  # the 8 and the 24 leave RAM, on disk already
    assert pool.flush() == 1
    # the 8 and the 24 are on disk alone, as heads
    on_disk = heads(pool)
    assert set(on_disk) == {recs[8].id, recs[24].id}
    head = on_disk[recs[24].id]
    assert (head.n, head.n_pages, head.n_keys) == (24, 6, 6)
    assert not hasattr(head, "tokens") and not hasattr(head, "page_hashes")
    # the UI's page hashes come from the index, for heads and whole records alike
    paths = pool.page_hashes()
    assert {i: paths[i] for i in paths} == {r.id: r.page_hashes for r in recs.values()}
    # the 24 is read back whole from its file, its tokens the request's, its state exact
    toks = tokens(0, 24) + [3]
    with pool.lookup(toks, pool.chain(toks)) as lease:  # type: ignore[union-attr]
        assert lease.tier == "disk" and isinstance(lease.record, CheckpointRecord)
        assert lease.record.tokens == recs[24].tokens
        assert lease.record.page_keys == recs[24].page_keys
        assert bytes(lease.data) == conversation_state(24)
    # promoted into RAM (whole again), the 40 making room (a head now)
    assert set(heads(pool)) == {recs[8].id, recs[40].id}
    pool.sanity_check()
    for n in (8, 24, 40):
        assert state_of(pool, 0, n) == conversation_state(n)
        pool.sanity_check()
    assert pool.stats().tier("disk").hits >= 3


def test_a_refreshed_head_keeps_its_role_when_it_is_read_back(make_pool: PoolFactory) -> None:
    recs = saved(make_pool, (8, 24))
    pool = make_pool(kv_sections=1)
    again = save(pool, 0, 24, role=Role.BRANCH)  # the same state: a refresh of the head
    assert isinstance(again, RecordHead) and again.role is Role.BRANCH
    toks = tokens(0, 24) + [3]
    with pool.lookup(toks, pool.chain(toks)) as lease:  # type: ignore[union-attr]
        assert lease.record.id == recs[1].id and lease.record.role is Role.BRANCH
        assert [d["role"] for d in pool.describe() if d["id"] == recs[1].id] == ["branch"]
    pool.sanity_check()


def test_a_record_file_replaced_after_indexing_is_a_miss(
    make_pool: PoolFactory, tmp_path: Path
) -> None:
    recs = saved(make_pool, (8, 24, 40))
    pool = make_pool(kv_sections=1)  # indexed: heads only
    assert len(heads(pool)) == 3
    # The 40's file now holds the 24's record, authenticated under the same key: a valid
    # file, of another checkpoint. Its state must never be served as the 40's.
    record_file(tmp_path, recs[2].id).write_bytes(record_file(tmp_path, recs[1].id).read_bytes())
    toks = tokens(0, 40) + [3]
    with pool.lookup(toks, pool.chain(toks)) as lease:  # type: ignore[union-attr]
        assert lease.record.n == 24 and bytes(lease.data) == conversation_state(24)
    assert pool.stats().quarantined == 1
    assert {d["id"] for d in pool.describe()} == {recs[0].id, recs[1].id}
    pool.sanity_check()


def test_a_record_file_rewritten_with_other_tokens_under_its_name_is_a_miss(
    make_pool: PoolFactory, tmp_path: Path
) -> None:
    recs = saved(make_pool, (8, 24))
    pool = make_pool(kv_sections=1)
    # Whoever holds the key writes, under the 24's name, a record of other tokens (its
    # id theirs): its metadata is authentic, its content is not the 24's.
    other = save(pool, 1, 24)
    assert isinstance(other, CheckpointRecord)
    key = (tmp_path / "keys" / "secret.key").read_bytes()
    path = record_file(tmp_path, recs[1].id)
    forged = tmp_path / "forged"
    forged.mkdir()
    write_checkpoint(forged, other, b"\0" * other.rest_nbytes, key)
    path.write_bytes((forged / f"{other.id}.ckpt").read_bytes())
    assert read_meta(path, key).meta["tokens"] == other.tokens
    assert state_of(pool, 0, 24) is None  # a miss: the 8 is the deepest that is served
    toks = tokens(0, 24) + [3]
    with pool.lookup(toks, pool.chain(toks)) as lease:  # type: ignore[union-attr]
        assert lease.record.n == 8 and bytes(lease.data) == conversation_state(8)
    assert recs[1].id not in {d["id"] for d in pool.describe()}
    pool.sanity_check()


def test_a_head_matches_by_its_id() -> None:
    index = Index()
    r6, r10 = rec([1, 2, 3, 4, 5, 6]), rec([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    index.add(r6.head(), NS, r6.page_hashes)
    index.add(r10.head(), NS, r10.page_hashes)
    index.sanity_check()
    assert hits(index, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]) == [10, 6]
    assert hits(index, [1, 2, 3, 4, 5, 0, 7, 8]) == []  # token 5 differs: n=6 fails
    assert hits(index, [1, 2, 3, 4, 5, 6, 7, 8, 9, 0]) == [6]  # the tail after the page
    # a head whose path is A's but whose id is B's: the trie finds it, its id refuses it
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]
    forged = Index()
    forged.add(rec(b).head(), NS, PageChain(NS, 4, a).hashes)
    assert hits(forged, a) == []
    assert index.paths()[r10.id] == r10.page_hashes
