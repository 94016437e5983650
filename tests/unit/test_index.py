from __future__ import annotations

import dataclasses

from statecache.pages import PageChain, namespace_hash
from statecache.pool.index import Index
from statecache.records import CheckpointRecord, Kind, Owner, Role, new_record

NS = namespace_hash("m", "")


def rec(tokens: list[int], kind: Kind = Kind.FULL, lane: int | None = None) -> CheckpointRecord:
    return new_record(
        kind=kind,
        owner=Owner.TARGET,
        lane=lane,
        tokens=tokens,
        fingerprint="m",
        tenant="",
        state_format=1,
        nbytes=10,
        role=Role.PERIODIC,
        created=0.0,
        page_size=4,
    )


def hits(index: Index, tokens: list[int], **kw: object) -> list[int]:
    chain = PageChain(NS, 4, tokens)
    args: dict = {"kind": Kind.FULL, "owner": Owner.TARGET, "lane": None, "max_n": len(tokens)}
    args.update(kw)
    return [r.n for r in index.candidates(chain, **args)]


def test_non_page_aligned_entry_hangs_on_its_last_whole_page() -> None:
    index = Index()
    # n=6 with page size 4: hangs on the node of page 1 (tokens 0..4); tokens 4..6 checked.
    r6 = rec([1, 2, 3, 4, 5, 6])
    index.add(r6, NS)
    index.add(rec([1, 2, 3, 4, 5, 6, 7, 8, 9, 10]), NS)
    index.sanity_check()
    assert hits(index, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]) == [10, 6]
    # The request diverges at token 5: no hit, since n=6 needs tokens[5] == 6.
    assert hits(index, [1, 2, 3, 4, 5, 0, 7, 8]) == []
    # max_n below the deeper entry leaves the shallower one.
    assert hits(index, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], max_n=9) == [6]
    assert hits(index, [1, 2, 3, 4, 5, 6], max_n=5) == []
    # An entry shorter than one page hangs on the root.
    index.add(rec([1, 2]), NS)
    assert hits(index, [1, 2, 3]) == [2]


def test_hash_collision_is_not_a_hit() -> None:
    # Simulate a collision: a record whose page hashes are those of request A but
    # whose tokens are B's. The trie walk finds it; the token comparison must reject it.
    a = [1, 2, 3, 4, 5, 6, 7, 8]
    b = [1, 2, 3, 4, 9, 9, 9, 9]
    forged = dataclasses.replace(rec(b), page_hashes=PageChain(NS, 4, a).hashes)
    index = Index()
    index.add(forged, NS)
    assert hits(index, a) == []
    assert hits(index, b) == []  # b's own hashes lead elsewhere


def test_filters_kind_owner_lane() -> None:
    index = Index()
    toks = [1, 2, 3, 4, 5]
    index.add(rec(toks, Kind.PARTIAL, lane=0), NS)
    index.add(rec(toks[:4], Kind.PARTIAL, lane=1), NS)
    index.add(rec(toks[:3]), NS)
    assert hits(index, toks, kind=Kind.PARTIAL, lane=0) == [5]
    assert hits(index, toks, kind=Kind.PARTIAL, lane=1) == [4]
    assert hits(index, toks, kind=Kind.PARTIAL, lane=2) == []
    assert hits(index, toks) == [3]
    assert hits(index, toks, owner=Owner.DRAFT) == []


def test_remove_prunes_empty_nodes() -> None:
    index = Index()
    deep = rec(list(range(1, 14)))
    index.add(deep, NS)
    assert index.remove(deep.id) is deep
    assert index.remove(deep.id) is None
    index.sanity_check()
    assert len(index) == 0 and not index._roots


def test_other_namespace_is_invisible() -> None:
    index = Index()
    index.add(rec([1, 2, 3, 4, 5]), NS)
    chain = PageChain(namespace_hash("m", "tenant-b"), 4, [1, 2, 3, 4, 5])
    found = index.candidates(chain, kind=Kind.FULL, owner=Owner.TARGET, lane=None, max_n=5)
    assert list(found) == []
