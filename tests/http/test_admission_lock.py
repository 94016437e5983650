"""Nothing slow under the lock that the event loop takes.

``generate()``, ``/metrics`` and ``/health`` take the engine's queue lock on the event
loop. Admission must never read a checkpoint from disk, or save one, while holding it.
Here a request waits for another one that is prefilling the prefix they share, while a
copy of a shorter prefix of it lies on disk, and every disk read takes a second: the
HTTP side answers within 50 ms all along.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import aiohttp
import pytest

from statecache.tiers.disk import DiskTier
from tests.http.conftest import DoneLines, serve

pytestmark = pytest.mark.http

SYSTEM = "You are a coding agent working in a repository. " * 45  # about 2,000 tokens
LONG = "".join(f"line {i}: the build log says nothing of interest here. " for i in range(100))


async def _worst_latency(url: str, until: asyncio.Event) -> float:
    worst = 0.0
    async with aiohttp.ClientSession() as http:
        while not until.is_set():
            for path in ("/metrics", "/health"):
                t0 = time.perf_counter()
                async with http.get(url + path) as r:
                    await r.read()
                worst = max(worst, time.perf_counter() - t0)
            await asyncio.sleep(0.02)
    return worst


async def test_metrics_answer_while_admission_would_read_from_disk(
        hybrid_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        done_lines: DoneLines) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", model__n_ctx=16384,
                     cache__ram_budget="64KiB", server__lanes=2) as srv:
        # the system prompt's checkpoints go to disk (the RAM budget holds none)
        first = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi."}]
        await srv.client.chat.completions.create(model="m", messages=first, max_tokens=1,
                                                 temperature=0)
        real = DiskTier.read_file

        def slow_read(self: DiskTier, rec: object, *have: object) -> object:
            time.sleep(1.0)
            return real(self, rec, *have)  # type: ignore[arg-type]

        monkeypatch.setattr(DiskTier, "read_file", slow_read)
        stop = asyncio.Event()
        probe = asyncio.create_task(_worst_latency(srv.url, stop))
        long = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": LONG + "Summarize the log."}]
        a = asyncio.create_task(srv.client.chat.completions.create(
            model="m", messages=long, max_tokens=4, temperature=0))
        await asyncio.sleep(0.4)  # A prefills the log; B shares most of it
        b = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": LONG + "Count the lines."}]
        await srv.client.chat.completions.create(model="m", messages=b, max_tokens=4,
                                                 temperature=0)
        await a
        stop.set()
        worst = await probe
    assert worst < 0.05, f"/metrics or /health took {worst * 1000:.0f} ms"
