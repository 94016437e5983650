"""The disk tier's housekeeping: leftovers, a shared directory, tiny RAM, bad directories."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from statecache.formats.diskfmt import file_size
from statecache.records import Kind
from tests.unit.conftest import PoolFactory, put
from tests.unit.test_disk_trust import old_format_file, statecache_warnings
from tests.unit.test_pool_writer import Gate

T = list(range(1, 21))


def test_leftover_temp_files_are_swept_at_start_and_counted_if_they_stay(
    make_pool: PoolFactory, tmp_path: Path
) -> None:
    d = tmp_path / "ckpt"
    make_pool().close()
    # A crash mid-write leaves temporary files, fresh ones too: the lock proves that
    # no process is writing them now.
    fresh = d / ".tmp-0123-99-abcd"
    fresh.write_bytes(b"x" * 500)
    old = d / ".tmp-4567-98-dcba"
    old.write_bytes(b"y" * 700)
    os.utime(old, (1, 1))
    # One that cannot be removed (a directory here) stays in the byte count.
    stuck = d / ".tmp-stuck"
    stuck.mkdir()
    pool = make_pool()
    assert not fresh.exists() and not old.exists() and stuck.exists()
    assert pool.stats().tier("disk").bytes == stuck.lstat().st_size > 0


def test_a_write_in_progress_counts_in_the_budget(make_pool: PoolFactory) -> None:
    pool = make_pool()
    gate = Gate.on_writes(pool)
    rec = put(pool, T, b"S" * 64)
    assert gate.entered.wait(30)
    # Reserved before the temporary file exists, until the file is committed.
    disk = pool.stats().tier("disk")
    assert disk.bytes == file_size(rec) and disk.entries == 0
    gate.open.set()
    pool.flush()
    # Committed, the file counts what it takes (its rest compressed: less than reserved).
    size = (pool.disk.path / f"{rec.id}.ckpt").stat().st_size  # type: ignore[union-attr]
    assert size < file_size(rec)
    assert pool.stats().tier("disk").bytes == size and pool.stats().tier("disk").entries == 1


def test_a_second_pool_on_the_same_directory_refuses_it(
    make_pool: PoolFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    first = make_pool()
    put(first, T, b"S" * 64)
    first.flush()
    second = make_pool()
    expected = f"is in use by another statecache process (pid {os.getpid()})"
    assert expected in second.disk_status
    assert second.describe() == [] and second.stats().tier("disk").budget == 0
    put(second, T[:9], b"R" * 64)
    second.flush()
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 1  # the second wrote nothing
    (warning,) = statecache_warnings(caplog)
    assert expected in warning and "give each proxy its own cache.disk_path" in warning
    # Once the first closes, the directory is free again.
    first.close()
    third = make_pool()
    assert third.disk_status == "ok" and len(third.describe()) == 1


def test_ram_budget_smaller_than_a_state_goes_straight_to_disk(
    make_pool: PoolFactory, caplog: pytest.LogCaptureFixture
) -> None:
    pool = make_pool(ram=16)
    recs = [put(pool, [i] + T, bytes([i]) * 64) for i in range(3)]
    assert all(d["tiers"] == ["disk"] for d in pool.describe())
    for i, rec in enumerate(recs):
        toks = [i] + T
        with pool.lookup(toks, pool.chain(toks)) as lease:  # type: ignore[union-attr]
            assert lease.record.id == rec.id and bytes(lease.data) == bytes([i]) * 64
            assert lease.tier == "disk"
    s = pool.stats()
    assert (s.counts.direct_writes, s.counts.refused, s.tier("ram").bytes) == (3, 0, 0)
    (warning,) = statecache_warnings(caplog)
    assert "smaller than a 64 B state: such states go straight to disk" in warning
    # A partial state has no disk to go to: refused, as before.
    assert pool.insert(kind=Kind.PARTIAL, owner=recs[0].owner, lane=0, tokens=T,
                       role=recs[0].role, data=b"p" * 64) is None


def test_read_only_directory_warns_once_at_start(
    make_pool: PoolFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    os.chmod(d, 0o500)
    try:
        pool = make_pool()
        for i in range(4):
            put(pool, [i] + T, b"S" * 64)
        pool.flush()
    finally:
        os.chmod(d, 0o700)
    assert "read-only (mode 0o500)" in pool.disk_status
    assert len(statecache_warnings(caplog)) == 1


def test_unusable_directory_warns_once_at_start(
    make_pool: PoolFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "ckpt").write_text("a file, not a directory")
    pool = make_pool()
    for i in range(4):
        put(pool, [i] + T, b"S" * 64)
    pool.close()
    assert pool.disk_status.endswith("is not a directory")
    assert len(statecache_warnings(caplog)) == 1


def test_write_failures_while_running_warn_once(
    make_pool: PoolFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pool = make_pool()
    shutil.rmtree(tmp_path / "ckpt")  # the directory goes away under the running pool
    for i in range(4):
        put(pool, [i] + T, b"S" * 64)
    pool.flush()
    s = pool.stats()
    disk = s.tier("disk")
    assert s.counts.disk_write_errors == 4 and disk.entries == 0 and disk.bytes == 0
    (warning,) = statecache_warnings(caplog)
    assert "writing" in warning and "later failures are logged at debug level" in warning
    # The states are still served from RAM.
    with pool.lookup([3] + T, pool.chain([3] + T)) as lease:  # type: ignore[union-attr]
        assert lease.tier == "ram" and bytes(lease.data) == b"S" * 64


def test_files_of_an_older_statecache_are_set_aside_with_one_warning(
    make_pool: PoolFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = tmp_path / "ckpt"
    make_pool().close()
    for i in range(5):  # what an upgrade finds: files without a MAC
        old_format_file(d, [i] + T, b"S" * 64)
    pool = make_pool()
    assert pool.describe() == [] and pool.stats().quarantined == 5
    (warning,) = statecache_warnings(caplog)
    assert "moved 5 bad file(s)" in warning and "format version 1" in warning
