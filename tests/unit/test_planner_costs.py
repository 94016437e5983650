"""The cost rule of the planner (make_plan) on a real pool, no model: a disk copy is read
only when reading it beats prefilling what it saves; RAM and live lanes fetch nothing."""

from __future__ import annotations

import numpy as np

from proxy.engine.binding import MemoryInfo, MemoryKind
from proxy.engine.lanes import Lane
from proxy.engine.planner import Source, make_plan, rank
from statecache.costs import Costs
from statecache.pool import Offer
from tests.unit.conftest import PoolFactory, put

MEM = MemoryInfo(kind=MemoryKind.ATTENTION, n_swa=0, seq_rm_rollback=True, rs_rollback=False,
                 n_rs_seq=0, bytes_per_token=1, bytes_per_lane=0, partial_bytes_per_token=0,
                 partial_bytes_per_lane=0)
PROMPT = np.arange(1, 201, dtype=np.int32)  # 50 pages of 4


def _plan(pool, lanes: list[Lane]):  # type: ignore[no-untyped-def]
    chain = pool.chain(PROMPT)
    return make_plan(PROMPT, chain, lanes, tenant="", memory=MEM, pool=pool,
                     pos_min=lambda _: 0)


def _on_disk_only(make_pool: PoolFactory, n: int, nbytes: int):  # type: ignore[no-untyped-def]
    # a RAM budget smaller than the state sends it straight to disk
    pool = make_pool(ram=64, disk=1 << 24)
    put(pool, PROMPT[:n].tolist(), b"s" * nbytes)
    assert [o.tier for o in pool.full_offers(PROMPT, pool.chain(PROMPT), max_n=199)] == ["disk"]
    return pool


def test_disk_is_read_when_it_beats_the_prefill(make_pool: PoolFactory) -> None:
    pool = _on_disk_only(make_pool, 160, 1 << 20)
    # 1 MiB at 1 GB/s (about 1 ms) against 160 tokens at 1,000 tokens/s (160 ms): read it
    plan = _plan(pool, [Lane(0)])
    assert (plan.source, plan.reuse) == ("disk", 160)
    assert plan.estimate.startswith("est. disk ") and "vs cold 200 ms" in plan.estimate
    plan.release()


def test_disk_is_skipped_when_prefilling_is_cheaper(make_pool: PoolFactory) -> None:
    pool = _on_disk_only(make_pool, 160, 1 << 20)
    pool.costs.note_read("disk", 1 << 20, 1.0)  # a slow disk: 1 MiB/s
    pool.costs.note_prefill(100_000, 1.0)  # a fast prefill: 160 tokens in 1.6 ms
    plan = _plan(pool, [Lane(0)])
    assert (plan.source, plan.reuse, plan.full) == (Source.COLD, 0, None)
    assert pool.stats().tier("disk").hits == 0  # not even read


def test_a_live_lane_beats_a_slow_deeper_copy(make_pool: PoolFactory) -> None:
    pool = _on_disk_only(make_pool, 160, 1 << 20)
    lane = Lane(0)
    lane.set_tokens(PROMPT[:150], "")
    pool.costs.note_read("disk", 1 << 20, 0.5)  # 0.5 s to read 10 tokens' worth
    plan = _plan(pool, [lane])
    assert (plan.source, plan.reuse) == (Source.LANE, 150)


def test_ranking_puts_the_cheapest_first_and_nearer_tiers_on_ties() -> None:
    c = Costs()
    c.note_prefill(1_000, 1.0)
    c.note_read("remote", 100 << 20, 1.0)
    offers = [Offer("remote", 190, 50 << 20), Offer("disk", 180, 1 << 20), Offer("ram", 100, 9)]
    ranked = [(o.tier, o.n) for _, o in rank(offers, c, 200)]
    # remote: 0.5 s + 10 ms; disk: ~1 ms + 20 ms; ram: 100 ms
    assert ranked == [("disk", 180), ("ram", 100), ("remote", 190)]
    tie = [Offer("remote", 100, 0), Offer("ram", 100, 0)]
    assert [o.tier for _, o in rank(tie, c, 200)] == ["ram", "remote"]
