"""Gemma 3 with a window-sized SWA cache (``model.swa_full = false``, docs/design.md fact
25) through the real server and the openai client, with prompts past its 512-token
window: follow-ups prefill only what is new, an edit that goes back further than the
window is served from the lane's partial checkpoint, two sessions run on two lanes at
once, a new session starts from the first turn's FULL share point, and prompt lookup
drafts; every answer is the same request's on a cache-off server in the same mode (the
near-tie rule of fact 10).

The edits fail where the window-sized cache is handled like the full-size one (no
partial checkpoints in the lane: the lane cannot go back past its window, and the edit
starts cold: checked by flipping ``MemoryInfo.full_size_swa``). The follow-ups, the new
session and prompt lookup cut a lane back less than a window (or not at all), where
``seq_rm`` is right in either handling: they check this mode's answers and reuse."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from proxy.api.app import ENGINE
from tests.http.agent import (
    SYSTEM,
    Session,
    Turn,
    ask,
    assert_same_or_near_tie,
    tool_result,
    user_message,
)
from tests.http.conftest import DoneLines, Server, serve
from tests.http.test_sessions import NEAR_TIE, _check_follow_ups

pytestmark = pytest.mark.http
WINDOW = {"model__swa_full": False, "cache__splice_generated": True}

# about 750 words: past Gemma 3's window from the first turn
LONG_SYSTEM = SYSTEM + " ".join(
    f"Rule {i}: read module {i % 17} before changing it, then run its tests again."
    for i in range(50))


def _session(srv: Server, system: str = LONG_SYSTEM, max_tokens: int = 32) -> Session:
    """An agent session without tools in the request: Gemma 3's replies then render back
    as generated (with splicing), so a follow-up reuses them."""
    return Session(srv.client, system=system, max_tokens=max_tokens, kwargs={})


def long_result(turn: int, edited: bool = False) -> dict[str, Any]:
    """A tool result of about 800 tokens: the lane goes on further than the window."""
    head = "EDITED: the run was repeated.\n" if edited else ""
    body = "\n".join(f"tests/test_pool.py::test_case_{turn}_{i} FAILED  assert "
                     f"pool.evict({i}) == [{i}, {i + 1}, {i + 2}]" for i in range(36))
    return {"role": "tool", "tool_call_id": f"call_{turn}", "content": head + body}


async def _same_as_cold(model: Path, tmp: Path, turns: list[Turn], max_tokens: int,
                        **overrides: Any) -> None:
    """Each request again on a cache-off server with the same SWA cache: the same answer
    (near-tie rule)."""
    async with serve(model, tmp / "cold", cache__enabled=False, server__lanes=1,
                     model__swa_full=False, **overrides) as cold:
        for t in turns:
            reply = await ask(cold.client, t.messages, max_tokens)
            assert reply["prompt_tokens"] == t.prompt_tokens
            assert_same_or_near_tie(t.tokens, reply["tokens"], NEAR_TIE["gemma"])


async def test_window_session_prefills_only_new_tokens(
    gemma_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    async with serve(gemma_path, tmp_path / "ckpt", **WINDOW) as srv:
        assert srv.app[ENGINE].parts.memory.swa_window
        s = _session(srv)
        await s.turn()
        for k in range(1, 4):
            await s.turn(tool_result(k) if k % 2 else user_message(k))
    assert s.turns[0].prompt_tokens > 2 * 512  # past the window from the first turn
    _check_follow_ups(s, done_lines)
    await _same_as_cold(gemma_path, tmp_path, s.turns, s.max_tokens)


async def _edit_past_the_window(s: Session) -> tuple[Turn, Turn]:
    """Turns 1 and 2 (a long tool result), then turn 2 again with that result edited at
    its start: the prompt leaves the lane about 800 tokens before the lane's end."""
    await s.turn()
    t2 = await s.turn(long_result(1))
    s.messages = s.messages[:-2]  # the result and its reply
    t3 = await s.turn(long_result(1, edited=True))
    return t2, t3


def _served_from_the_lanes_checkpoint(t2: Turn, t3: Turn) -> None:
    """The edit reuses all that turn 2 reused of turn 1 (the lane's PARTIAL checkpoint
    at turn 1's reply end, restored, then the lane cut), from further back than the
    window: seq_rm alone cannot cut a window-sized lane back there. Without partial
    checkpoints only the FULL share point at the first user message's end is left,
    tens of tokens short."""
    assert t2.cached_tokens > 2 * 512
    assert t3.cached_tokens >= t2.cached_tokens, (t3.cached_tokens, t2.cached_tokens)
    assert t2.prompt_tokens + t2.completion_tokens - t3.cached_tokens > 512 + 100


async def test_an_edit_past_the_window_restores_the_lanes_partial_checkpoint(
    gemma_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    async with serve(gemma_path, tmp_path / "ckpt", **WINDOW) as srv:
        s = _session(srv)
        t2, t3 = await _edit_past_the_window(s)
        lanes = srv.app[ENGINE].parts.lanes
        # one lane did it all: it went back by restoring, not by starting elsewhere
        assert sum(1 for ln in lanes if ln.n) == 1
    _served_from_the_lanes_checkpoint(t2, t3)
    assert "(end-of-reply, lane)" in done_lines.events[-2], done_lines.events[-2]
    await _same_as_cold(gemma_path, tmp_path, s.turns, s.max_tokens)


async def test_two_sessions_on_two_lanes_then_a_new_one_from_the_share_point(
    gemma_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    other = LONG_SYSTEM.replace("coding agent", "careful coding agent")
    async with serve(gemma_path, tmp_path / "ckpt", **WINDOW) as srv:
        a = _session(srv)
        b = _session(srv, other)
        (a2, a3), (b2, b3) = await asyncio.gather(_edit_past_the_window(a),
                                                  _edit_past_the_window(b))
        assert sorted(ln.n > 0 for ln in srv.app[ENGINE].parts.lanes) == [True, True]
        # a new conversation with session a's first turn: the FULL state at its share
        # point (the first turn's end, 1,056 tokens) restored into a lane. It lies
        # inside the first turn's last step and is saved behind it, where it is
        # (docs/design.md fact 27): before, it went down onto the step grid, to 1,024
        c = _session(srv)
        c.messages = c.messages[:4] + [user_message(9)]
        c1 = await c.turn()
    _served_from_the_lanes_checkpoint(a2, a3)
    _served_from_the_lanes_checkpoint(b2, b3)
    assert c1.cached_tokens > 2 * 512
    await _same_as_cold(gemma_path, tmp_path, a.turns + b.turns + c.turns, a.max_tokens)


CODE = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(12))


async def test_prompt_lookup_on_a_window_sized_cache(
    gemma_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    async with serve(gemma_path, tmp_path / "ckpt", speculative__source="lookup",
                     speculative__adaptive=False, **WINDOW) as srv:
        s = _session(srv, max_tokens=64)
        await s.turn()
        await s.turn({"role": "user", "content": "Copy this code exactly:\n" + CODE})
        await s.turn(long_result(2))
        m = srv.app[ENGINE].meter
    assert m.spec_tokens.get("drafted") > m.spec_tokens.get("accepted") > 0, m
    _check_follow_ups(s, done_lines)
    await _same_as_cold(gemma_path, tmp_path, s.turns, s.max_tokens)
