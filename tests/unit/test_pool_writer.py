"""The disk writer and the lock: states reach the disk while the pool runs, and no disk
read or write ever holds the lock that describe/get/stats take from the event loop.

A slow disk is made by a gate around the real file methods of the disk tier: each call
waits until the test opens the gate, then does the real I/O.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from statecache.kvpages import REST_HEAD_BYTES
from statecache.pool import CheckpointPool
from tests.unit.conftest import PoolFactory, put

T = list(range(1, 21))
REPO = Path(__file__).resolve().parents[2]


class Gate:
    """Wraps a real DiskTier file method; every call waits until ``open`` is set."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        self.fn = fn
        self.open = threading.Event()
        self.entered = threading.Event()

    def __call__(self, *args: Any) -> Any:
        self.entered.set()
        if not self.open.wait(20):
            raise TimeoutError("the test never opened the gate")
        return self.fn(*args)

    @classmethod
    def on_writes(cls, pool: CheckpointPool) -> Gate:
        disk = pool.disk
        assert disk is not None
        gate = cls(disk.write_file)
        disk.write_file = gate  # type: ignore[method-assign,assignment]
        return gate

    @classmethod
    def on_reads(cls, pool: CheckpointPool) -> Gate:
        disk = pool.disk
        assert disk is not None
        gate = cls(disk.read_file)
        disk.read_file = gate  # type: ignore[method-assign,assignment]
        return gate


def answers(call: Callable[[], object], within: float = 30.0) -> bool:
    """True if ``call`` returns within ``within`` seconds (it runs in a thread)."""
    done = threading.Event()

    def run() -> None:
        call()
        done.set()

    threading.Thread(target=run, daemon=True).start()
    return done.wait(within)


def wait_for(cond: Callable[[], bool], within: float = 10.0) -> bool:
    end = time.monotonic() + within
    while not cond():
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def on_disk(pool: CheckpointPool) -> set[str]:
    return {d["id"] for d in pool.describe() if "disk" in d["tiers"]}


def test_full_states_reach_the_disk_while_the_pool_runs(
    make_pool: PoolFactory, tmp_path: Path
) -> None:
    pool = make_pool()
    recs = [put(pool, [i] + T, bytes([i]) * 64) for i in range(3)]
    # No flush, no close: the writer gets there by itself.
    assert wait_for(lambda: on_disk(pool) == {r.id for r in recs})
    assert all((tmp_path / "ckpt" / f"{r.id}.ckpt").exists() for r in recs)
    pool.sanity_check()


def test_the_writer_yields_the_cores_to_the_engine(make_pool: PoolFactory) -> None:
    # the writer's MAC and writes of tens of MB would otherwise take a core from a decode:
    # its thread runs BACKGROUND_NICE lower than the rest of the process, and still writes
    from statecache.tiers.background import BACKGROUND_NICE

    if not sys.platform.startswith("linux"):
        return  # a thread has its own nice value on Linux only; elsewhere nothing changes
    pool = make_pool()
    rec = put(pool, [7] + T, b"x" * 64)
    assert wait_for(lambda: rec.id in on_disk(pool))
    thread = pool._writer._thread
    assert thread is not None and thread.native_id is not None
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert os.getpriority(os.PRIO_PROCESS, thread.native_id) == min(mine + BACKGROUND_NICE, 19)
    assert mine == os.getpriority(os.PRIO_PROCESS, 0)  # the caller's own thread is untouched


