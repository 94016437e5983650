"""The lanes that decode together stay one run of ids: llama.cpp (kv_unified off) puts
separate lanes in one ubatch only while their ids follow each other, so lanes 0 and 2
take two passes over the weights a step. A request whose conversation a lane holds
beside a gap runs in the free lane that closes it, from a copy of that lane's state;
its answer is the cold one, and the lane it came from keeps its state."""

from __future__ import annotations

import asyncio
from pathlib import Path

from proxy.engine.engine import Engine
from proxy.engine.placement import _runs
from proxy.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from statecache.config import load_config
from tests.busy import THREADS, TINY_COSTS


def test_runs_count_the_ubatches_of_a_step() -> None:
    assert _runs([0, 1, 2, 3]) == 1
    assert _runs([2, 0]) == 2
    assert _runs([1, 3, 0]) == 2
    assert _runs([0, 2, 3, 2]) == 2


async def _one(eng: Engine, rid: str, prompt: tuple[int, ...], max_tokens: int,
               use_cache: bool = True) -> tuple[list[int], FinishEvent]:
    out: list[int] = []
    async for ev in eng.generate(GenerationRequest(
            rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens),
            use_cache=use_cache)):
        if isinstance(ev, TokenEvent):
            out += ev.token_ids
        elif isinstance(ev, FinishEvent):
            return out, ev
    raise AssertionError("no FinishEvent")


def test_a_follow_up_beside_a_gap_moves_next_to_the_busy_lane(hybrid_path: Path) -> None:
    # no drafts: the answers are compared bitwise with cold ones (fact 16)
    cfg = load_config(None, {"model.path": str(hybrid_path), "model.threads": THREADS,
                             "speculative.source": "off",
                             "engine.sanity_checks": True, "model.n_ctx": 2048,
                             "server.lanes": 3, "cache.disk_enabled": False})
    eng = Engine(cfg, hybrid_path)
    tok = eng.model.tokenize
    turns = {k: tuple(tok(f"conversation {k}: tell me about the {k} recurrent state " * 6))
             for k in ("x", "y", "z")}
    try:
        async def go() -> None:
            # one after the other: x, y and z in lanes 0, 1 and 2
            replies = {}
            for k, prompt in turns.items():
                replies[k], fin = await _one(eng, k, prompt, 24)
                assert fin.stats.lane == "xyz".index(k)
            x2 = turns["x"] + tuple(replies["x"]) + tuple(tok(" and then?"))
            z2 = turns["z"] + tuple(replies["z"]) + tuple(tok(" and after that?"))

            async def beside_x(rid: str, prompt: tuple[int, ...], max_tokens: int
                               ) -> tuple[list[int], FinishEvent]:
                # x's follow-up decodes in lane 0; z's would decode in lane 2 beside it
                tx = asyncio.create_task(_one(eng, f"x-{rid}", x2, 200))
                while not eng.exec.lanes.lanes[0].busy:
                    await asyncio.sleep(0.001)
                got = await _one(eng, rid, prompt, max_tokens)
                await tx
                return got

            # a reply of a few tokens is not worth a copy: it runs where its state is
            _, fin = await beside_x("z2-short", z2, 4)
            assert fin.stats.lane == 2 and eng.meter.lane_copies.get() == 0
            held = eng.exec.lanes.lanes[2].tokens.copy()
            # a longer one runs next to lane 0, from a copy of lane 2 cut back to its
            # checkpoint at the prompt's end (with the logits of its last row)
            got, fin = await beside_x("z2", z2, 32)
            assert fin.stats.lane == 1
            assert fin.usage.cached_tokens == len(z2) and fin.stats.prefilled == 0
            assert eng.meter.lane_copies.get() == 1
            assert (eng.exec.lanes.lanes[2].tokens == held).all()  # lane 2 kept its state
            cold, _ = await _one(eng, "z2-cold", z2, 32, use_cache=False)
            assert got == cold
        asyncio.run(go())
    finally:
        eng.begin_shutdown()
        eng.close()


def test_a_request_that_ends_leaves_no_gap_behind(hybrid_path: Path) -> None:
    # x, y and z start together in lanes 0, 1 and 2; y ends first: z, whose state is
    # the smaller, moves into lane 1 (a copy), so x and z decode in one ubatch again
    # no drafts: the answers are compared bitwise with cold ones (fact 16). Whether the
    # copy pays is weighed against a step's time: charged (TINY_COSTS), not measured
    cfg = load_config(None, {"model.path": str(hybrid_path), "model.threads": THREADS,
                             "speculative.source": "off",
                             "engine.sanity_checks": True, "model.n_ctx": 2048,
                             "server.lanes": 3, "cache.disk_enabled": False})
    eng = Engine(cfg, hybrid_path)
    eng.timer.costs = TINY_COSTS
    tok = eng.model.tokenize
    prompts = {k: tuple(tok(f"conversation {k}: tell me about the {k} recurrent state " * n))
               for k, n in (("x", 12), ("y", 6), ("z", 4))}
    sizes = {"x": 300, "y": 8, "z": 300}
    try:
        async def go() -> None:
            got = await asyncio.gather(*(_one(eng, k, p, sizes[k]) for k, p in prompts.items()))
            lanes = [fin.stats.lane for _, fin in got]
            assert lanes == [0, 1, 1], lanes  # z ended in lane 1
            assert eng.meter.lane_moves.get() == 1
            for (out, _), (k, p) in zip(got, prompts.items(), strict=True):
                cold, _ = await _one(eng, f"{k}-cold", p, sizes[k], use_cache=False)
                assert out == cold, k
        asyncio.run(go())
    finally:
        eng.begin_shutdown()
        eng.close()


def test_a_new_conversation_takes_the_lane_that_closes_the_gap_unless_it_is_short(
        hybrid_path: Path) -> None:
    # no drafts: the answers are compared bitwise with cold ones (fact 16)
    cfg = load_config(None, {"model.path": str(hybrid_path), "model.threads": THREADS,
                             "speculative.source": "off",
                             "engine.sanity_checks": True, "model.n_ctx": 2048,
                             "server.lanes": 3, "cache.disk_enabled": False})
    eng = Engine(cfg, hybrid_path)
    tok = eng.model.tokenize
    p = {k: tuple(tok(f"conversation {k}: tell me about the {k} recurrent state " * 5))
         for k in ("a", "b", "c", "new", "other")}
    try:
        async def go() -> None:
            for k in ("a", "b", "c", "b"):  # lanes 0, 1, 2, then 1 again: lane 2 is older
                await _one(eng, k, p[k], 8)

            async def beside_a(rid: str, prompt: tuple[int, ...], max_tokens: int
                               ) -> FinishEvent:
                ta = asyncio.create_task(_one(eng, f"a-{rid}", p["a"], 200))
                while not eng.exec.lanes.lanes[0].busy:
                    await asyncio.sleep(0.001)
                _, fin = await _one(eng, rid, prompt, max_tokens)
                await ta
                return fin

            # a new conversation would go to the least recently used lane, 2, beside a
            # gap: it takes lane 1 (nothing live to copy: a cold start)
            assert (await beside_a("other", p["other"], 64)).stats.lane == 1
            assert eng.meter.lanes_kept_in_line.get() == 1
            assert eng.meter.lane_copies.get() == 0
            # lane 2 is the least recently used again; a reply of a few tokens stays there
            assert (await beside_a("new", p["new"], 4)).stats.lane == 2
            assert eng.meter.lanes_kept_in_line.get() == 1
        asyncio.run(go())
    finally:
        eng.begin_shutdown()
        eng.close()
