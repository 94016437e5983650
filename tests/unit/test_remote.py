"""The shared tier against a real Valkey server (no model): pools of two "proxies"
(their own RAM and disk) share one store. Tiny sizes: page size 4, chunks of 4 KiB."""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

import pytest

from statecache.config import CacheConfig, RemoteConfig
from statecache.costs import Costs
from statecache.formats.remotefmt import chunk_key, header_key, index_key
from statecache.kvpages import REST_HEAD_BYTES
from statecache.pool import CheckpointPool, Offer
from tests.store import Store
from tests.unit.conftest import FP, Clock, put

T = list(range(1, 41))  # 10 pages of 4
# 10,240 random bytes (they do not compress): with the rest's header, three chunks of 4 KiB
STATE = random.Random(7).randbytes(10_240)


def _sync(pool: CheckpointPool) -> None:
    assert pool.remote is not None and pool.remote.flush(10)


def _remote_offers(pool: CheckpointPool, tokens: list[int], tenant: str = "") -> list[Offer]:
    chain = pool.chain(tokens, tenant)
    return [o for o in pool.full_offers(tokens, chain, max_n=len(tokens), tenant=tenant)
            if o.tier == "remote"]


def _take(pool: CheckpointPool, offer: Offer, tokens: list[int], tenant: str = ""):  # type: ignore[no-untyped-def]
    return pool.take(offer, tokens, pool.chain(tokens, tenant), tenant=tenant)


def test_a_state_written_by_one_pool_is_restored_by_another(proxy) -> None:  # type: ignore[no-untyped-def]
    a, b = proxy("a"), proxy("b")
    put(a, T[:13], STATE)
    _sync(a)
    assert a.stats().tier("remote").store.writes == 1
    # B holds nothing locally; the store's index offers n=13 (deepest), unread so far.
    offers = _remote_offers(b, T)
    assert [(o.n, o.nbytes) for o in offers] == [(13, len(STATE))]
    assert b.stats().tier("remote").store.hits == 0
    lease = _take(b, offers[0], T)
    assert lease is not None and lease.tier == "remote" and lease.record.n == 13
    assert bytes(lease.data) == STATE
    lease.close()
    # It joined B's RAM: the next lookup is local, and B never sends it back.
    s = b.stats()
    assert (s.tier("remote").hits, s.tier("remote").store.hits, s.tier("ram").entries) == (1, 1, 1)
    _sync(b)
    assert b.stats().tier("remote").store.writes == 0
    assert [o.tier for o in b.full_offers(T, b.chain(T), max_n=40)] == ["ram"]
    # A second writer of the same state stores nothing twice.
    c = proxy("c")
    put(c, T[:13], STATE)
    _sync(c)
    assert c.stats().tier("remote").store.write_dupes == 1


def test_a_prompt_that_diverges_gets_only_the_prefix_it_shares(proxy) -> None:  # type: ignore[no-untyped-def]
    a, b = proxy("a"), proxy("b")
    put(a, T[:8], STATE)
    put(a, T[:13], STATE[::-1])
    _sync(a)
    other = T[:10] + [99] * 10  # leaves the stored 13 at token 10
    offers = _remote_offers(b, other)
    assert [o.n for o in offers] == [8]
    lease = _take(b, offers[0], other)
    assert lease is not None and bytes(lease.data) == STATE
    lease.close()
    # Same page hashes, another token inside the last page: the index value's hash of the
    # tokens past the last page tells it apart, so n=13 is not even offered (no fetch)
    twisted = T[:12] + [77] + T[13:]
    c = proxy("c")
    offers = _remote_offers(c, twisted)
    assert [o.n for o in offers] == [8]
    lease = _take(c, offers[0], twisted)
    assert lease is not None and bytes(lease.data) == STATE
    lease.close()
    assert c.stats().tier("remote").store.refusals == {}


def test_tenants_never_share_entries(proxy) -> None:  # type: ignore[no-untyped-def]
    alice, bob = proxy("a", tenant="alice"), proxy("b", tenant="bob")
    put(alice, T[:13], STATE)
    _sync(alice)
    assert _remote_offers(bob, T) == []  # another namespace, other page hashes
    assert _remote_offers(bob, T, tenant="alice") != []  # the same prompt as alice's
    # Even a hit pointed at alice's entry directly is refused for bob.
    hit = _remote_offers(proxy("c", tenant="alice"), T)[0]
    assert _take(bob, hit, T, tenant="bob") is None
    assert bob.stats().tier("remote").store.refusals["tenant"] == 1