def test_the_writer_waits_while_the_engine_prefills(
    make_pool: PoolFactory, monkeypatch: Any
) -> None:
    # a write's MAC and copies would take a core from the prefill that saved the state:
    # while the engine says it prefills, the queue waits (HOLD_MAX_S at most), unless
    # flush asks or RAM spills states to the writer
    import statecache.tiers.background as background

    budget = 2 * (148 + REST_HEAD_BYTES)  # two states of 64 bytes (as below)
    pool = make_pool(ram=budget)
    pool.hold_writes(True)
    a = put(pool, [0] + T, b"a" * 64)
    time.sleep(0.3)
    assert a.id not in on_disk(pool)  # held: 120 s is far off
    pool.hold_writes(False)
    assert wait_for(lambda: a.id in on_disk(pool))

    pool.hold_writes(True)
    b = put(pool, [1] + T, b"b" * 64)
    assert answers(pool.flush, within=20) and b.id in on_disk(pool)  # flush writes now

    c = put(pool, [2] + T, b"c" * 64)  # evicts a, b: on disk already, nothing spills
    d = put(pool, [3] + T, b"d" * 64)
    time.sleep(0.3)
    assert not {c.id, d.id} & on_disk(pool) and pool.stats().counts.spills == 0
    put(pool, [5] + T, b"f" * 64)  # evicts c, which the disk lacks: spilled, so written
    assert wait_for(lambda: c.id in on_disk(pool))
    assert pool.stats().counts.spills == 1

    monkeypatch.setattr(background, "HOLD_MAX_S", 0.5)  # a hold ends by itself
    pool.hold_writes(False)
    pool.hold_writes(True)
    e = put(pool, [4] + T, b"e" * 64)
    assert wait_for(lambda: e.id in on_disk(pool))
    pool.sanity_check()


CHILD = textwrap.dedent("""
    import os, signal, sys, time
    from statecache.config import CacheConfig
    from statecache.pool import CheckpointPool
    from statecache.records import Kind, Owner, Role
    disk, key = sys.argv[1:3]
    cfg = CacheConfig(page_size=4, ram_budget=1 << 20, disk_path=disk, secret_path=key)
    pool = CheckpointPool(cfg, "test-model:0123")
    for i in range(3):
        pool.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=[i] + list(range(1, 21)),
                    role=Role.REPLAY, data=bytes([i]) * 64)
    end = time.monotonic() + 60
    while len([f for f in os.listdir(disk) if f.endswith(".ckpt")]) < 3 and time.monotonic() < end:
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)  # no close(), no atexit: a crash
""")


def test_a_sigkill_loses_seconds_not_the_session(make_pool: PoolFactory, tmp_path: Path) -> None:
    disk, key = tmp_path / "ckpt", tmp_path / "keys" / "secret.key"
    res = subprocess.run([sys.executable, "-c", CHILD, str(disk), str(key)], cwd=REPO)
    assert res.returncode == -9
    pool = make_pool()
    assert len(pool.describe()) == 3
    for i in range(3):
        toks = [i] + T
        with pool.lookup(toks, pool.chain(toks)) as lease:  # type: ignore[union-attr]
            assert lease.tier == "disk" and bytes(lease.data) == bytes([i]) * 64


def test_event_loop_calls_answer_while_a_disk_read_is_slow(make_pool: PoolFactory) -> None:
    pool = make_pool()
    rec = put(pool, T, b"S" * 64)
    pool.close()
    pool = make_pool()  # the state is on disk only
    gate = Gate.on_reads(pool)
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(pool.lookup(T, pool.chain(T))))
    reader.start()
    try:
        assert gate.entered.wait(30)
        # The read (and its MAC check) is held: /metrics and /admin still answer.
        assert answers(pool.stats)
        assert answers(pool.describe)
        assert answers(lambda: pool.get(rec.id))
        assert answers(pool.sanity_check)
    finally:
        gate.open.set()
        reader.join(10)
    (lease,) = got
    with lease:
        assert lease.tier == "disk" and bytes(lease.data) == b"S" * 64
    assert pool.stats().counts.promotions == 1


