"""The spare state buffer: reused without page faults, never written while read."""

from __future__ import annotations

import mmap

import pytest

from statecache.buffers import Spare
from tests.unit.conftest import PoolFactory
from tests.unit.kvstate import conversation_state
from tests.unit.test_pool_pages import lease_of, save, tokens


def test_a_buffer_given_back_is_the_next_one_at_the_length_asked() -> None:
    spare = Spare()
    a = spare.take(10_000)
    assert isinstance(a, mmap.mmap) and len(a) == 10_000
    memoryview(a)[:5] = b"abcde"
    spare.give(a)
    assert spare.nbytes == 10_000
    b = spare.take(50_000)  # grown in place or moved by the kernel: the same object
    assert b is a and len(b) == 50_000 and spare.nbytes == 0
    spare.give(b)
    assert spare.take(3) is a and len(a) == 3


def test_a_buffer_still_read_is_never_handed_out() -> None:
    spare = Spare()
    a = spare.take(4096)
    memoryview(a)[:4] = b"keep"
    view = memoryview(a)[:4]  # a reader that outlived its lease
    spare.give(a)
    b = spare.take(4096)
    assert b is not a
    memoryview(b)[:4] = b"new!"
    assert bytes(view) == b"keep"
    view.release()


def test_the_largest_buffer_is_kept_and_nothing_else() -> None:
    spare = Spare()
    small, large = spare.take(100), spare.take(1000)
    spare.give(large)
    spare.give(small)
    spare.give(b"not a buffer of ours")
    assert spare.nbytes == 1000
    with pytest.raises(ValueError):
        spare.take(0)


def test_a_lease_read_after_its_close_keeps_its_bytes(make_pool: PoolFactory) -> None:
    # A view of an assembled state kept past its lease (a caller's bug, or a slow reader)
    # pins that buffer: the next assembly and the next state kept whole go elsewhere.
    pool = make_pool(ram=1 << 20, disk=None, kv_sections=1)
    save(pool, 0, 16), save(pool, 0, 32), save(pool, 1, 16), save(pool, 1, 32)
    with lease_of(pool, tokens(0, 16), 16) as lease:
        kept = lease.data[:]
    with lease_of(pool, tokens(1, 16), 16) as lease:
        assert lease.data.obj is not kept.obj
        assert bytes(lease.data) == conversation_state(16, conv=1)
    save(pool, 0, 40)
    assert bytes(kept) == conversation_state(16)
    kept.release()
    pool.sanity_check()
