"""KV pages on disk: files of their own, written once for every record that names them,
authenticated one by one; a missing or bad page makes the records that need it misses
(quarantined), never a wrong state; pages no record names are removed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from statecache.tiers import diskfiles
from statecache.tiers.diskfiles import PAGE_SUFFIX, pages_dir
from tests.unit.conftest import FP, PoolFactory
from tests.unit.kvstate import conversation_state
from tests.unit.test_pool_pages import save, state_of


def page_files(tmp_path: Path) -> list[Path]:
    return sorted(pages_dir(tmp_path / "ckpt", FP).glob(f"*/*{PAGE_SUFFIX}"))


def record_file(tmp_path: Path, entry_id: str) -> Path:
    return tmp_path / "ckpt" / f"{entry_id}.ckpt"


def saved(make_pool: PoolFactory, ns: tuple[int, ...] = (8, 24, 40)) -> list:  # type: ignore[type-arg]
    pool = make_pool(kv_sections=1)
    recs = [save(pool, 0, n) for n in ns]
    pool.close()
    return recs


def test_pages_are_files_written_once(make_pool: PoolFactory, tmp_path: Path) -> None:
    pool = make_pool(kv_sections=1)
    recs = [save(pool, 0, n) for n in (8, 24, 40)]
    save(pool, 1, 8)  # another conversation: pages of its own
    assert pool.flush() == 4
    files = page_files(tmp_path)
    assert len(files) == 10 + 2  # conversation 0's ten pages once, conversation 1's two
    s = pool.stats()
    held = s.tier("disk")
    assert (held.pages, held.page_bytes) == (12, sum(p.stat().st_size for p in files))
    records = sum(record_file(tmp_path, r.id).stat().st_size for r in recs)
    assert s.tier("disk").bytes == records + s.tier("disk").page_bytes + sum(
        f.stat().st_size for f in (tmp_path / "ckpt").glob("*.ckpt")
        if f.stem not in {r.id for r in recs})
    pool.close()
    again = make_pool(kv_sections=1)
    for n in (8, 24, 40):
        assert state_of(again, 0, n) == conversation_state(n)
    assert again.stats().tier("disk").hits >= 1  # the later ones found pages in RAM already


def test_a_missing_page_makes_its_records_misses(make_pool: PoolFactory, tmp_path: Path) -> None:
    recs = saved(make_pool)
    # page 4 (tokens 16..19): named by the records at 24 and 40, not by the one at 8
    pool = make_pool(kv_sections=1)
    assert pool.stats().tier("disk").pages == 10
    pool.close()
    victim = _page_of(tmp_path, recs[2], 4)
    victim.unlink()
    pool = make_pool(kv_sections=1)  # found at scan: both records quarantined
    assert {d["id"] for d in pool.describe()} == {recs[0].id}
    assert pool.stats().quarantined == 2
    assert state_of(pool, 0, 40) is None and state_of(pool, 0, 24) is None
    assert state_of(pool, 0, 8) == conversation_state(8)
    # pages only the quarantined records named are gone too
    assert pool.stats().tier("disk").pages == 2 and len(page_files(tmp_path)) == 2


def test_a_bad_page_found_at_read_is_a_miss_for_every_record_that_needs_it(
    make_pool: PoolFactory, tmp_path: Path
) -> None:
    recs = saved(make_pool)
    victim = _page_of(tmp_path, recs[2], 4)
    raw = bytearray(victim.read_bytes())
    raw[len(raw) // 2] ^= 1  # one bit of the stored page
    victim.write_bytes(bytes(raw))
    pool = make_pool(kv_sections=1)  # the scan reads no page: all three look fine
    assert len(pool.describe()) == 3
    # the deepest is tried first: its page 4 fails its MAC; so do the 24's; 8 serves
    assert state_of(pool, 0, 40) is None
    s = pool.stats()
    assert s.quarantined == 1 and {d["id"] for d in pool.describe()} == {recs[0].id}
    assert not victim.exists()
    assert any(p.name.startswith(victim.name) for p in (tmp_path / "ckpt" / "quarantine").iterdir())
    toks = list(range(1000, 1040)) + [1]
    with pool.lookup(toks, pool.chain(toks)) as lease:  # type: ignore[union-attr]
        assert lease.record.n == 8 and bytes(lease.data) == conversation_state(8)


def test_a_page_file_grown_after_the_scan_is_refused_unread(make_pool: PoolFactory,
                                                            tmp_path: Path) -> None:
    recs = saved(make_pool)
    victim = _page_of(tmp_path, recs[2], 4)
    pool = make_pool(kv_sections=1)  # scanned at its true size
    os.truncate(victim, 1 << 40)  # a sparse terabyte: reading it whole would not fit
    fds = len(os.listdir("/proc/self/fd"))
    assert state_of(pool, 0, 40) is None
    assert len(os.listdir("/proc/self/fd")) == fds  # the batch's other files closed
    assert pool.stats().quarantined == 1 and not victim.exists()
    assert state_of(pool, 0, 8) == conversation_state(8)


@pytest.mark.parametrize("ahead", [1, 3, 128])
def test_pages_read_in_groups_of_open_files_come_back_in_order(
    make_pool: PoolFactory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ahead: int
) -> None:
    recs = saved(make_pool)
    monkeypatch.setattr(diskfiles, "_AHEAD", ahead)  # ten pages: groups of 1, of 3 and one
    pool = make_pool(kv_sections=1)
    assert state_of(pool, 0, 40) == conversation_state(40)
    pool.close()
    victim = _page_of(tmp_path, recs[2], 7)  # in the third group of three
    pool = make_pool(kv_sections=1)  # cut after the scan, which refuses a page cut before
    victim.write_bytes(victim.read_bytes()[:-1])
    fds = len(os.listdir("/proc/self/fd"))
    assert state_of(pool, 0, 40) is None
    assert len(os.listdir("/proc/self/fd")) == fds  # the group's other files closed
    assert pool.stats().quarantined == 1


def test_a_page_under_another_name_or_key_is_refused(make_pool: PoolFactory,
                                                     tmp_path: Path) -> None:
    recs = saved(make_pool, (8,))
    a, b = _page_of(tmp_path, recs[0], 0), _page_of(tmp_path, recs[0], 1)
    a_bytes = a.read_bytes()
    a.write_bytes(b.read_bytes())  # a valid page, of another name
    pool = make_pool(kv_sections=1)
    assert state_of(pool, 0, 8) is None
    assert pool.stats().quarantined == 1 and pool.stats().entries == 0
    del a_bytes


def test_orphan_pages_are_removed_and_the_budget_counts_each_page_once(
    make_pool: PoolFactory, tmp_path: Path
) -> None:
    recs = saved(make_pool)
    record_file(tmp_path, recs[2].id).unlink()  # the 40's record, not its pages
    pool = make_pool(kv_sections=1)
    assert len(pool.describe()) == 2
    assert len(page_files(tmp_path)) == 6  # pages 6..9 only the 40 named: gone
    # a disk that holds one record and its pages at most: the oldest record goes, and
    # the pages only it named with it
    pool.close()
    for age, rec in enumerate(recs[:2]):  # the LRU order across restarts: mtime
        os.utime(record_file(tmp_path, rec.id), (1000 + age, 1000 + age))
    files = page_files(tmp_path)
    one = record_file(tmp_path, recs[1].id).stat().st_size + sum(p.stat().st_size for p in files)
    small = make_pool(kv_sections=1, disk=one)
    assert {d["id"] for d in small.describe()} == {recs[1].id}
    assert small.stats().tier("disk").pages == 6
    small.sanity_check()


def _page_of(tmp_path: Path, rec, i: int) -> Path:  # type: ignore[no-untyped-def]
    from statecache.tiers.diskfiles import page_path

    return page_path(pages_dir(tmp_path / "ckpt", FP), rec.page_keys[i])