def test_foreign_key_corrupt_chunk_and_other_model_are_misses(proxy, store: Store) -> None:  # type: ignore[no-untyped-def]
    a = proxy("a")
    put(a, T[:13], STATE)
    _sync(a)
    # Signed with another key: in another key's space, never even looked at.
    stranger = proxy("s", key="other.key")
    assert _remote_offers(stranger, T) == []
    assert stranger.stats().tier("remote").store.rejected == 0
    # Another model never even finds it (its namespace differs).
    assert _remote_offers(proxy("m", fingerprint="other-model:1"), T) == []
    # One flipped byte in a chunk: a miss and a metric; the index forgets it.
    b = proxy("b")
    [offer] = _remote_offers(b, T)
    assert offer.hit is not None
    key = chunk_key(b.remote.space, offer.hit.entry_id, offer.hit.value.nonce, 1)
    r = store.client()
    raw = bytearray(r.get(key) or b"")
    raw[100] ^= 1
    r.set(key, bytes(raw))
    assert _take(b, offer, T) is None
    assert b.stats().tier("remote").store.refusals["corrupt"] == 1
    _sync(b)
    assert _remote_offers(b, T) == []
    # A truncated header is refused as well (never a crash).
    r.set(header_key(b.remote.space, offer.hit.entry_id), b"SCRM\x01")
    assert _take(proxy("c"), offer, T) is None


def test_a_reply_of_the_wrong_shape_is_a_miss(proxy, store: Store) -> None:  # type: ignore[no-untyped-def]
    a = proxy("a")
    chain = a.chain(T)
    r = store.client()
    ikey = index_key(a.remote.space, 1, chain.hashes[2])
    r.hset(ikey, "not-an-id", b"x")
    r.hset(ikey, "0" * 32, b"y" * 36)
    r.set(index_key(a.remote.space, 1, chain.hashes[1]), b"a string, not a hash")
    assert _remote_offers(a, T) == []
    assert a.stats().tier("remote").store.rejected >= 2


def test_store_down_degrades_then_reuse_resumes(proxy, store: Store, caplog) -> None:  # type: ignore[no-untyped-def]
    a, b = proxy("a"), proxy("b")
    store.stop()
    t0 = time.perf_counter()
    put(a, T[:13], STATE)  # never raises, never waits for the store
    assert _remote_offers(b, T) == []
    assert time.perf_counter() - t0 < 3
    assert a.stats().tier("remote").store.up == 0 or b.stats().tier("remote").store.up == 0
    warnings = [r for r in caplog.records if "serving from RAM and disk" in r.getMessage()]
    assert len(warnings) <= 2  # one per pool, not one per call
    for _ in range(5):
        assert _remote_offers(b, T) == []
    assert len([r for r in caplog.records if "serving from RAM" in r.getMessage()]) <= 2
    store.start()  # an empty store on the same address
    time.sleep(0.3)
    _sync(a)  # A's queued write goes out once the store is back
    deadline = time.monotonic() + 30
    while not _remote_offers(b, T) and time.monotonic() < deadline:
        time.sleep(0.1)
    [offer] = _remote_offers(b, T)
    lease = _take(b, offer, T)
    assert lease is not None and bytes(lease.data) == STATE
    lease.close()
    assert a.stats().tier("remote").store.up == 1 and b.stats().tier("remote").store.errors >= 1


def test_writes_waiting_for_a_slow_store_drop_the_oldest(proxy, store: Store) -> None:  # type: ignore[no-untyped-def]
    store.stop()
    a = proxy("a", queue_bytes=2 * (len(STATE) + REST_HEAD_BYTES), retry_s=60)
    a.remote.ping()  # type: ignore[union-attr]  # learn that it is down
    for i in range(4):
        put(a, [200 + i] + T[:12], STATE)
    s = a.stats()
    assert s.tier("remote").store.write_drops == 2
    assert s.tier("remote").store.queue_bytes <= 2 * (len(STATE) + REST_HEAD_BYTES)


