"""The planner under ``cache.exact`` (make_plan's ``grid``), no model: it starts a prompt
only where a cold prefill's state is (docs/exact.md): on the grid, or the whole prompt
with its logits; a live lane only within what grid prefills wrote (``Lane.grid_n``)."""

from __future__ import annotations

import dataclasses

import numpy as np

from proxy.engine.binding import MemoryKind
from proxy.engine.grid import exact_at
from proxy.engine.lanes import Lane
from proxy.engine.planner import Source, make_plan
from tests.unit.conftest import PoolFactory, put
from tests.unit.test_planner_costs import MEM

PROMPT = np.arange(1, 201, dtype=np.int32)  # 50 pages of 4
GRID = 64


def _plan(pool, lanes: list[Lane], memory=MEM, grid=GRID):  # type: ignore[no-untyped-def]
    return make_plan(PROMPT, pool.chain(PROMPT), lanes, tenant="", memory=memory, pool=pool,
                     pos_min=lambda _: 0, grid=grid)


def test_exact_at() -> None:
    assert exact_at(128, 200, 64) and exact_at(200, 200, 64) and not exact_at(160, 200, 64)
    assert exact_at(256, 256, 64)  # the whole prompt, which ends on the grid
    assert not exact_at(256, 200, 64)


def test_a_checkpoint_off_the_grid_is_passed_over(make_pool: PoolFactory) -> None:
    pool = make_pool(ram=1 << 24)
    put(pool, PROMPT[:160].tolist(), b"s" * 100)  # off the grid of 64
    put(pool, PROMPT[:128].tolist(), b"s" * 100)
    plan = _plan(pool, [Lane(0)])
    assert (plan.source, plan.reuse) == ("ram", 128)
    plan.release()
    plan = _plan(pool, [Lane(0)], grid=0)  # the default mode takes the deeper one
    assert plan.reuse == 160
    plan.release()


def test_a_live_lane_is_cut_back_to_the_grid_within_what_prefill_wrote(
        make_pool: PoolFactory) -> None:
    pool = make_pool(ram=1 << 24)
    lane = Lane(0)
    lane.set_tokens(PROMPT[:190], "")
    lane.grid_n = 150  # 150 prompt tokens prefilled, 40 decoded
    plan = _plan(pool, [lane])
    assert (plan.source, plan.reuse, plan.truncate) == (Source.LANE, 128, True)
    lane.grid_n = 100  # the grid point 128 holds decoded tokens: 64 is the last exact one
    plan = _plan(pool, [lane])
    assert plan.reuse == 64
    lane.grid_n = 0  # a state from decode or a default-mode checkpoint: never
    assert _plan(pool, [lane]).source == Source.COLD


def test_a_hybrid_or_swa_lane_is_not_cut_back_in_place(make_pool: PoolFactory) -> None:
    pool = make_pool(ram=1 << 24)
    lane = Lane(0)
    lane.set_tokens(PROMPT[:190], "")
    lane.grid_n = 150
    for kind in (MemoryKind.SWA, MemoryKind.HYBRID):
        mem = dataclasses.replace(MEM, kind=kind)
        assert _plan(pool, [lane], memory=mem).source == Source.COLD
    lane.truncate(128)  # a lane that ends on the grid goes on as it is
    plan = _plan(pool, [lane], memory=dataclasses.replace(MEM, kind=MemoryKind.SWA))
    assert (plan.source, plan.reuse, plan.truncate) == (Source.LANE, 128, False)
