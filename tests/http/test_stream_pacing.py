"""server.stream_interval_ms: a stream is written at most once per interval, so a model
that decodes faster costs the event loop, the socket and the client one write for
several tokens; its first and last tokens go at once, and no held token waits through
a step that prefills another request. Where the interval is up is the streams' clock's
to say, held still here (``Streams.clock``): how many tokens a busy machine decodes
within an interval is not what these tests are about."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

import proxy.engine.streams
from proxy.api.app import ENGINE
from tests.http.conftest import Server, serve

pytestmark = pytest.mark.http

PROMPT = "Count the stars. " * 20


async def _chunks(client, max_tokens: int) -> list[tuple[float, str]]:  # type: ignore[no-untyped-def]
    """(arrival time, content) of each chunk that carries content."""
    stream = await client.completions.create(
        model="x", prompt=PROMPT, max_tokens=max_tokens, temperature=0, stream=True)
    out: list[tuple[float, str]] = []
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            out.append((time.perf_counter(), chunk.choices[0].text))
    return out


def _hold_the_clock(srv: Server) -> None:
    """The streams' clock stands still: an interval that started is never up."""
    srv.app[ENGINE].stepper.streams.clock = lambda: 0.0


async def test_a_fast_stream_is_written_in_few_writes_with_the_same_text(
        hybrid_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    writes = [0]  # what the engine hands to the outboxes (the client may see fewer
    deliver = proxy.engine.streams._deliver  # chunks: a loop that lags merges them)

    def counting(job, box):  # type: ignore[no-untyped-def]
        writes[0] += 1
        return deliver(job, box)

    monkeypatch.setattr(proxy.engine.streams, "_deliver", counting)
    # no drafts: a verification's tokens go in one write
    async with serve(hybrid_path, tmp_path / "a", server__stream_interval_ms=0,
                     cache__enabled=False, speculative__source="off") as srv:
        every = await _chunks(srv.client, 120)
    written, writes[0] = writes[0], 0
    async with serve(hybrid_path, tmp_path / "b", server__stream_interval_ms=1000,
                     cache__enabled=False, speculative__source="off") as srv:
        _hold_the_clock(srv)
        paced = await _chunks(srv.client, 120)
    text = "".join(c for _, c in every)
    assert len(text) >= 60
    assert "".join(c for _, c in paced) == text
    # every token its own write against: the first token at once, the rest when the
    # reply ends (the interval is never up)
    assert written >= len(text) // 2, (written, len(text))
    assert writes[0] <= 3 and len(paced) <= 3, (writes, paced)
    assert len(paced[0][1]) <= 2  # one token (a synthetic model's token is a character)


async def test_held_tokens_do_not_wait_through_another_requests_prefill(
        hybrid_path: Path, tmp_path: Path) -> None:
    # A stream paced at one write a second, and a long prompt that prefills beside it in
    # chunks of 64 tokens: before each prefill step the stream's held tokens go out, so
    # it gets more writes during that prefill than the interval alone would allow: none,
    # the clock held still
    async with serve(hybrid_path, tmp_path / "ckpt", server__stream_interval_ms=1000,
                     engine__prefill_chunk=64, cache__enabled=False) as srv:
        _hold_the_clock(srv)
        stream = await srv.client.completions.create(
            model="x", prompt=PROMPT, max_tokens=3000, temperature=0, stream=True)
        arrivals: list[float] = []
        long_done = asyncio.Event()
        window: dict[str, float] = {}

        async def long_request() -> None:
            window["sent"] = time.perf_counter()
            s = await srv.client.completions.create(
                model="x", prompt="Beta gamma delta. " * 80, max_tokens=2, temperature=0,
                stream=True)
            async for chunk in s:
                if chunk.choices and chunk.choices[0].text:
                    window.setdefault("first", time.perf_counter())
            window.setdefault("first", time.perf_counter())
            long_done.set()

        task: asyncio.Task[None] | None = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                arrivals.append(time.perf_counter())
                if task is None:
                    task = asyncio.create_task(long_request())
            if long_done.is_set():
                break
        await stream.close()
        assert task is not None
        await task
    during = [t for t in arrivals if window["sent"] <= t <= window["first"]]
    span = window["first"] - window["sent"]
    assert len(during) >= 3, (len(during), span)
