"""Faults inside the engine: a dead engine thread fails everyone loudly, a request that
fails alone ends alone and publishes nothing, and a hybrid lane handed off keeps its
history's replay point."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import openai
import pytest

from proxy.api.app import ENGINE
from proxy.engine.engine import Engine
from statecache.records import Kind, Role
from tests.http.agent import Session, user_message
from tests.http.conftest import DoneLines, serve
from tests.http.test_sessions import NEAR_TIE, PAGE, _same_as_cold

pytestmark = pytest.mark.http

HELLO: list[Any] = [{"role": "user", "content": "Hello"}]


async def test_engine_thread_failure_fails_requests_and_health(
    hybrid_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        engine: Engine = srv.app[ENGINE]  # type: ignore[assignment]

        def broken(*_a: object) -> list[object]:
            raise RuntimeError("a bug outside the per-request guards")

        monkeypatch.setattr(engine.stepper, "run", broken)
        with pytest.raises(openai.InternalServerError):
            await asyncio.wait_for(srv.client.chat.completions.create(
                model="x", messages=HELLO, max_tokens=4), timeout=30)
        health = await srv.client.with_raw_response.models.list()
        assert health.http_response.status_code == 200  # the HTTP side still answers
        resp = await srv.client._client.get(f"{srv.url}/health")  # noqa: SLF001
        assert resp.status_code == 503
        assert "engine stopped" in resp.json()["error"]
        with pytest.raises(openai.InternalServerError):  # at once, not after a hang
            await asyncio.wait_for(srv.client.chat.completions.create(
                model="x", messages=HELLO, max_tokens=4), timeout=10)


async def test_request_failing_mid_start_leaves_its_lane_cleared(
    hybrid_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=1) as srv:
        engine: Engine = srv.app[ENGINE]  # type: ignore[assignment]
        s = Session(srv.client, max_tokens=8)
        await s.turn()
        lane = engine.exec.lanes.lanes[0]
        assert lane.n > 0
        real = engine.restorer.carry_out

        def half_then_fail(plan: Any, job: Any) -> None:
            real(plan, job)
            raise RuntimeError("failed after the restore")

        monkeypatch.setattr(engine.restorer, "carry_out", half_then_fail)
        with pytest.raises(openai.InternalServerError):
            await s.turn(user_message(1))
        assert lane.n == 0 and not lane.busy
        assert engine.ctx.pos_max(0) == -1  # the llama.cpp sequence is empty too
        assert engine.pool is not None
        assert not [r for r in engine.pool.describe() if r.get("lane") == 0]
        monkeypatch.undo()
        s.messages.pop()
        again = await s.turn(user_message(1))  # the lane serves the next request
        assert again.completion_tokens > 0


async def test_a_failing_lane_ends_alone_and_publishes_nothing(
    hybrid_path: Path, tmp_path: Path, done_lines: DoneLines, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=2,
                     engine__idle_save_s=0) as srv:
        engine: Engine = srv.app[ENGINE]  # type: ignore[assignment]
        take = engine.exec.emitter.take

        def fail_for_the_bad_one(job: Any, row: int, logits: Any = None) -> None:
            if len(job.out.generated) == 3 and \
                    "BAD" in engine.model.detokenize(list(job.req.prompt_tokens)):
                raise RuntimeError("sampling failed for this lane")
            take(job, row, logits)

        monkeypatch.setattr(engine.exec.emitter, "take", fail_for_the_bad_one)
        good = Session(srv.client, system="Good one. " * 30, max_tokens=60)
        bad = Session(srv.client, system="BAD one. " * 30, max_tokens=60)
        results = await asyncio.gather(good.turn(), bad.turn(), return_exceptions=True)
        assert not isinstance(results[0], BaseException), results[0]
        assert isinstance(results[1], openai.InternalServerError), results[1]
        assert engine.pool is not None
        ends = [r for r in engine.pool.describe() if r["role"] == Role.END_OF_REPLY.value]
        assert len(ends) == 1  # the good one's; nothing from the failed request
        assert sum(ln.n == 0 for ln in engine.exec.lanes) == 1  # the failed lane is cleared
    await _same_as_cold(hybrid_path, tmp_path, good.turns, 60, NEAR_TIE["hybrid"])


async def test_handed_off_hybrid_lane_keeps_the_history_replay_point(
    hybrid_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    # The client strips reasoning, so the follow-up can only resume at the replay point
    # of turn 1's history. Another conversation takes the only lane in between: the
    # hand-off must keep that point as a FULL checkpoint, not only the prompt's end.
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=1,
                     engine__idle_save_s=0) as srv:
        engine: Engine = srv.app[ENGINE]  # type: ignore[assignment]
        s = Session(srv.client, keep_reasoning=False, max_tokens=24)
        t1 = await s.turn()
        other = Session(srv.client, system="Someone else entirely. " * 20, max_tokens=4)
        await other.turn()
        assert engine.pool is not None
        fulls = {r["n"] for r in engine.pool.describe()
                 if r["kind"] == Kind.FULL.value and r["role"] == Role.REPLAY.value}
        t2 = await s.turn(user_message(1))
    history = t1.prompt_tokens - len("<|im_start|>assistant\n<think>\n")
    assert (history // PAGE) * PAGE in fulls, fulls
    assert t2.cached_tokens >= (history // PAGE) * PAGE, (t2.cached_tokens, history)
    await _same_as_cold(hybrid_path, tmp_path, s.turns, 24, NEAR_TIE["hybrid"])
