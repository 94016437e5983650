"""Bad disk files: every one is a miss and lands in quarantine/ (or is ignored if not ours)."""

from __future__ import annotations

import os
import pickle
import random
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from statecache.formats.diskfmt import HEADER, file_size, read_checkpoint
from statecache.kvpages import assemble
from statecache.records import Kind, Owner, Role
from tests.unit.conftest import PoolFactory, put

T = list(range(1, 21))


def saved(make_pool: PoolFactory, tmp_path: Path, n: int = 13) -> tuple[str, Path]:
    """A pool that wrote one FULL checkpoint of T[:n] and shut down."""
    pool = make_pool()
    rec = put(pool, T[:n], b"S" * 64)
    pool.close()
    return rec.id, tmp_path / "ckpt" / f"{rec.id}.ckpt"


def flip_data_bit(p: Path) -> None:
    raw = bytearray(p.read_bytes())
    raw[-40] ^= 0x01  # inside the state bytes, just before the MAC
    p.write_bytes(bytes(raw))


def huge_length(p: Path) -> None:
    raw = bytearray(p.read_bytes())
    magic, ver, flags, hl, ml, _, kid = HEADER.unpack_from(raw)
    raw[: HEADER.size] = HEADER.pack(magic, ver, flags, hl, ml, 2**39, kid)
    p.write_bytes(bytes(raw))


def patch(offset: int, new: bytes) -> Callable[[Path], None]:
    def f(p: Path) -> None:
        raw = bytearray(p.read_bytes())
        raw[offset : offset + len(new)] = new
        p.write_bytes(bytes(raw))

    return f


CORRUPTIONS: dict[str, Callable[[Path], None]] = {
    "bit flip": flip_data_bit,
    "truncated": lambda p: p.write_bytes(p.read_bytes()[:-7]),
    "zero length": lambda p: p.write_bytes(b""),
    "huge length field": huge_length,
    "wrong magic": patch(0, b"XXXX"),
    "wrong version": patch(4, struct.pack("<H", 99)),
    "pickle": lambda p: p.write_bytes(pickle.dumps({"tokens": T, "state": b"S" * 64})),
    "garbage metadata": patch(HEADER.size, b"\xc1\xc1\xc1"),
}


@pytest.mark.parametrize("how", list(CORRUPTIONS))
def test_corrupt_file_is_a_miss_and_quarantined(
    how: str, make_pool: PoolFactory, tmp_path: Path
) -> None:
    _, path = saved(make_pool, tmp_path)
    CORRUPTIONS[how](path)
    pool = make_pool()
    # Found at scan (header/metadata) or at read (digest): either way, no hit.
    assert pool.lookup(T, pool.chain(T)) is None
    assert not path.exists()
    assert len(list((tmp_path / "ckpt" / "quarantine").iterdir())) == 1
    assert pool.stats().quarantined == 1 and pool.stats().entries == 0


def test_bad_deep_file_falls_back_to_the_next_candidate(
    make_pool: PoolFactory, tmp_path: Path
) -> None:
    pool = make_pool()
    shallow = put(pool, T[:5], b"a" * 32)
    deep = put(pool, T[:13], b"b" * 32)
    pool.close()
    flip_data_bit(tmp_path / "ckpt" / f"{deep.id}.ckpt")
    pool = make_pool()
    with pool.lookup(T, pool.chain(T)) as lease:  # type: ignore[union-attr]
        assert lease.record.id == shallow.id and bytes(lease.data) == b"a" * 32
    assert pool.stats().quarantined == 1


def test_foreign_fingerprint_is_left_alone(make_pool: PoolFactory, tmp_path: Path) -> None:
    pool = make_pool(fingerprint="another-model")
    rec = put(pool, T[:13], b"S" * 64)
    pool.close()
    mine = make_pool()
    assert mine.lookup(T, mine.chain(T)) is None
    assert (tmp_path / "ckpt" / f"{rec.id}.ckpt").exists()
    assert mine.stats().quarantined == 0


