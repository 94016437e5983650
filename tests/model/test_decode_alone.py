"""One stream with nothing else to do runs steps of its own (``Stepper._decode_alone``),
without planning each one: the same tokens as a plain greedy loop on the binding, and
the run ends as soon as something else needs the engine (a request arrives, the stream
is cancelled)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from proxy.engine.binding import Context, ContextParams
from proxy.engine.engine import Engine
from proxy.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from statecache.config import load_config
from tests.busy import THREADS

PROMPT = tuple(int(t) for t in np.arange(60) * 37 % 200 + 10)
OTHER = tuple(int(t) for t in np.arange(40) * 53 % 190 + 12)
LONG_MS = 60_000  # a lone run that would outlast every test here unless something ends it


def _engine(path: Path, lone_run_ms: float = 250.0) -> Engine:
    # no drafts: a lone stream's own steps, one token each (drafting has its tests)
    return Engine(load_config(None, {"model.path": str(path), "model.threads": THREADS,
                                     "engine.sanity_checks": True, "model.n_ctx": 2048,
                                     "server.lanes": 2, "cache.enabled": False,
                                     "speculative.source": "off",
                                     "engine.lone_run_ms": lone_run_ms}), path)


def _request(rid: str, prompt: tuple[int, ...], max_tokens: int) -> GenerationRequest:
    return GenerationRequest(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens))


async def _collect(eng: Engine, req: GenerationRequest, done: list[str],
                   ids: list[int] | None = None) -> tuple[list[int], FinishEvent]:
    ids = [] if ids is None else ids
    async for ev in eng.generate(req):
        if isinstance(ev, TokenEvent):
            ids += ev.token_ids
        elif isinstance(ev, FinishEvent):
            done.append(req.request_id)
            return ids, ev
    raise AssertionError("no FinishEvent")


def _greedy(eng: Engine, prompt: tuple[int, ...], n: int) -> list[int]:
    """``n`` tokens of a plain greedy loop on the binding: the prompt in one batch, then
    one token a decode, as the engine runs a lone stream."""
    ctx = Context(eng.model, ContextParams(n_ctx=2048, n_batch=512, n_ubatch=512,
                                           threads=THREADS))
    with ctx:
        logits = ctx.prefill(0, prompt, 0)
        assert logits is not None
        out, pos = [int(logits.argmax())], len(prompt)
        while len(out) < n and not eng.model.is_eog(out[-1]):
            ctx.prefill(0, [out[-1]], pos)
            pos += 1
            out.append(int(ctx.logits_view(-1).argmax()))
        return out


@pytest.mark.parametrize("fixture", ["hybrid_path", "gemma_path"])
@pytest.mark.parametrize("lone_run_ms", [250.0, 0.0])
def test_a_lone_stream_decodes_what_a_plain_greedy_loop_does(
        fixture: str, lone_run_ms: float, request: pytest.FixtureRequest) -> None:
    eng = _engine(request.getfixturevalue(fixture), lone_run_ms)
    try:
        ids, fin = asyncio.run(_collect(eng, _request("a", PROMPT, 40), []))
        assert ids == _greedy(eng, PROMPT, 40)
        assert fin.reason in ("length", "stop") and fin.usage.completion_tokens >= len(ids) - 1
        # every token after the first came from a lone run (the first: the prefill's),
        # unless they are off: every step planned
        alone = len(ids) - 1 if lone_run_ms else 0
        assert eng.meter.steps_alone.get() == alone
        assert eng.meter.steps.get() == len(ids)
    finally:
        eng.close()


def test_a_request_that_arrives_ends_the_lone_run(hybrid_path: Path) -> None:
    eng = _engine(hybrid_path, LONG_MS)
    done: list[str] = []

    async def go() -> tuple[list[int], list[int]]:
        got: list[int] = []
        long = asyncio.create_task(_collect(eng, _request("long", PROMPT, 600), done, got))
        while len(got) < 20:  # the long one is decoding alone
            await asyncio.sleep(0.005)
        short_ids, _ = await _collect(eng, _request("short", OTHER, 4), done)
        long_ids, _ = await long
        return long_ids, short_ids

    try:
        long_ids, short_ids = asyncio.run(go())
        # the short request did not wait for the long one's run (of up to LONG_MS)
        assert done == ["short", "long"], done
        assert eng.meter.steps_multi_lane.get() >= 3
        assert short_ids and len(long_ids) == 600
        # and the long one went on alone once the short one was gone
        assert eng.meter.steps_alone.get() > 20 + eng.meter.steps_multi_lane.get()
    finally:
        eng.close()


def test_a_cancelled_lone_stream_stops_at_once(hybrid_path: Path) -> None:
    eng = _engine(hybrid_path, LONG_MS)

    async def go() -> int:
        got = 0
        gen = eng.generate(_request("c", PROMPT, 1500))
        async for ev in gen:
            if isinstance(ev, TokenEvent):
                got += len(ev.token_ids)
                if got >= 5:
                    break
        await gen.aclose()  # the client went away
        return got

    try:
        asyncio.run(go())
        deadline = time.monotonic() + 30
        while eng.queue()["active_requests"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert eng.queue()["active_requests"] == 0
        steps = eng.meter.steps_alone.get()
        time.sleep(0.1)
        assert eng.meter.steps_alone.get() == steps  # nothing decodes any more
        assert steps < 1000, "the cancelled stream decoded on to its limit"
        # the engine serves the next request from the same lanes, correctly
        ids, _ = asyncio.run(_collect(eng, _request("next", OTHER, 12), []))
        assert ids == _greedy(eng, OTHER, 12)
    finally:
        eng.close()
