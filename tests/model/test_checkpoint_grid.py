"""A hybrid's periodic checkpoints go where its prefill's steps end anyway.

A hybrid cannot cut its live state back, so its checkpoints are saved as the prefill
passes them, and each one that falls inside a step ends that step early: a step more.
The share points and the replay point must stay where they are (a new conversation
parts there); the periodic ones need not, and on the grid the other points leave they
cost no step. Before, they sat at multiples of ``cache.periodic_pages`` pages, off the
grid once a share point had shifted it. A request that starts from one answers as the
same request served cold.
"""

from __future__ import annotations

import math
from pathlib import Path

from proxy.engine.engine import Engine
from proxy.engine.types import GenerationRequest, SamplingParams
from statecache.config import load_config
from statecache.records import Kind, Role
from tests.model.runs import assert_as_cold, generate


def _req(prompt: list[int], **kw: object) -> GenerationRequest:
    return GenerationRequest("t", tuple(prompt), SamplingParams(
        temperature=0.0, max_tokens=6, logprobs=4), **kw)  # type: ignore[arg-type]


def test_periodic_points_cost_no_step(hybrid_path: Path, tmp_path: Path) -> None:
    settings = {"model.path": str(hybrid_path), "model.n_ctx": 4096, "server.lanes": 1,
                "cache.disk_enabled": False, "speculative.source": "off",
                "cache.periodic_pages": 16}  # every 512 tokens: one step's worth
    eng = Engine(load_config(None, {**settings, "engine.sanity_checks": True}), hybrid_path)
    cold = Engine(load_config(None, {**settings, "cache.enabled": False}), hybrid_path)
    try:
        assert eng.publisher.kind() is Kind.PARTIAL  # it cannot cut a live lane back
        a = eng.model.tokenize("the instructions every session of this agent shares " * 80)
        a = a[:2600]
        assert len(a) == 2600
        share = 700
        _, _, fin = generate(eng, _req(a, share_points=(share,)))
        # two points of their own, the share point and the replay point (the last page
        # before the prompt's end): 512-token steps to each and from it; periodic points
        # at multiples of 512 made it 8
        replay = (len(a) - 1) // 32 * 32
        assert fin.stats.prefill_steps == math.ceil(share / 512) + math.ceil(
            (replay - share) / 512) + 1 == 7
        assert eng.pool is not None
        rows = eng.pool.describe()
        periodic = sorted(r["n"] for r in rows if r["role"] == Role.PERIODIC.value)
        # between two cuts the steps go short one first (layout.stretch_ends): 188 and
        # 700 to the share point, then 356 and whole steps to the replay point; a
        # periodic point goes at the first step end 512 past the last checkpoint
        assert periodic == [replay - 1024, replay - 512]
        # an edit further on restores the deepest periodic point before it
        b = a[:2400] + eng.model.tokenize(" and then something else entirely " * 6)
        got, _, fin = generate(eng, _req(b))
        assert fin.usage.cached_tokens == replay - 512
        assert_as_cold(cold, _req(b), got, near_tie=0.05)
    finally:
        eng.close()
        cold.close()


def test_share_points_onto_the_grid_save_a_step(hybrid_path: Path) -> None:
    """cache.share_grid_tokens: a share point 76 tokens past a step's end moves there; the
    prefill takes the steps it would take without it, and a new conversation that parts
    at the share point restores those 76 tokens fewer (bench.share_grid counts both on
    the agents' requests) and answers as served cold."""
    settings = {"model.path": str(hybrid_path), "model.n_ctx": 4096, "server.lanes": 1,
                "cache.disk_enabled": False, "speculative.source": "off"}
    cold = Engine(load_config(None, {**settings, "cache.enabled": False}), hybrid_path)
    try:
        for within, steps, reused in ((0, 6, 1100), (128, 5, 1024)):
            eng = Engine(load_config(None, {**settings, "engine.sanity_checks": True,
                                            "cache.share_grid_tokens": within}), hybrid_path)
            try:
                a = eng.model.tokenize("the instructions every session shares " * 80)[:2060]
                assert len(a) == 2060
                _, _, fin = generate(eng, _req(a, share_points=(1100,)))
                # steps end at 512, 1,024, the share point, every 512 after it and the
                # replay point (2,048); on the grid, the share point ends none early
                assert fin.stats.prefill_steps == steps
                assert eng.pool is not None
                fulls = sorted(r["n"] for r in eng.pool.describe() if r["kind"] == "full")
                assert fulls == [reused]
                assert eng.meter.share_points_on_grid.get() == (1 if within else 0)
                b = a[:1100] + eng.model.tokenize(" and now another conversation " * 4)
                got, _, fin = generate(eng, _req(b))
                assert fin.usage.cached_tokens == reused
                assert_as_cold(cold, _req(b), got, near_tie=0.05)
            finally:
                eng.close()
    finally:
        cold.close()
