"""Page files changed while the proxy was stopped: a file of another size than its record
says is refused at start without a byte of it read (quarantined), and the budget counts
what the records say; a page that went missing is logged, counted and named."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from tests.unit.conftest import PoolFactory
from tests.unit.kvstate import conversation_state
from tests.unit.test_disk_pages import _page_of, page_files, saved
from tests.unit.test_pool_pages import state_of, tokens

GIB = 1 << 30


def _rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def test_a_sparse_gigabyte_page_file_costs_no_budget_and_no_memory(
    make_pool: PoolFactory, tmp_path: Path
) -> None:
    recs = saved(make_pool)  # pages of the records at 8, 24 and 40 tokens
    pool = make_pool(kv_sections=1)
    before = pool.stats().tier("disk")
    pool.close()
    victim = _page_of(tmp_path, recs[2], 9)  # named by the record at 40 alone
    os.truncate(victim, GIB)  # sparse: costs the disk nothing, a reader a gigabyte
    # VmHWM from here: the peak of this process since the reset (Linux clear_refs 5)
    Path("/proc/self/clear_refs").write_text("5")
    base = _rss_kib("VmRSS")
    pool = make_pool(kv_sections=1)
    disk = pool.stats().tier("disk")
    assert pool.stats().quarantined == 2  # the page, unread, and the record naming it
    assert not victim.exists() and disk.evictions == 0
    # the budget holds what the records say: the record at 40 and its own four pages
    # are gone from it, the six the others name are held at their sizes
    assert disk.pages == 6 and disk.page_bytes == before.page_bytes * 6 // 10
    assert disk.bytes < before.bytes
    assert {d["id"] for d in pool.describe()} == {recs[0].id, recs[1].id}
    assert state_of(pool, 0, 40) is None
    assert state_of(pool, 0, 24) == conversation_state(24)
    assert _rss_kib("VmHWM") - base < 64 << 10  # not a gigabyte: under 64 MiB more


def test_a_page_file_larger_than_the_budget_evicts_nothing(
    make_pool: PoolFactory, tmp_path: Path
) -> None:
    recs = saved(make_pool)
    victim = _page_of(tmp_path, recs[2], 9)
    os.truncate(victim, 200_000)  # twice the disk budget
    pool = make_pool(kv_sections=1)
    assert pool.stats().tier("disk").evictions == 0
    assert {d["id"] for d in pool.describe()} == {recs[0].id, recs[1].id}
    assert state_of(pool, 0, 8) == conversation_state(8)


def test_a_page_one_byte_short_at_start_is_refused_unread(
    make_pool: PoolFactory, tmp_path: Path
) -> None:
    recs = saved(make_pool)
    victim = _page_of(tmp_path, recs[2], 9)
    victim.write_bytes(victim.read_bytes()[:-1])
    pool = make_pool(kv_sections=1)
    assert not victim.exists() and len(page_files(tmp_path)) == 6
    assert state_of(pool, 0, 40) is None and state_of(pool, 0, 24) == conversation_state(24)


@pytest.mark.parametrize("when", ["stopped", "running"])
def test_a_deleted_page_is_logged_counted_and_named(
    make_pool: PoolFactory, tmp_path: Path, caplog: pytest.LogCaptureFixture, when: str
) -> None:
    recs = saved(make_pool)
    victim = _page_of(tmp_path, recs[2], 4)  # named by the records at 24 and 40
    name = recs[2].page_keys[4].hex()
    if when == "stopped":
        victim.unlink()
    caplog.set_level(logging.INFO)
    pool = make_pool(kv_sections=1)
    if when == "running":
        victim.unlink()
    assert state_of(pool, 0, 40) is None
    lines = [r.getMessage() for r in caplog.records
             if r.levelno == logging.WARNING and name in r.getMessage()]
    assert len(lines) == 1 and "2 checkpoint(s)" in lines[0], lines
    s = pool.stats()
    assert s.counts.dropped == {"missing": 2}
    assert pool.dropped_cause(tokens(0, 40) + [7, 7]) == "page missing"
    assert pool.dropped_cause([5, 5, 5, 5, 5, 5, 5, 5, 5]) is None
    assert state_of(pool, 0, 8) == conversation_state(8)
