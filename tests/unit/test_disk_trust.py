"""Who can make the pool serve a state: only a holder of the key, from a safe directory.

An attacker here can write the checkpoint directory (or it is world-writable) but has
no key. Each forged file must be a miss, never another conversation's state.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import struct
import threading
from pathlib import Path

import msgpack
import pytest
import xxhash

from statecache.formats.diskfmt import HEADER, TAG_BYTES, encode_meta, key_id, write_checkpoint
from statecache.formats.trust import Untrusted, load_key
from statecache.kvpages import REST_HEAD_BYTES, split
from statecache.records import CheckpointRecord, Kind, Owner, Role, new_record
from tests.unit.conftest import FP, PoolFactory, put

A = list(range(1, 21))  # Alice's conversation
B = list(range(101, 121))  # Bob's
STATE_A, STATE_B = b"A" * 64, b"B" * 64


def record(tokens: list[int], nbytes: int = 64) -> CheckpointRecord:
    return new_record(
        kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=tokens, fingerprint=FP,
        tenant="", state_format=1, nbytes=nbytes, role=Role.REPLAY, created=1.0, page_size=4,
        rest_nbytes=nbytes + REST_HEAD_BYTES,
    )


def whole(state: bytes) -> bytes:
    """A state kept whole, as a record file stores it (statecache.kvpages)."""
    return split(state, sections=0, page_size=4, chain=()).rest


def hit(pool, tokens: list[int]) -> bytes | None:  # type: ignore[no-untyped-def]
    lease = pool.lookup(tokens, pool.chain(tokens))
    if lease is None:
        return None
    with lease:
        return bytes(lease.data)


def quarantined(d: Path) -> list[str]:
    q = d / "quarantine"
    return sorted(p.name.rsplit(".", 1)[0] for p in q.iterdir()) if q.is_dir() else []


def statecache_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records
        if r.name.startswith("statecache") and r.levelno >= logging.WARNING
    ]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return tmp_path / "ckpt"


@pytest.fixture
def key(make_pool: PoolFactory, tmp_path: Path) -> bytes:
    make_pool().close()  # the first pool creates the key
    return (tmp_path / "keys" / "secret.key").read_bytes()


def old_format_file(ckpt: Path, tokens: list[int], data: bytes) -> CheckpointRecord:
    """A version 1 file: header, metadata, state, xxh3-128 of all that (no key)."""
    rec = record(tokens, len(data))
    meta = encode_meta(rec)
    v1 = struct.Struct("<4sHHIIQ")
    head = v1.pack(b"SCKP", 1, 0, v1.size, len(meta), len(data))
    digest = xxhash.xxh3_128(head + meta + data).digest()
    (ckpt / f"{rec.id}.ckpt").write_bytes(head + meta + data + digest)
    return rec


def version_2_file(ckpt: Path, key: bytes, tokens: list[int], data: bytes) -> CheckpointRecord:
    """A version 2 file, signed with our own key: one whole state per file, as written
    before KV pages (its metadata had no page keys and no rest)."""
    rec = record(tokens, len(data))
    meta = {k: v for k, v in msgpack.unpackb(encode_meta(rec)).items()
            if k not in ("keys", "rest")}
    raw_meta = msgpack.packb(meta, use_bin_type=True)
    head = HEADER.pack(b"SCKP", 2, 0, HEADER.size, len(raw_meta), len(data), key_id(key))
    mac = hmac.new(key, head + raw_meta, hashlib.sha256)
    meta_tag = mac.copy().digest()
    mac.update(meta_tag + data)
    (ckpt / f"{rec.id}.ckpt").write_bytes(head + raw_meta + meta_tag + data + mac.digest())
    return rec


# -- forged files ----------------------------------------------------------------------


def test_version_2_file_of_our_own_key_is_a_miss(
    make_pool: PoolFactory, ckpt: Path, key: bytes
) -> None:
    # Written by the statecache before KV pages, under this very key: read as a miss and
    # quarantined, never trusted as a state of the new layout.
    rec = version_2_file(ckpt, key, A, STATE_A)
    pool = make_pool()
    assert hit(pool, A) is None
    assert quarantined(ckpt) == [f"{rec.id}.ckpt"]
    assert pool.stats().entries == 0


def test_old_format_file_with_a_valid_digest_is_never_served(
    make_pool: PoolFactory, ckpt: Path, key: bytes
) -> None:
    # Version 1 was checked by an unkeyed xxh3 digest: anyone could write one that
    # claims Alice's tokens and carries Bob's state.
    rec = old_format_file(ckpt, A, STATE_B)
    pool = make_pool()
    assert hit(pool, A) is None
    assert quarantined(ckpt) == [f"{rec.id}.ckpt"]


def test_file_made_with_another_key_is_never_served(
    make_pool: PoolFactory, ckpt: Path, key: bytes
) -> None:
    # The attacker writes a well-formed file with a key of their own...
    rec = record(A)
    write_checkpoint(ckpt, rec, whole(STATE_B), os.urandom(32))
    # ...and a second one where they copied our key id into the header.
    rec2 = record(A[:13])
    write_checkpoint(ckpt, rec2, whole(STATE_B), os.urandom(32))
    p2 = ckpt / f"{rec2.id}.ckpt"
    raw = bytearray(p2.read_bytes())
    raw[HEADER.size - 8 : HEADER.size] = key_id(key)
    p2.write_bytes(bytes(raw))
    pool = make_pool()
    assert hit(pool, A) is None
    assert quarantined(ckpt) == sorted([f"{rec.id}.ckpt", f"{rec2.id}.ckpt"])
    assert pool.stats().entries == 0


def test_spliced_files_are_never_served(make_pool: PoolFactory, ckpt: Path, key: bytes) -> None:
    pool = make_pool()
    ra, rb = put(pool, A, STATE_A), put(pool, B, STATE_B)
    pool.close()
    fa, fb = ckpt / f"{ra.id}.ckpt", ckpt / f"{rb.id}.ckpt"
    a, b = fa.read_bytes(), fb.read_bytes()
    data_at = len(a) - TAG_BYTES - 64
    # Alice's header, metadata and meta tag, with Bob's state and Bob's tag.
    fa.write_bytes(a[:data_at] + b[data_at:])
    # Bob's file with Alice's metadata in it (same length: tokens of the same count).
    meta_a, meta_b = encode_meta(ra), encode_meta(rb)
    assert len(meta_a) == len(meta_b)
    fb.write_bytes(b.replace(meta_b, meta_a))
    pool = make_pool()
    assert hit(pool, A) is None and hit(pool, B) is None
    assert quarantined(ckpt) == sorted([fa.name, fb.name])


def test_a_wrong_key_is_a_miss(make_pool: PoolFactory, tmp_path: Path, ckpt: Path) -> None:
    pool = make_pool()
    rec = put(pool, A, STATE_A)
    pool.close()
    right = make_pool()
    assert hit(right, A) == STATE_A  # the right key serves it
    right.close()
    # A pool whose key is another (a lost key file, another secret_path): a miss.
    other = make_pool(secret_path=str(tmp_path / "other-keys" / "secret.key"))
    assert hit(other, A) is None
    assert quarantined(ckpt) == [f"{rec.id}.ckpt"]
    assert other.stats().quarantined == 1


# -- the directory ---------------------------------------------------------------------


def plant(ckpt: Path) -> None:
    """What an attacker puts in a world-writable directory: a file the pool would read."""
    write_checkpoint(ckpt, record(A), whole(STATE_B), os.urandom(32))


def test_world_writable_directory_turns_the_disk_tier_off_with_one_warning(
    make_pool: PoolFactory, ckpt: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ckpt.mkdir(mode=0o700)
    os.chmod(ckpt, 0o777)
    plant(ckpt)
    caplog.set_level(logging.INFO)
    pool = make_pool()
    assert "writable by group or others (mode 0o777)" in pool.disk_status
    for i in range(3):
        assert put(pool, [i] + A, STATE_A).id  # RAM still works
    pool.flush()
    assert len(list(ckpt.glob("*.ckpt"))) == 1  # only the planted one; nothing read
    assert pool.stats().tier("disk").entries == 0 and pool.stats().quarantined == 0
    warnings = statecache_warnings(caplog)
    assert len(warnings) == 1 and "the disk tier is off" in warnings[0]
    assert "chmod go-w" in warnings[0]


def test_group_writable_parent_is_refused_unless_sticky(
    make_pool: PoolFactory, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o775)
    pool = make_pool(path=shared / "ckpt")
    assert f"{shared} is writable by group or others" in pool.disk_status
    pool.close()
    os.chmod(shared, 0o1777)  # like /tmp: others cannot move our directory away
    assert make_pool(path=shared / "ckpt").disk_status == "ok"


@pytest.mark.skipif(os.getuid() != 0, reason="chown to another user needs root")
def test_directory_and_key_of_another_user_are_refused(
    make_pool: PoolFactory, tmp_path: Path, ckpt: Path
) -> None:
    ckpt.mkdir(mode=0o700)
    os.chown(ckpt, 12345, -1)
    assert "owned by uid 12345, not by you" in make_pool().disk_status
    os.chown(ckpt, 0, -1)
    make_pool().close()
    keyfile = tmp_path / "keys" / "secret.key"
    os.chown(keyfile, 12345, -1)
    assert "owned by uid 12345" in make_pool().disk_status


@pytest.mark.parametrize(
    ("spoil", "message"),
    [
        (lambda p: os.chmod(p, 0o644), "readable or writable by others (mode 0o644)"),
        (lambda p: os.chmod(p, 0o620), "readable or writable by others (mode 0o620)"),
        (lambda p: p.write_bytes(b"short"), "holds 5 bytes, not 32"),
        (lambda p: (p.unlink(), p.symlink_to(p.parent / "elsewhere")), "is a symlink"),
    ],
)
def test_unsafe_key_file_turns_the_disk_tier_off(
    make_pool: PoolFactory, tmp_path: Path, spoil: object, message: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    make_pool().close()
    keyfile = tmp_path / "keys" / "secret.key"
    spoil(keyfile)  # type: ignore[operator]
    pool = make_pool()
    assert message in pool.disk_status
    assert len(statecache_warnings(caplog)) == 1


def test_key_is_made_private_and_kept_outside_the_directory(
    make_pool: PoolFactory, tmp_path: Path, ckpt: Path
) -> None:
    make_pool().close()
    keyfile = tmp_path / "keys" / "secret.key"
    assert keyfile.stat().st_mode & 0o777 == 0o600 and len(keyfile.read_bytes()) == 32
    assert keyfile.parent.stat().st_mode & 0o777 == 0o700
    inside = make_pool(secret_path=str(ckpt / "secret.key"))
    assert "inside the checkpoint directory" in inside.disk_status


def test_racing_first_runs_agree_on_one_key(tmp_path: Path) -> None:
    path = tmp_path / "state" / "statecache" / "secret.key"
    keys: list[bytes] = []
    start = threading.Barrier(8)

    def first_run() -> None:
        start.wait()
        keys.append(load_key(path))

    threads = [threading.Thread(target=first_run) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(keys) == 8 and len(set(keys)) == 1 and path.read_bytes() == keys[0]
    assert [p.name for p in path.parent.iterdir()] == ["secret.key"]  # no temp file left
    with pytest.raises(FileNotFoundError):
        load_key(tmp_path / "absent" / "secret.key", create=False)
    os.chmod(path, 0o640)
    with pytest.raises(Untrusted):
        load_key(path)
