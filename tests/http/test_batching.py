"""One batch per engine step: concurrent sessions, cancellation, mixed prefill and decode,
and subagents that share their parent's prefix. Every answer is compared with the same
request served alone with caching off (the near-tie rule: the batch schedule changes)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from proxy.api.app import ENGINE
from tests.busy import TINY_COSTS
from tests.http.agent import TOOLS, Session, Turn, ask, tool_result, user_message
from tests.http.conftest import DoneLines, Hold, serve
from tests.http.test_sessions import NEAR_TIE, PAGE, _same_as_cold

pytestmark = pytest.mark.http


@pytest.mark.parametrize("which", ["hybrid", "gemma", "draft"])
async def test_four_concurrent_sessions_match_cold_answers(
    which: str, request: pytest.FixtureRequest, tmp_path: Path, done_lines: DoneLines
) -> None:
    # Four sessions on two lanes: steps carry both lanes, lanes are handed off and
    # restored from checkpoints while the others decode.
    model: Path = request.getfixturevalue(f"{which}_path")
    turns = 2 if which == "gemma" else 3
    splice = which == "gemma"
    async with serve(model, tmp_path / "ckpt", server__lanes=2,
                     cache__splice_generated=splice) as srv:
        sessions = [Session(srv.client, system=f"Session {i}. " * 40, max_tokens=24)
                    for i in range(4)]

        async def run(s: Session) -> None:
            await s.turn()
            for k in range(1, turns):
                await s.turn(tool_result(k) if k % 2 else user_message(k))

        await asyncio.gather(*(run(s) for s in sessions))
        m = srv.app[ENGINE].meter
    assert m.steps_multi_lane.get() > 0, "no step carried two lanes"
    assert m.checkpoints_saved.get() > 0
    assert any(("ram" in e or "disk" in e) for e in done_lines.events), done_lines.events
    all_turns: list[Turn] = [t for s in sessions for t in s.turns]
    await _same_as_cold(model, tmp_path, all_turns, 24, NEAR_TIE[which])


async def test_two_streams_share_each_step(hybrid_path: Path, tmp_path: Path) -> None:
    # Two streams decoding at once cost one llama_decode per token, not two. Both are
    # in before the engine takes a step (held): a stream that arrived after the other
    # had decoded half its reply, as a busy machine's event loop can have it, would
    # share fewer steps than that; and the drafts each lane verifies (a step of several
    # of its tokens) are chosen by costs charged, not by a busy machine's seconds
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=2,
                     costs=TINY_COSTS) as srv:
        engine = srv.app[ENGINE]
        a = Session(srv.client, system="Alpha. " * 30, max_tokens=80)
        b = Session(srv.client, system="Beta. " * 30, max_tokens=80)
        with Hold(srv) as hold:
            both = asyncio.gather(a.turn(), b.turn())
            await hold.until_held()
            await hold.until_in(2)
        await both
        m = engine.meter
    each = [t.completion_tokens for t in a.turns + b.turns]
    assert min(each) >= 50
    # while both decode, a step carries both lanes; one lane per step would make this 0
    assert m.steps_multi_lane.get() >= 0.5 * min(each), m
    assert m.steps.get() < sum(each), m
    await _same_as_cold(hybrid_path, tmp_path, a.turns + b.turns, 80, NEAR_TIE["hybrid"])


async def test_cancelled_lane_leaves_the_other_correct(hybrid_path: Path,
                                                       tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=2) as srv:
        keep = Session(srv.client, system="Keeper. " * 30, max_tokens=120)
        keep_task = asyncio.create_task(keep.turn())
        stream = await srv.client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "Leaver " * 40}],
            max_tokens=400, temperature=0, stream=True)
        got = 0
        async for _chunk in stream:
            got += 1
            if got == 5:
                break
        await stream.close()  # the client leaves mid-generation
        await keep_task
        engine = srv.app[ENGINE]
        for _ in range(100):
            if engine.queue()["active_requests"] == 0:
                break
            await asyncio.sleep(0.05)
        assert engine.queue()["active_requests"] == 0
    await _same_as_cold(hybrid_path, tmp_path, keep.turns, 120, NEAR_TIE["hybrid"])


async def test_decoding_stream_keeps_going_during_a_long_prefill(
    hybrid_path: Path, tmp_path: Path
) -> None:
    # A stream decodes; a 3,000-token prompt arrives. Steps beside a decoding stream
    # carry only a measured slice of prefill, so the stream gets tokens all along
    # instead of one per 512-token chunk. (Measured: the costs charged, not the
    # seconds a busy machine takes, size each slice and the stream's turn.)
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=2,
                     costs=TINY_COSTS) as srv:
        stream = await srv.client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "Stream " * 20}],
            max_tokens=1500, temperature=0, stream=True)
        arrivals: list[tuple[float, int]] = []

        async def read() -> None:
            async for chunk in stream:
                if chunk.choices:
                    d = chunk.choices[0].delta
                    text = (d.content or "") + ((d.model_extra or {}).get(
                        "reasoning_content") or "")
                    arrivals.append((time.monotonic(), len(text)))

        reader = asyncio.create_task(read())
        while len(arrivals) < 10:
            await asyncio.sleep(0.01)
        t_long = time.monotonic()
        long = await srv.client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "word " * 600}],
            max_tokens=1, temperature=0, stream=True)
        async for _ in long:
            t_first = time.monotonic()
            break
        await long.close()
        await stream.close()
        reader.cancel()
    during = sum(n for t, n in arrivals if t_long <= t <= t_first)
    # 3,000 tokens at 512 per step would be 6 steps: the stream would get about 6
    assert during >= 30, (during, t_first - t_long)


async def test_short_request_behind_a_long_one_starts_first(
    hybrid_path: Path, tmp_path: Path
) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=2,
                     engine__step_tokens=64) as srv:
        order: list[str] = []

        async def first_token(name: str, content: str) -> None:
            s = await srv.client.chat.completions.create(
                model="x", messages=[{"role": "user", "content": content}],
                max_tokens=1, temperature=0, stream=True)
            async for _ in s:
                order.append(name)
                break
            await s.close()

        # the short one arrives while the long prompt is being prefilled: the engine is
        # held at the long one's first step until it is in
        with Hold(srv, lambda active: any(job.prefilling for job, _ in active)) as hold:
            long = asyncio.create_task(first_token("long", "word " * 600))
            await hold.until_held()
            short = asyncio.create_task(first_token("short", "Hi"))
            await hold.until_in(2)
        await short
        await long
    assert order == ["short", "long"]


def _shared_system(n: int) -> str:
    return "Rules for every agent: keep functions short and tested. " * n


async def test_subagents_started_together_share_the_prefix_once(
    hybrid_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    # A main agent and two subagents share a long system prompt and tools; the
    # subagents are launched together, twice. Only the first request prefills the
    # shared prefix; every later one reuses it (no side-by-side prefill of it).
    system = _shared_system(30)  # about 1,700 tokens
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=3) as srv:
        main = Session(srv.client, system=system, max_tokens=16)
        await main.turn()
        subs: list[Session] = []
        for launch in range(2):
            pair = [Session(srv.client, system=system, max_tokens=16,
                            messages=[{"role": "system", "content": system},
                                      {"role": "user", "content": f"Subtask {launch}.{i}: "
                                       "list the files under tests/."}])
                    for i in range(2)]
            await asyncio.gather(*(s.turn() for s in pair))
            subs += pair
            await main.turn(tool_result(launch + 1))
    shared = len(system)  # one token per character on the synthetic vocabulary
    rows = done_lines.rows
    assert rows[0][1] == 0  # the very first request is cold
    for i, (n_in, cached, _prefilled) in enumerate(rows[1:], 1):
        assert cached >= min(shared, n_in - 1) - PAGE, (i, rows)
    reusable = sum(min(n_in - 1, shared) for n_in, _, _ in rows[1:])
    reused = sum(min(cached, shared) for _, cached, _ in rows[1:])
    assert reused / reusable >= 0.98, rows
    await _same_as_cold(hybrid_path, tmp_path, [t for s in subs for t in s.turns], 16,
                        NEAR_TIE["hybrid"])


async def test_concurrent_cold_requests_wait_for_the_shared_prefix(
    hybrid_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    # Nothing is cached; three requests with one system prompt arrive at once. One
    # prefills it and publishes a FULL checkpoint there; the others start from it.
    system = _shared_system(20)
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=3) as srv:
        convs: list[list[dict[str, Any]]] = [
            [{"role": "system", "content": system}, {"role": "user", "content": f"Task {i}"}]
            for i in range(3)]
        replies = await asyncio.gather(*(ask(srv.client, c, 12, tools=TOOLS) for c in convs))
    cached = sorted(r["cached_tokens"] for r in replies)
    assert cached[0] == 0
    assert all(c >= len(system) - PAGE for c in cached[1:]), cached
    turns = [Turn(c, r["text"], r["tokens"], r["message"], r["prompt_tokens"],
                  r["completion_tokens"], r["cached_tokens"]) for c, r in zip(convs, replies,
                                                                               strict=True)]
    await _same_as_cold(hybrid_path, tmp_path, turns, 12, NEAR_TIE["hybrid"])


async def test_subagent_arriving_while_another_decodes_reuses_the_branch_point(
    hybrid_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    # The first subagent branched off the main agent's prefix: it published a FULL
    # checkpoint there. A second one arrives while the first still decodes in the lane
    # that holds the prefix, so only that FULL checkpoint can serve it.
    system = _shared_system(30)
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=3) as srv:
        main = Session(srv.client, system=system, max_tokens=16)
        await main.turn()
        first = Session(srv.client, system=system, max_tokens=400, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "Subtask A"}])
        # the second arrives once the first decodes: the engine is held at the first
        # step after its first token until the second is in (a first subagent that
        # ran to its end before the second arrived, as a fast machine could have it,
        # would prove nothing)
        second = Session(srv.client, system=system, max_tokens=16, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "Subtask B"}])
        with Hold(srv, lambda active: any(job.req.sampling.max_tokens == 400 and
                                          job.out.generated for job, _ in active)) as hold:
            task = asyncio.create_task(first.turn())
            await hold.until_held()
            turn = asyncio.create_task(second.turn())
            await hold.until_in(2)
        await turn
        assert not task.done(), "the first subagent was meant to still be decoding"
        await task
    assert second.turns[0].cached_tokens >= len(system) - PAGE, done_lines.events
    await _same_as_cold(hybrid_path, tmp_path, second.turns, 16, NEAR_TIE["hybrid"])


async def test_subagents_of_a_new_main_agent_start_from_its_system_prompt(
    hybrid_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    # The main agent's first request is its system prompt and one user message: the
    # subagents diverge from it right after the system prompt, where no replay point
    # is. The first turn's end is published in FULL, so both start there, and the
    # main agent keeps its lane.
    system = _shared_system(30)
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=3) as srv:
        main = Session(srv.client, system=system, max_tokens=16, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": "Fix it."}])
        await main.turn()
        subs = [Session(srv.client, system=system, max_tokens=16, messages=[
            {"role": "system", "content": system},
            {"role": "user", "content": f"Subtask {i}: list the files."}]) for i in range(2)]
        await asyncio.gather(*(s.turn() for s in subs))
        await main.turn(user_message(1))
    for s in subs:
        assert s.turns[0].cached_tokens >= len(system) - PAGE, done_lines.events
    assert "(live, lane)" in done_lines.events[-2], done_lines.events
    await _same_as_cold(hybrid_path, tmp_path, [t for s in subs for t in s.turns], 16,
                        NEAR_TIE["hybrid"])