def test_writes_wait_while_the_engine_prefills(proxy, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    # as the disk writer's: a write's MAC and compression would take a core from the
    # prefill that saved the state, so the store's queue waits while the engine
    # prefills (HOLD_MAX_S at most), unless flush asks or the queue is half full
    import statecache.tiers.background as background

    def written(pool) -> int:  # type: ignore[no-untyped-def]
        return int(pool.stats().tier("remote").store.writes)

    def wait_written(pool, n: int) -> None:  # type: ignore[no-untyped-def]
        deadline = time.monotonic() + 20
        while written(pool) < n:
            assert time.monotonic() < deadline, (written(pool), n)
            time.sleep(0.05)

    a = proxy("a", queue_bytes=3 * (len(STATE) + REST_HEAD_BYTES))
    a.hold_writes(True)
    put(a, [100] + T[:12], STATE)
    time.sleep(0.5)
    assert written(a) == 0 and a.remote.pending() == 1  # held: 120 s is far off
    a.hold_writes(False)
    wait_written(a, 1)

    a.hold_writes(True)
    put(a, [101] + T[:12], STATE)
    assert a.remote.flush(10) and written(a) == 2  # flush sends it now

    put(a, [102] + T[:12], STATE)  # a third of the bound: waits
    time.sleep(0.5)
    assert written(a) == 2
    put(a, [103] + T[:12], STATE)  # two thirds: more than half, so the oldest goes out
    wait_written(a, 3)
    time.sleep(0.5)
    assert written(a) == 3 and a.remote.pending() == 1  # a third again: held
    assert a.stats().tier("remote").store.write_drops == 0
    a.hold_writes(False)
    wait_written(a, 4)

    monkeypatch.setattr(background, "HOLD_MAX_S", 0.5)  # a hold ends by itself
    a.hold_writes(False)
    a.hold_writes(True)
    put(a, [104] + T[:12], STATE)
    wait_written(a, 5)
    a.hold_writes(False)


def test_costs_follow_measurements() -> None:
    c = Costs()
    # 4 GB from the store at 1 GB/s against 2,000 tokens at 10,000 tokens/s: prefill.
    c.note_read("remote", 1 << 30, 1.0)
    c.note_prefill(10_000, 1.0)
    fetch = c.estimate("remote", 2_000, 4 << 30, 2_100)
    cold = c.estimate("cold", 0, 0, 2_100)
    assert cold.total_s < fetch.total_s
    # 300 MB against 30,000 tokens at 300 tokens/s (a hybrid on a laptop): fetch.
    c2 = Costs()
    c2.note_read("remote", 100 << 20, 1.0)
    c2.note_prefill(300, 1.0)
    assert c2.estimate("remote", 30_000, 300 << 20, 30_100).total_s < \
        c2.estimate("cold", 0, 0, 30_100).total_s
    # RAM fetches nothing: only the tokens left count.
    assert c2.estimate("ram", 10, 1 << 30, 20).fetch_s == 0.0


def test_inspect_and_purge_the_remote_tier(proxy, store: Store, tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    from statecache.cli import main

    alice, bob = proxy("a", tenant="alice"), proxy("b", tenant="bob")
    put(alice, T[:13], STATE)
    put(bob, T[:9], STATE[:5000])
    _sync(alice)
    _sync(bob)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'[cache]\npage_size = 4\ndisk_path = "{tmp_path / "none"}"\n')
    args = ["--config", str(cfg), "--remote", store.url, "--url", "http://127.0.0.1:9"]
    assert main(["inspect", "--json", *args]) == 0
    import json

    rows = json.loads(capsys.readouterr().out)["checkpoints"]
    assert sorted((r["tenant"], r["n"], r["tiers"]) for r in rows) == [
        ("alice", 13, ["remote"]), ("bob", 9, ["remote"])]
    # purge by tenant: a dry run first, then bob's entry goes, alice's stays.
    purge = ["purge", "--config", str(cfg), "--remote", store.url, "--tenant", "bob"]
    assert main(purge) == 0 and "would remove 1" in capsys.readouterr().out
    assert _remote_offers(proxy("c", tenant="bob"), T) != []
    assert main([*purge, "--yes"]) == 0
    assert _remote_offers(proxy("d", tenant="bob"), T) == []
    assert _remote_offers(proxy("e", tenant="alice"), T) != []
    capsys.readouterr()
    # by age (the test clock writes entries dated 1970): none is 100 years old, one is a day
    older = ["purge", "--config", str(cfg), "--remote", store.url, "--yes", "--older-than"]
    assert main([*older, "36500d"]) == 0 and "removed 0" in capsys.readouterr().out
    assert main([*older, "1d"]) == 0 and "removed 1" in capsys.readouterr().out
    assert store.client().dbsize() == 0  # header, chunks and index: nothing left behind


def test_a_cluster_serves_as_one_store(tmp_path: Path) -> None:
    # Entries keep their keys on one node (a hash tag); the index spreads over all three,
    # and the lookup's pipeline crosses them.
    from tests.store import Cluster

    cluster = Cluster(tmp_path / "cluster")
    pools: list[CheckpointPool] = []
    try:
        cluster.start()
        for name in ("a", "b"):
            rc = RemoteConfig(url=cluster.url, cluster=True, chunk_size=4096, timeout=2.0)
            cfg = CacheConfig(page_size=4, ram_budget=1 << 20, disk_path=str(tmp_path / name),
                              secret_path=str(tmp_path / "keys" / "k"), remote=rc)
            pools.append(CheckpointPool(cfg, FP, clock=Clock()))
        a, b = pools
        for i in range(6):  # states of six conversations: their ids hash to all nodes
            put(a, [300 + i] + T[:12], STATE)
        _sync(a)
        assert a.stats().tier("remote").store.writes == 6
        per_node = [n.client().dbsize() for n in cluster.nodes]
        assert all(k > 0 for k in per_node), per_node
        for i in range(6):
            prompt = [300 + i] + T[:20]
            [offer] = _remote_offers(b, prompt)
            lease = _take(b, offer, prompt)
            assert lease is not None and bytes(lease.data) == STATE
            lease.close()
        # inspect/purge see every node's entries
        from statecache.tiers.remoteadmin import RemoteAdmin

        admin = RemoteAdmin(cluster.url, cluster=True, page_size=4)
        rows, bad = admin.rows()
        assert (len(rows), bad) == (6, [])
        for r in rows:
            admin.delete(r)
        assert sum(n.client().dbsize() for n in cluster.nodes) == 0
    finally:
        for p in pools:
            p.close()
        cluster.stop()


def test_the_remote_table_of_the_config(tmp_path: Path) -> None:
    from statecache.config import ConfigError, load_config

    f = tmp_path / "c.toml"
    f.write_text('[cache]\npage_size = 16\n[cache.remote]\nurl = "valkey://h:1/0"\n'
                 'chunk_size = "1MiB"\nsecret_path = "~/k"\n')
    rc = load_config(f).cache.remote
    assert (rc.url, rc.chunk_size, rc.ttl) == ("valkey://h:1/0", 1 << 20, 7 * 86400.0)
    assert rc.secret_path == str(Path("~/k").expanduser())
    assert "h:1" not in repr(rc)  # a URL may carry a password
    # flags override one key of the table, the file keeps the others
    rc = load_config(f, {"cache.remote.ttl": 60}).cache.remote
    assert (rc.url, rc.ttl) == ("valkey://h:1/0", 60.0)
    for bad, says in (('url = "http://h"', "cache.remote.url: expected one of"),
                      ("colour = 1", "unknown key cache.remote.colour; valid keys: url,"),
                      ("chunk_size = 12", "cache.remote.chunk_size: must be >= 4096"),
                      ('timeout = "1"', "cache.remote.timeout: expected float")):
        f.write_text(f"[cache.remote]\n{bad}\n")
        with pytest.raises(ConfigError, match=re.escape(says)):
            load_config(f)


def test_a_store_that_never_answers_leaves_the_pool_local(tmp_path: Path) -> None:
    from tests.store import free_port

    for cluster in (False, True):  # a cluster client fails otherwise, as it is made
        rc = RemoteConfig(url=f"redis://127.0.0.1:{free_port()}/0", cluster=cluster,
                          timeout=0.5, retry_s=60)
        cfg = CacheConfig(page_size=4, ram_budget=1 << 20, disk_enabled=False,
                          secret_path=str(tmp_path / "keys" / "k"), remote=rc)
        pool = CheckpointPool(cfg, FP, clock=Clock())
        assert pool.remote_status.startswith("unreachable")
        put(pool, T[:13], STATE)
        assert [o.tier for o in pool.full_offers(T, pool.chain(T), max_n=40)] == ["ram"]
        store = pool.stats().tier("remote").store
        assert (store.up, store.errors) == (0, 1)  # tried once, then waits
        pool.close()


def test_a_full_store_degrades_to_local_tiers(tmp_path: Path, caplog) -> None:  # type: ignore[no-untyped-def]
    full = Store(tmp_path / "full", "--maxmemory", "2mb", "--maxmemory-policy", "noeviction")
    full.start()
    try:
        rc = RemoteConfig(url=full.url, chunk_size=4096, timeout=1.0, retry_s=60)
        cfg = CacheConfig(page_size=4, ram_budget=1 << 22, disk_enabled=False,
                          secret_path=str(tmp_path / "keys" / "k"), remote=rc)
        pool = CheckpointPool(cfg, FP, clock=Clock())
        for i in range(400):  # 4 MB of states into a 2 MB store
            put(pool, [500 + i] + T[:12], STATE)
        # until the store refuses a write (a write that fails goes back in the queue): the
        # writer's pace is the machine's, so no time decides it; 120 s guard a hang
        deadline = time.monotonic() + 120
        while pool.stats().tier("remote").store.up and pool.stats().tier("remote").store.queue \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        store = pool.stats().tier("remote").store
        assert store.up == 0 and store.errors >= 1 and store.writes < 400
        oom = [r for r in caplog.records if "serving from RAM and disk" in r.getMessage()]
        assert len(oom) == 1 and "maxmemory" in oom[0].getMessage()
        # the states are still served from RAM
        prompt = [500] + T[:20]
        assert [o.tier for o in pool.full_offers(prompt, pool.chain(prompt), max_n=20)] == ["ram"]
        pool.sanity_check()
        pool.close()
    finally:
        full.stop()
