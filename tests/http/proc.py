"""``statecache serve`` as a separate process, the way a user runs it."""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.busy import THREADS


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    proc: subprocess.Popen[str]
    port: int
    ckpt: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metric(self, pattern: str) -> float:
        """The value of the /metrics sample whose name and labels match ``pattern`` (a
        regex); 0 when there is none."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as r:
            text = r.read().decode()
        m = re.search(r"^" + pattern + r" (\S+)$", text, re.M)
        return float(m.group(1)) if m else 0.0

    def checkpoints(self) -> list[dict[str, object]]:
        """``GET /admin/checkpoints``: every checkpoint the server holds, with its tiers."""
        with urllib.request.urlopen(f"{self.url}/admin/checkpoints", timeout=10) as r:
            return list(json.loads(r.read())["checkpoints"])

    def until(self, what: str, done: Callable[[], bool], within: float = 60) -> None:
        """Until ``done()``, which the server's own pace decides (a busy machine's), at
        most ``within`` seconds."""
        deadline = time.monotonic() + within
        while not done():
            assert time.monotonic() < deadline, f"not within {within} s: {what}"
            time.sleep(0.05)

    def output(self, timeout: float = 60) -> str:
        out, _ = self.proc.communicate(timeout=timeout)
        return out


@contextmanager
def serve_process(model: Path | str, tmp: Path, config: str = "", *extra: str,
                  env: Mapping[str, str] | None = None) -> Iterator[Proc]:
    """Start ``python -m proxy serve`` on a free port with ``config`` (TOML) appended to
    a config that puts the checkpoints under ``tmp``; wait until /health answers.
    ``model``: a path or a name; ``env``: variables set for the process."""
    port = free_port()
    ckpt = tmp / "ckpt"
    cfg = tmp / "statecache.toml"
    # one thread (tests/busy.py says why), in the config's own [model] table where it
    # has one: TOML declares a table once
    one = f"[model]\nthreads = {THREADS}\n"
    config = config.replace("[model]\n", one, 1) if "[model]\n" in config else one + config
    cfg.write_text(f'[cache]\ndisk_path = "{ckpt}"\nsecret_path = "{tmp / "secret.key"}"\n'
                   + config)
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--config", str(cfg), "--model", str(model),
         "--port", str(port), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    assert r.status == 200
                    break
            except OSError:
                assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
                assert time.monotonic() < deadline, "server did not come up"
                time.sleep(0.3)
        yield Proc(proc, port, ckpt)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def open_stream(port: int, body: dict[str, object]) -> tuple[http.client.HTTPConnection,
                                                              http.client.HTTPResponse]:
    """POST a streaming chat completion; the response is read line by line."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({**body, "stream": True}),
                 headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200, resp.read()
    return conn, resp


def sse_events(resp: http.client.HTTPResponse) -> Iterator[str]:
    """The ``data:`` payloads of an SSE response, until the connection ends."""
    while True:
        line = resp.readline()
        if not line:
            return
        text = line.decode().strip()
        if text.startswith("data: "):
            yield text[6:]