def test_renamed_file_symlink_and_bad_names(make_pool: PoolFactory, tmp_path: Path) -> None:
    entry_id, path = saved(make_pool, tmp_path)
    d = path.parent
    target = tmp_path / "elsewhere.bin"
    target.write_bytes(path.read_bytes())
    other_id = "0" * 32
    os.symlink(target, d / f"{'1' * 32}.ckpt")  # a link, even to a valid file
    (d / f"{other_id}.ckpt").write_bytes(path.read_bytes())  # valid file, wrong name
    (d / "..ckpt").write_bytes(b"x")
    (d / "NOT-HEX.ckpt").write_bytes(b"x")
    (d / "notes.pkl").write_bytes(pickle.dumps([1, 2]))  # not ours: ignored
    pool = make_pool()
    assert [e["id"] for e in pool.describe()] == [entry_id]
    quarantined = sorted(p.name.rsplit(".", 1)[0] for p in (d / "quarantine").iterdir())
    assert quarantined == sorted(["..ckpt", "NOT-HEX.ckpt", f"{other_id}.ckpt", f"{'1' * 32}.ckpt"])
    assert target.exists() and (d / "notes.pkl").exists()
    assert pool.stats().quarantined == 4
    with pool.lookup(T, pool.chain(T)) as lease:  # type: ignore[union-attr]
        assert bytes(lease.data) == b"S" * 64


def test_file_format_round_trip_and_dir_mode(make_pool: PoolFactory, tmp_path: Path) -> None:
    entry_id, path = saved(make_pool, tmp_path)
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o700
    fm, rest = read_checkpoint(path, (tmp_path / "keys" / "secret.key").read_bytes())
    assert fm.id == entry_id and bytes(assemble(rest, [])) == b"S" * 64 and fm.meta["n"] == 13
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]


def test_disk_budget_evicts_least_recently_used(make_pool: PoolFactory, tmp_path: Path) -> None:
    # Each file is 442 bytes (random state bytes: stored raw); a 900-byte disk holds two.
    pool = make_pool(ram=10_000, disk=900)
    recs = [put(pool, [50 + i] + T[:8], random.Random(i).randbytes(64)) for i in range(3)]
    assert {file_size(r) for r in recs} == {442}
    pool.flush()
    # The oldest written file went first; its RAM copy still serves.
    assert [e["tiers"] for e in sorted(pool.describe(), key=lambda e: e["created"])] == [
        ["ram"],
        ["ram", "disk"],
        ["ram", "disk"],
    ]
    assert pool.stats().tier("disk").evictions == 1
    assert not (tmp_path / "ckpt" / f"{recs[0].id}.ckpt").exists()


def test_the_disk_holds_at_most_its_checkpoint_count(make_pool: PoolFactory,
                                                     tmp_path: Path) -> None:
    # Each checkpoint held on disk alone keeps a head in memory: cache.disk_max_checkpoints
    # bounds them however few bytes the files take. The least recently used goes first,
    # its head with it; a restart holds the bound too.
    pool = make_pool(ram=1, disk=1 << 20, disk_max_checkpoints=3)
    recs = [put(pool, [70 + i] + T[:8], random.Random(i).randbytes(64)) for i in range(5)]
    pool.flush()
    held = {e["id"] for e in pool.describe()}
    assert held == {r.id for r in recs[2:]}, held
    assert pool.stats().tier("disk").evictions == 2
    assert sorted(p.stem for p in (tmp_path / "ckpt").glob("*.ckpt")) == \
        sorted(r.id for r in recs[2:])
    pool.close()
    again = make_pool(ram=1, disk=1 << 20, disk_max_checkpoints=2)
    assert len(again.describe()) == 2
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 2


def test_partial_kind_is_never_written(make_pool: PoolFactory, tmp_path: Path) -> None:
    pool = make_pool()
    pool.insert(
        kind=Kind.PARTIAL, owner=Owner.DRAFT, lane=1, tokens=T, role=Role.BRANCH, data=b"p" * 10
    )
    assert pool.flush() == 0
    assert not list((tmp_path / "ckpt").glob("*.ckpt"))
