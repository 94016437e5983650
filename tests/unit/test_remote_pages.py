"""KV pages in the shared tier (a real Valkey): a write sends the pages the store lacks,
a fetch reads the pages the local tiers lack; a page missing or edited in the store is
a miss, never a state; entries of the layout before pages are never read."""

from __future__ import annotations

from statecache.formats.remotefmt import page_name
from tests.store import Store
from tests.unit.conftest import FP
from tests.unit.kvstate import conversation_state
from tests.unit.test_pool_pages import save, tokens
from tests.unit.test_remote import _remote_offers, _sync, _take


def fetch(pool, conv: int, n: int) -> bytes | None:  # type: ignore[no-untyped-def]
    toks = tokens(conv, n) + [9]
    offers = [o for o in _remote_offers(pool, toks) if o.n == n]
    if not offers:
        return None
    lease = _take(pool, offers[0], toks)
    if lease is None:
        return None
    with lease:
        return bytes(lease.data)


def test_writes_send_new_pages_and_fetches_read_missing_ones(proxy) -> None:  # type: ignore[no-untyped-def]
    a = proxy("a", kv_sections=1)
    save(a, 0, 16)
    _sync(a)
    s = a.stats()
    assert (s.tier("remote").store.pages_written, s.tier("remote").store.pages_present) == (4, 0)
    save(a, 0, 40)  # six more pages: the first four are in the store already
    _sync(a)
    s = a.stats()
    assert (s.tier("remote").store.pages_written, s.tier("remote").store.pages_present) == (10, 4)
    # B holds the 16-token state itself: of the 40's ten pages it fetches six
    b = proxy("b", kv_sections=1)
    save(b, 0, 16)
    assert fetch(b, 0, 40) == conversation_state(40)
    s = b.stats()
    assert (s.tier("remote").store.pages_local, s.tier("remote").store.pages_fetched) == (4, 6)
    # C holds nothing: all ten come from the store
    c = proxy("c", kv_sections=1)
    assert fetch(c, 0, 40) == conversation_state(40)
    assert c.stats().tier("remote").store.pages_fetched == 10


def test_a_missing_or_edited_page_is_a_miss(proxy, store: Store) -> None:  # type: ignore[no-untyped-def]
    a = proxy("a", kv_sections=1)
    recs = {n: save(a, 0, n) for n in (8, 24, 32, 40)}  # page 3 is in all but the 8's
    _sync(a)
    r = store.client()
    name = page_name(a.remote.space, FP, recs[40].page_keys[3])
    good = r.get(name)
    assert good is not None
    raw = bytearray(good)
    raw[-40] ^= 1  # one bit of the stored page
    r.set(name, bytes(raw))
    b = proxy("b", kv_sections=1)
    assert fetch(b, 0, 40) is None
    assert b.stats().tier("remote").store.refusals["forged"] == 1
    # another page's bytes under its name: refused (a page names itself)
    r.set(name, r.get(page_name(a.remote.space, FP, recs[40].page_keys[2])))
    c = proxy("c", kv_sections=1)
    assert fetch(c, 0, 32) is None
    assert c.stats().tier("remote").store.refusals["corrupt"] == 1
    r.delete(name)  # evicted by the store, say
    d = proxy("d", kv_sections=1)
    assert fetch(d, 0, 24) is None
    assert d.stats().tier("remote").store.refusals["missing"] == 1
    # an entry that does not need that page is served
    assert fetch(proxy("e", kv_sections=1), 0, 8) == conversation_state(8)


def test_entries_of_the_layout_before_pages_are_not_seen(proxy, store: Store) -> None:  # type: ignore[no-untyped-def]
    # A proxy of the previous version wrote whole states under keys without "v2": its
    # index entries and headers are never looked at.
    a = proxy("a")
    chain = a.chain(tokens(0, 24))
    r = store.client()
    entry = "ab" * 16
    r.hset(f"statecache:i:1:{chain.hashes[-1].hex()}", entry, b"\x00" * 36)
    r.set(f"statecache:e:{{{entry}}}", b"SCRM\x01\x00" + b"\x00" * 40)
    assert _remote_offers(a, tokens(0, 24) + [9]) == []
    assert a.stats().tier("remote").store.rejected == 0


def test_a_page_queued_twice_is_held_once(proxy) -> None:  # type: ignore[no-untyped-def]
    # while the engine prefills, the writes of its checkpoints wait together: a page
    # that several of them name (the prompt's start) is one bytes object in the queue,
    # copied from the pool once, and what goes out is each state whole
    a = proxy("a", kv_sections=1)
    a.hold_writes(True)
    save(a, 0, 16)
    save(a, 0, 40)
    jobs = list(a.remote.out._jobs)
    assert [kind for kind, _ in jobs] == ["write", "write"]
    first, second = jobs[0][1].pages, jobs[1][1].pages
    assert (len(first), len(second)) == (4, 10)
    assert all(p is q for p, q in zip(first, second[:4], strict=True))
    a.hold_writes(False)
    _sync(a)
    assert a.stats().tier("remote").store.pages_written == 10
    c = proxy("c", kv_sections=1)
    assert fetch(c, 0, 40) == conversation_state(40)
    assert fetch(c, 0, 16) == conversation_state(16)
