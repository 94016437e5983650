"""Healing the shared tier (a real Valkey): a page or header of ours that fails its check
is written again by the next proxy holding the good bytes, or deleted by one that
proved it bad; another key's entries live in another key space and never block ours;
an entry refused for what it is (another prompt's) is never fetched again, and no
state byte is read for it."""

from __future__ import annotations

from statecache.formats.remotefmt import IndexValue, index_key, page_name, tail_hash
from statecache.tiers.remote import _digest
from tests.store import Store
from tests.unit.conftest import FP, put
from tests.unit.kvstate import conversation_state
from tests.unit.test_pool_pages import save
from tests.unit.test_remote import STATE, T, _remote_offers, _sync, _take
from tests.unit.test_remote_pages import fetch


def _calls(store: Store, command: str) -> int:
    stats = store.client().info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


def _spoil(store: Store, name: str, how: str, other: str) -> None:
    r = store.client()
    if how == "garbage":
        r.set(name, b"\x00garbage" * 40)
    else:  # another page's valid bytes under its name
        blob = r.get(other)
        assert isinstance(blob, bytes)
        r.set(name, blob)


def test_an_overwritten_page_heals_after_one_write(proxy, store: Store) -> None:  # type: ignore[no-untyped-def]
    for how in ("garbage", "other page"):
        store.client().flushall()
        a = proxy(f"a-{how}", kv_sections=1)
        recs = {n: save(a, 0, n) for n in (24, 40)}  # page 3 is in both
        _sync(a)
        space = a.remote.space
        name = page_name(space, FP, recs[40].page_keys[3])
        _spoil(store, name, how, page_name(space, FP, recs[40].page_keys[2]))
        # a proxy that holds the good bytes (never verified the store's) writes once
        c = proxy(f"c-{how}", kv_sections=1)
        save(c, 0, 40)
        _sync(c)
        # and a restarted proxy gets all 40 tokens, not the 8 of an older entry
        assert fetch(proxy(f"d-{how}", kv_sections=1), 0, 40) == conversation_state(40), how


def test_a_page_proved_bad_is_deleted_and_rewritten_by_its_writer(proxy, store: Store) -> None:  # type: ignore[no-untyped-def]
    a = proxy("a", kv_sections=1)
    rec = save(a, 0, 40)
    _sync(a)
    space = a.remote.space
    name = page_name(space, FP, rec.page_keys[3])
    store.client().set(name, b"\x01not a page" * 30)
    b = proxy("b", kv_sections=1)
    assert fetch(b, 0, 40) is None  # refused, and deleted: it holds what failed
    _sync(b)
    assert store.client().get(name) is None
    assert b.stats().tier("remote").store.deleted == 2  # the page and its entry's header
    # A, which wrote the page and still counts it verified, finds it gone and sends it
    save(a, 0, 44)
    _sync(a)
    assert fetch(proxy("c", kv_sections=1), 0, 44) == conversation_state(44)


def test_a_delete_leaves_a_page_rewritten_since_the_check(proxy, store: Store) -> None:  # type: ignore[no-untyped-def]
    a = proxy("a", kv_sections=1)
    rec = save(a, 0, 40)
    _sync(a)
    name = page_name(a.remote.space, FP, rec.page_keys[3])
    r = store.client()
    good, bad = r.get(name), b"\x01not a page" * 30
    # the delete a proxy sends after its check failed, arriving once another healed it
    a.remote.out.enqueue(("delete", (name, _digest(bad), len(bad))))
    _sync(a)
    assert r.get(name) == good
    r.set(name, bad)
    a.remote.out.enqueue(("delete", (name, _digest(bad), len(bad))))
    _sync(a)
    assert r.get(name) is None


def test_another_keys_entries_never_block_ours(proxy, store: Store) -> None:  # type: ignore[no-untyped-def]
    stranger = proxy("s", key="other.key")
    put(stranger, T[:13], STATE)  # the same state, signed with another key, first
    _sync(stranger)
    a = proxy("a")
    put(a, T[:13], STATE)
    _sync(a)
    assert a.stats().tier("remote").store.writes == 1  # its header did not hold our name
    b = proxy("b")
    gets = _calls(store, "getrange")
    for _ in range(3):
        [offer] = _remote_offers(b, T)
        lease = _take(b, offer, T)
        assert lease is not None and bytes(lease.data) == STATE
        lease.close()
        b.remove(lease.record.id)  # so that the next lookup asks the store again
    store_stats = b.stats().tier("remote").store
    assert store_stats.refusals == {} and store_stats.hits == 3
    assert _calls(store, "getrange") - gets == 3 * 4  # a header and three chunks a hit


def test_an_entry_refused_for_its_tokens_is_never_fetched_again(proxy, store: Store) -> None:  # type: ignore[no-untyped-def]
    a = proxy("a")
    put(a, [500] + T[:12], STATE)  # other tokens, indexed under their own last page
    _sync(a)
    b = proxy("b")
    entry = a.describe()[0]["id"]
    space = a.remote.space
    r = store.client()
    [(field, raw)] = r.hgetall(index_key(space, 1, a.chain([500] + T[:12]).hashes[2])).items()
    value = IndexValue.unpack(raw, 1 << 30)
    # the field put where this prompt looks, its tail hash made to match: the index can
    # be written by anyone who reaches the store, so the header decides
    forged = IndexValue(13, value.nbytes, value.stored, value.nonce, value.chunk_size,
                        value.chunks, tail_hash(_le(T), 13, 4))
    r.hset(index_key(space, 1, b.chain(T).hashes[2]), entry, forged.pack())
    gets = _calls(store, "getrange")
    [offer] = _remote_offers(b, T)
    assert _take(b, offer, T) is None
    assert _calls(store, "getrange") - gets == 1  # its header alone: no state byte read
    s = b.stats().tier("remote").store
    assert s.refusals == {"tokens": 1} and s.read_bytes == 0
    for _ in range(3):
        assert _remote_offers(b, T) == []  # passed over at the probe: never fetched
    assert b.stats().tier("remote").store.skipped == 3
    assert _calls(store, "getrange") - gets == 1


def _le(toks: list[int]) -> bytes:
    return b"".join(t.to_bytes(4, "little", signed=True) for t in toks)
