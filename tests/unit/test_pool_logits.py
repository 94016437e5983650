"""The logits of a prompt's last row, kept with the checkpoint saved there: RAM, disk (in
this process and the next) and the shared tier (a real Valkey) give them back bitwise
with the state; a checkpoint saved without them gives none; logits edited on disk are
a miss, never other logits."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from statecache.records import Kind, Owner, Role
from tests.unit.conftest import PoolFactory
from tests.unit.kvstate import conversation_state
from tests.unit.test_pool_pages import tokens
from tests.unit.test_remote import _remote_offers, _sync, _take

VOCAB = 300


def logits(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(VOCAB).astype(np.float32)


def save(pool, conv: int, n: int, kept: np.ndarray | None, kind: Kind = Kind.FULL):  # type: ignore[no-untyped-def]
    rec = pool.insert(kind=kind, owner=Owner.TARGET, lane=0 if kind is Kind.PARTIAL else None,
                      tokens=tokens(conv, n), role=Role.REPLAY,
                      data=conversation_state(n, conv=conv), logits=kept)
    assert rec is not None
    pool.sanity_check()
    return rec


def hit(pool, conv: int, n: int, kind: Kind = Kind.FULL):  # type: ignore[no-untyped-def]
    """(tier, state, logits) of the checkpoint after exactly ``n`` tokens."""
    toks = tokens(conv, n)  # the prompt ends there
    lease = pool.lookup(toks, pool.chain(toks), kind=kind, max_n=n,
                        lane=0 if kind is Kind.PARTIAL else None)
    assert lease is not None and lease.record.n == n
    with lease:
        return lease.tier, bytes(lease.data), lease.logits


def test_ram_and_disk_give_the_logits_back(make_pool: PoolFactory, tmp_path: Path) -> None:
    pool = make_pool(ram=1 << 20, disk=1 << 20, path=tmp_path / "d", kv_sections=1)
    save(pool, 0, 32, logits(1))
    save(pool, 1, 16, None)
    save(pool, 2, 12, logits(2), kind=Kind.PARTIAL)
    for conv, n, kind, want in ((0, 32, Kind.FULL, logits(1)), (1, 16, Kind.FULL, None),
                                (2, 12, Kind.PARTIAL, logits(2))):
        tier, state, got = hit(pool, conv, n, kind)
        assert tier == "ram" and state == conversation_state(n, conv=conv)
        assert (got is None) if want is None else got.tobytes() == want.tobytes()
    pool.flush()
    pool.close()
    again = make_pool(ram=1, disk=1 << 20, path=tmp_path / "d", kv_sections=1)
    tier, state, got = hit(again, 0, 32)
    assert tier == "disk" and state == conversation_state(32)
    assert got is not None and got.tobytes() == logits(1).tobytes()
    assert hit(again, 1, 16)[2] is None


def test_logits_edited_on_disk_are_a_miss(make_pool: PoolFactory, tmp_path: Path) -> None:
    pool = make_pool(ram=1 << 20, disk=1 << 20, path=tmp_path / "d", kv_sections=1)
    rec = save(pool, 0, 32, logits(1))
    pool.flush()
    pool.close()
    files = [f for f in (tmp_path / "d").rglob("*") if f.is_file() and rec.id in f.name]
    assert len(files) == 1
    raw = bytearray(files[0].read_bytes())
    # the logits are the rest's last bytes, before the record's MAC; zstd may have
    # packed the rest, so a byte inside the stored rest is changed instead
    raw[-40] ^= 0x01
    files[0].write_bytes(bytes(raw))
    again = make_pool(ram=1, disk=1 << 20, path=tmp_path / "d", kv_sections=1)
    toks = tokens(0, 32)
    assert again.lookup(toks, again.chain(toks), max_n=32) is None
    assert again.stats().quarantined == 1


def test_the_shared_tier_gives_the_logits_back(proxy) -> None:  # type: ignore[no-untyped-def]
    a = proxy("a", kv_sections=1)
    save(a, 0, 40, logits(3))
    save(a, 1, 24, None)
    _sync(a)
    b = proxy("b", kv_sections=1)
    for conv, n, want in ((0, 40, logits(3)), (1, 24, None)):
        toks = tokens(conv, n)
        offers = [o for o in _remote_offers(b, toks) if o.n == n]
        assert offers
        lease = _take(b, offers[0], toks)
        assert lease is not None and lease.tier == "remote"
        with lease:
            assert bytes(lease.data) == conversation_state(n, conv=conv)
            got = lease.logits
        assert (got is None) if want is None else got.tobytes() == want.tobytes()
    # B kept what it fetched: a RAM hit now, the logits with it
    got = hit(b, 0, 40)
    assert got[0] == "ram" and got[2] is not None and got[2].tobytes() == logits(3).tobytes()
