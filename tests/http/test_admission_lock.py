"""Nothing slow under the lock that the event loop takes.

``generate()``, ``/metrics`` and ``/health`` take the engine's queue lock on the event
loop. Admission must never read a checkpoint from disk, or save one, while holding it.
Here a request waits for another one that is prefilling the prefix they share, while a
copy of a shorter prefix of it lies on disk, and every disk read takes a second: the
queue lock is free all along each read, and the HTTP side answers meanwhile. (The lock
is checked, not the answers' latency: on a busy machine the event loop waits for the
GIL and the cores, lock or no lock.)
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import aiohttp
import pytest

from proxy.api.app import ENGINE
from statecache.tiers.disk import DiskTier
from tests.http.conftest import DoneLines, Hold, serve

pytestmark = pytest.mark.http

SYSTEM = "You are a coding agent working in a repository. " * 45  # about 2,000 tokens
LONG = "".join(f"line {i}: the build log says nothing of interest here. " for i in range(100))


async def _worst_latency(url: str, until: asyncio.Event) -> tuple[int, float]:
    answers, worst = 0, 0.0
    async with aiohttp.ClientSession() as http:
        while not until.is_set():
            for path in ("/metrics", "/health"):
                t0 = time.perf_counter()
                async with http.get(url + path) as r:
                    await r.read()
                    answers += r.status == 200
                worst = max(worst, time.perf_counter() - t0)
            await asyncio.sleep(0.02)
    return answers, worst


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
        cv = srv.app[ENGINE].board.cv
        reads: list[tuple[str, bool, bool]] = []  # thread; its lock; the lock free at times

        def slow_read(self: DiskTier, rec: object, *have: object) -> object:
            mine = cv._is_owned()  # type: ignore[attr-defined]  # (an RLock: this thread's)
            free = False
            for _ in range(10):  # a second; another thread may take the lock in passing
                if cv.acquire(blocking=False):
                    cv.release()
                    free = True
                time.sleep(0.1)
            reads.append((threading.current_thread().name, mine, free))
            return real(self, rec, *have)  # type: ignore[arg-type]

        monkeypatch.setattr(DiskTier, "read_file", slow_read)
        stop = asyncio.Event()
        probe = asyncio.create_task(_worst_latency(srv.url, stop))
        long = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": LONG + "Summarize the log."}]
        b = [{"role": "system", "content": SYSTEM},
             {"role": "user", "content": LONG + "Count the lines."}]
        # B arrives while A prefills the log they share (the engine is held there until
        # B is in, however slowly the machine gets A that far)
        with Hold(srv, lambda active: any(job.prefilling for job, _ in active)) as hold:
            a = asyncio.create_task(srv.client.chat.completions.create(
                model="m", messages=long, max_tokens=4, temperature=0))
            await hold.until_held()
            b_done = asyncio.create_task(srv.client.chat.completions.create(
                model="m", messages=b, max_tokens=4, temperature=0))
            await hold.until_in(2)
        await b_done
        await a
        stop.set()
        answers, worst = await probe
    assert reads, "no checkpoint was read from disk: the test lost its subject"
    assert all(free and not mine for _, mine, free in reads), reads
    assert answers > 0
    print(f"{len(reads)} reads on {sorted({t for t, _, _ in reads})}; "
          f"/metrics and /health answered {answers} times, the slowest in {worst * 1000:.0f} ms")
