"""What an agent sends, written down: a reverse proxy on 127.0.0.1 between the agent and
the server (``make agents AGENTS_ARGS="--record DIR"``), and the files it writes.

Every request goes through untouched (its body and headers as sent, the server's reply
streamed back as it comes) and is kept in order: method, path with its query, headers,
body (parsed where it is JSON) and the label of the agent's turn it belongs to. A file
holds one agent's requests on one model, one JSON object a line, compressed with zstd
(``<agent>-<model>.jsonl.zst``): ``bench.replay`` sends them again.

No secret goes in a file: the agents run with scratch keys, and the values of the
headers that carry keys are written as ``SCRATCH_KEY`` whatever they held.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard
from aiohttp import ClientSession, ClientTimeout, web

Record = dict[str, Any]
SCRATCH_KEY = "statecache"
KEY_HEADERS = frozenset({"authorization", "x-api-key", "api-key", "openai-api-key"})
# hop-by-hop headers and those the proxy writes itself
DROPPED = frozenset({"host", "content-length", "transfer-encoding", "connection",
                     "keep-alive", "upgrade", "te", "trailer", "proxy-connection"})


def clean_headers(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """The headers to keep and forward, in order: hop-by-hop ones dropped, keys scratch."""
    out = []
    for k, v in headers:
        low = k.lower()
        if low in DROPPED:
            continue
        if low in KEY_HEADERS:
            v = f"Bearer {SCRATCH_KEY}" if low == "authorization" else SCRATCH_KEY
        out.append((k, v))
    return out


def body_value(raw: bytes) -> Any:
    """A body as written down: its JSON where it parses, else its text (None: empty)."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return raw.decode("utf-8", "replace")


def body_bytes(value: Any) -> bytes:
    """The bytes to send for a body written by ``body_value``."""
    if value is None:
        return b""
    if isinstance(value, str):
        return value.encode()
    return json.dumps(value, ensure_ascii=False).encode()


@dataclass
class Recorder:
    """Forwards to ``upstream`` and keeps every request; ``label`` names the turn the
    next requests belong to. ``start`` serves on a thread of its own."""

    upstream: str
    label: str = ""
    records: list[Record] = field(default_factory=list)
    port: int = 0
    _loop: asyncio.AbstractEventLoop | None = None
    _runner: web.AppRunner | None = None
    _thread: threading.Thread | None = None
    _t0: float = field(default_factory=time.monotonic)

    def start(self) -> int:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(ready,), daemon=True,
                                        name="recorder")
        self._thread.start()
        if not ready.wait(30) or not self.port:
            raise RuntimeError("the recording proxy did not start")
        return self.port

    def stop(self) -> None:
        loop, runner = self._loop, self._runner
        if loop is None or runner is None:
            return
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        if self._thread is not None:
            self._thread.join(30)

    def _serve(self, ready: threading.Event) -> None:
        loop = self._loop = asyncio.new_event_loop()
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app, access_log=None)
        loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        server = site._server
        assert server is not None
        self.port = int(server.sockets[0].getsockname()[1])  # type: ignore[attr-defined]
        ready.set()
        loop.run_forever()
        loop.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        headers = clean_headers(request.headers.items())
        self.records.append({"label": self.label, "t": round(time.monotonic() - self._t0, 3),
                             "method": request.method, "path": request.path_qs,
                             "headers": headers, "body": body_value(raw)})
        timeout = ClientTimeout(total=None, sock_connect=30)
        async with ClientSession(timeout=timeout, auto_decompress=False) as session, \
                session.request(request.method, self.upstream + request.path_qs,
                                headers=headers, data=raw or None,
                                allow_redirects=False) as up:
            resp = web.StreamResponse(status=up.status, reason=up.reason)
            for k, v in up.headers.items():
                if k.lower() not in DROPPED:
                    resp.headers.add(k, v)
            await resp.prepare(request)
            try:
                if request.method != "HEAD":
                    async for chunk in up.content.iter_any():
                        await resp.write(chunk)
                await resp.write_eof()
            except ConnectionResetError:  # the agent read what it wanted and hung up
                pass
            return resp


def write_records(path: Path, records: Iterable[Record]) -> None:
    """One JSON object a line, zstd-compressed (level 19: fixtures are written once)."""
    text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in records)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(zstandard.ZstdCompressor(level=19).compress(text.encode()))


def read_records(path: Path) -> list[Record]:
    text = zstandard.ZstdDecompressor().decompressobj().decompress(path.read_bytes())
    return [json.loads(line) for line in text.decode().splitlines() if line.strip()]
