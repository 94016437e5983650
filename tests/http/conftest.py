"""A real statecache server on 127.0.0.1 and the real ``openai`` client."""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer
from openai import AsyncOpenAI

from proxy.api.app import ENGINE
from proxy.engine.job import Job
from proxy.engine.timing import StepCosts
from proxy.server import build_app
from statecache.config import load_config
from tests.busy import THREADS

DONE = re.compile(r"Done · input ([\d,]+) · cached ([\d,]+) · prefilled ([\d,]+)")


def _int(s: str) -> int:
    return int(s.replace(",", ""))


@dataclass
class Server:
    app: web.Application
    server: TestServer
    client: AsyncOpenAI

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.port}"


@asynccontextmanager
async def serve(model: Path, ckpt_dir: Path, *, costs: StepCosts | None = None,
                **overrides: Any) -> AsyncIterator[Server]:
    """Start the proxy in this process on a free port; closing it shuts it down cleanly.
    ``costs``: what its engine's steps are charged instead of the seconds they take
    (``StepTimer.costs``), for a test that asserts on a decision made from step times."""
    settings: dict[str, Any] = {
        "model.threads": THREADS,  # one: the suite must hold on a busy machine
        "model.path": str(model), "model.n_ctx": 4096, "server.lanes": 2,
        "cache.disk_path": str(ckpt_dir), "cache.page_size": 32,
        "engine.sanity_checks": True,  # the engine checks its invariants after each step
        # the checkpoint key beside the directory, not in the user's home
        "cache.secret_path": str(ckpt_dir.parent / "secret.key"),
    }
    settings.update({k.replace("__", "."): v for k, v in overrides.items()})
    app = build_app(load_config(None, settings))
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    if costs is not None:  # before any request: the engine thread is idle
        app[ENGINE].timer.costs = costs
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused",
                         max_retries=0, timeout=120)
    try:
        yield Server(app, server, client)
    finally:
        await client.close()
        await server.close()


_SAMPLE = re.compile(r"^([a-zA-Z_:][^ ]*) (\S+)$", re.M)


async def until_metrics(srv: Server, done: Callable[[dict[str, float]], bool],
                        within: float = 60.0) -> str:
    """``/metrics`` once ``done`` holds for its samples (``name{labels}`` -> value), for a
    test that waits for what the server did (an idle save, a write) rather than for a time."""
    deadline = time.monotonic() + within
    async with aiohttp.ClientSession() as http:
        while True:
            async with http.get(srv.url + "/metrics") as resp:
                text = await resp.text()
            samples = {m[1]: float(m[2]) for m in _SAMPLE.finditer(text)}
            if done(samples):
                return text
            assert time.monotonic() < deadline, "never came: " + text[-3000:]
            await asyncio.sleep(0.05)


class Hold:
    """Holds the engine thread where its next run of steps starts (``Stepper.run``), once
    ``when(active)`` says so, until ``release()``: for a test that needs a request to
    arrive while another is at a given point, not whenever a busy (or a fast) machine
    has it get there. Engine thread: ``when`` and the wait; the test: the rest."""

    def __init__(self, srv: Server,
                 when: Callable[[list[tuple[Job, Any]]], bool] = lambda active: True) -> None:
        self.engine = srv.app[ENGINE]
        self.when = when
        self.held = threading.Event()  # the engine waits
        self.go = threading.Event()
        run = self.engine.stepper.run

        def run_unless_held(active: list[tuple[Job, Any]]) -> None:
            if not self.go.is_set() and active and self.when(active):
                self.held.set()
                self.go.wait()
            run(active)

        self.engine.stepper.run = run_unless_held

    async def until_held(self, timeout: float = 60) -> None:
        assert await asyncio.to_thread(self.held.wait, timeout), "the engine was never held"

    async def until_in(self, n: int, timeout: float = 60) -> None:
        """Until the engine holds ``n`` requests, waiting or admitted."""
        deadline = time.monotonic() + timeout
        while sum(self.engine.queue().values()) < n:
            assert time.monotonic() < deadline, self.engine.queue()
            await asyncio.sleep(0.01)

    def release(self) -> None:
        self.go.set()

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()  # whatever happened: a held engine never shuts down


class HeldClock:
    """A clock that stands still until the test moves it on (``Parts.clock``)."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class DoneLines(logging.Handler):
    """Collects (input, cached, prefilled) from the engine's ``Done`` log lines."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.rows: list[tuple[int, int, int]] = []
        self.events: list[str] = []  # "Started ..." and "Done ..." lines in order

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith(("Started", "Done")):
            self.events.append(msg)
        m = DONE.search(msg)
        if m:
            self.rows.append((_int(m[1]), _int(m[2]), _int(m[3])))


@pytest.fixture
def done_lines() -> AsyncIterator[DoneLines] | Any:
    handler = DoneLines()
    logger = logging.getLogger("statecache")
    old = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(old)