def test_event_loop_calls_answer_while_a_disk_write_is_slow(make_pool: PoolFactory) -> None:
    pool = make_pool()
    gate = Gate.on_writes(pool)
    rec = put(pool, T, b"S" * 64)
    flusher = threading.Thread(target=pool.flush)
    try:
        assert gate.entered.wait(30)
        assert answers(pool.stats)
        assert answers(pool.describe)
        assert answers(lambda: pool.lookup(T, pool.chain(T)).close())  # type: ignore[union-attr]
        flusher.start()
        time.sleep(0.2)
        assert flusher.is_alive()  # flush waits for the write, without the lock
        assert answers(pool.stats)
    finally:
        gate.open.set()
    flusher.join(10)
    assert on_disk(pool) == {rec.id}


def test_close_twice_racing_the_writer_loses_nothing(
    make_pool: PoolFactory, tmp_path: Path
) -> None:
    pool = make_pool()
    gate = Gate.on_writes(pool)
    recs = [put(pool, [i] + T, bytes([i]) * 64) for i in range(3)]
    assert gate.entered.wait(30)  # the writer is inside the first write
    closers = [threading.Thread(target=pool.close) for _ in range(2)]
    for c in closers:
        c.start()
    time.sleep(0.3)
    # Neither close returns while a state is still on its way to the disk.
    assert all(c.is_alive() for c in closers)
    gate.open.set()
    for c in closers:
        c.join(10)
    pool.close()  # and a third, later, changes nothing
    files = {p.stem for p in (tmp_path / "ckpt").glob("*.ckpt")}
    assert files == {r.id for r in recs}
    again = make_pool()
    assert {d["id"] for d in again.describe()} == files


def test_an_evicted_state_waits_in_ram_for_the_writer(make_pool: PoolFactory) -> None:
    # Each entry costs 64 state bytes + H (kept whole) + 4*21 token bytes = 148 + H; the
    # budget holds two.
    budget = 2 * (148 + REST_HEAD_BYTES)
    pool = make_pool(ram=budget)
    gate = Gate.on_writes(pool)
    a = put(pool, [0] + T, b"a" * 64)
    assert gate.entered.wait(30)  # a is being written (pinned), b waits in the queue
    b = put(pool, [1] + T, b"b" * 64)
    inserter = threading.Thread(target=lambda: put(pool, [2] + T, b"c" * 64))
    try:
        inserter.start()
        # c evicts b, which has not reached the disk: its bytes stay, counted, for the
        # writer; c waits for them rather than break the budget.
        assert wait_for(lambda: pool.stats().counts.spills == 1)
        time.sleep(0.1)
        assert inserter.is_alive()
        s = pool.stats()
        assert s.tier("ram").bytes == budget and s.entries == 2
        with pool.lookup([1] + T, pool.chain([1] + T)) as lease:  # type: ignore[union-attr]
            assert lease.tier == "ram" and bytes(lease.data) == b"b" * 64
        pool.sanity_check()
    finally:
        gate.open.set()
    inserter.join(10)
    pool.flush()
    assert len(on_disk(pool)) == 3 and pool.stats().tier("ram").bytes <= budget
    assert {d["id"] for d in pool.describe() if d["tiers"] == ["disk"]} == {b.id}
    with pool.lookup([1] + T, pool.chain([1] + T)) as lease:  # type: ignore[union-attr]
        assert lease.tier == "disk" and bytes(lease.data) == b"b" * 64
    assert a.id in on_disk(pool)


def test_removed_while_being_written_leaves_no_file(
    make_pool: PoolFactory, tmp_path: Path
) -> None:
    pool = make_pool()
    gate = Gate.on_writes(pool)
    rec = put(pool, T, b"S" * 64)
    assert gate.entered.wait(30)
    assert pool.remove(rec.id)
    gate.open.set()
    pool.flush()
    assert wait_for(lambda: pool.stats().write_queue == 0)
    assert not list((tmp_path / "ckpt").glob("*.ckpt"))
    assert pool.stats().tier("disk").bytes == 0 and pool.describe() == []
    pool.sanity_check()
    assert not os.path.exists(tmp_path / "ckpt" / f"{rec.id}.ckpt")
