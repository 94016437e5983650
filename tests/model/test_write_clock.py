"""The streams are written together: one clock for all of them, so the event loop is
woken once per ``server.stream_interval_ms`` for every stream, however their requests
were staggered (a clock per stream drifts out of step with the others, and the loop is
woken for a few of them at a time)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from proxy.engine.engine import Engine
from proxy.engine.outbox import Outbox
from proxy.engine.types import GenerationRequest, SamplingParams, TokenEvent
from statecache.config import load_config
from tests.busy import THREADS

STREAMS = 3


def test_staggered_streams_share_each_wake_up(hybrid_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    wakes: list[tuple[float, int]] = []  # (when, streams woken) per wake-up of the loop
    real = Outbox.wake_all

    def counting(boxes: list[Outbox]) -> None:
        wakes.append((time.perf_counter(), len(boxes)))
        real(boxes)

    monkeypatch.setattr(Outbox, "wake_all", staticmethod(counting))
    cfg = load_config(None, {"model.path": str(hybrid_path), "model.threads": THREADS,
                             "engine.sanity_checks": True, "model.n_ctx": 2048,
                             "server.lanes": STREAMS, "server.stream_interval_ms": 40,
                             "cache.enabled": False})
    eng = Engine(cfg, hybrid_path)
    prompt = tuple(eng.model.tokenize("Count the stars, one by one. " * 4))
    firsts: dict[int, float] = {}
    ends: dict[int, float] = {}
    texts: dict[int, str] = {}

    async def stream(i: int) -> None:
        out: list[str] = []
        async for ev in eng.generate(GenerationRequest(
                f"s{i}", prompt, SamplingParams(temperature=0.0, max_tokens=700),
                use_cache=False)):
            if isinstance(ev, TokenEvent):
                firsts.setdefault(i, time.perf_counter())
                out.append(ev.text)
        ends[i] = time.perf_counter()
        texts[i] = "".join(out)

    async def main() -> None:
        tasks = []
        for i in range(STREAMS):  # each starts 15 ms after the last one's first token
            tasks.append(asyncio.create_task(stream(i)))
            while i not in firsts:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.015)
        await asyncio.gather(*tasks)

    try:
        asyncio.run(main())
    finally:
        eng.begin_shutdown()
        eng.close()
    assert all(len(t) > 100 for t in texts.values())
    together = [n for t, n in wakes if max(firsts.values()) < t < min(ends.values())]
    assert len(together) >= 5, (len(together), wakes)  # a window of several intervals
    # every stream in (nearly) every wake-up; a clock per stream: one or two of them
    assert sum(together) / len(together) >= STREAMS - 0.5, together
