"""Memory and validation limits over HTTP: a real server, real clients, real bodies."""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp.test_utils import TestServer
from aiohttp.web_runner import BaseRunner

from proxy.api.intake import SLOTS
from proxy.api.transport import JsonErrorRunner
from proxy.server import build_app
from statecache.config import load_config
from tests.http.conftest import serve

pytestmark = pytest.mark.http

HELLO = [{"role": "user", "content": "Say hello."}]
CHAT = "/v1/chat/completions"


def _peak_rss_mib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+)", status)[1]) / 1024  # type: ignore[index]


def _reset_peak_rss() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # Linux: VmHWM starts again from now


async def _post(url: str, body: bytes, headers: dict[str, str] | None = None
                ) -> tuple[int, dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.post(
            url, data=body, headers={"Content-Type": "application/json", **(headers or {})}
    ) as r:
        return r.status, await r.json()


def _big_chat(n_bytes: int) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "a" * n_bytes}],
                       "max_tokens": 2}).encode()


async def test_a_huge_body_is_refused_without_holding_it(hybrid_path: Path,
                                                         tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        await srv.client.chat.completions.create(model="x", messages=HELLO,  # type: ignore[arg-type]
                                                 max_tokens=2, temperature=0)
        big = _big_chat(31_500_000)  # the body: 31.5 MB, under the old 32 MiB limit
        _reset_peak_rss()
        base = _peak_rss_mib()
        status, body = await _post(srv.url + CHAT, big)
        grown = _peak_rss_mib() - base
        assert status == 413 and "8,388,608 bytes" in body["error"]["message"]
        # under the limit, but far past the context: refused from its length, never
        # tokenized (tokenizing it took 3 GB before)
        under = _big_chat(8_000_000)
        _reset_peak_rss()
        base = _peak_rss_mib()
        status, body = await _post(srv.url + CHAT, under)
        grown_under = _peak_rss_mib() - base
        assert status == 400, body
        assert body["error"]["code"] == "context_length_exceeded"
        assert "at least" in body["error"]["message"]
        ok = await srv.client.chat.completions.create(model="x", messages=HELLO,  # type: ignore[arg-type]
                                                      max_tokens=2, temperature=0)
        assert ok.choices[0].finish_reason == "length"
    # The process holds the client too (its unsent 31.5 MB sit in the socket's buffer);
    # before, the server alone grew by 3.1 GB on this body.
    assert grown < 120, f"peak RSS grew {grown:.0f} MiB for a refused 31.5 MB body"
    assert grown_under < 200, f"peak RSS grew {grown_under:.0f} MiB for an 8 MB body"


async def test_body_limit_is_configurable_and_413_is_openai_json(hybrid_path: Path,
                                                                 tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", server__max_body="64KiB") as srv:
        status, body = await _post(srv.url + CHAT, _big_chat(70_000))
        assert status == 413 and body["error"]["type"] == "invalid_request_error"
        # a body under it is served
        status, _ = await _post(srv.url + CHAT, _big_chat(60_000))
        assert status == 400  # 60 KB is past the 4096-token context: a clean 400, not 413


@pytest.mark.parametrize(("body", "needle"), [
    (b"[" * 100_000 + b"]" * 100_000, "nests deeper"),  # a RecursionError (500) before
    # deep enough for the limit, not for Python's recursion: the depth check
    (b'{"messages": [{"role": "user", "content": "x"}], "tools": [' + b"[" * 100
     + b"]" * 100 + b"]}", "nests deeper"),
    (b'{"messages": [{"role": "user", "content": "x"}], "temperature": NaN}', "NaN"),
])
async def test_malformed_bodies_get_400_json(hybrid_path: Path, tmp_path: Path, body: bytes,
                                             needle: str) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        status, answer = await _post(srv.url + CHAT, body)
        assert status == 400 and needle in answer["error"]["message"], answer


class _JsonErrorTestServer(TestServer):
    async def _make_runner(self, **kwargs: Any) -> BaseRunner:
        return JsonErrorRunner(self.app, **kwargs)


@asynccontextmanager
async def _serve_as_serve_does(model: Path, ckpt: Path) -> AsyncIterator[str]:
    """The app behind the runner ``statecache serve`` uses (transport errors as JSON)."""
    app = build_app(load_config(None, {"model.path": str(model), "model.n_ctx": 4096,
                                       "server.lanes": 1, "cache.disk_path": str(ckpt)}))
    server = _JsonErrorTestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    try:
        yield f"http://127.0.0.1:{server.port}"
    finally:
        await server.close()


async def test_a_header_too_large_is_json_and_logged(
    hybrid_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.api")
    async with _serve_as_serve_does(hybrid_path, tmp_path / "ckpt") as url, \
            aiohttp.ClientSession() as http:
        async with http.get(url + "/v1/models", headers={"X-Big": "a" * 9000}) as r:
            assert r.status == 431
            assert r.content_type == "application/json"
            assert "header" in (await r.json())["error"]["message"]
        async with http.get(url + "/v1/models") as r:  # the server is fine
            assert r.status == 200
    assert any(m.startswith("rejected a malformed request from 127.0.0.1: 431 request header")
               for m in caplog.messages), caplog.messages


async def test_every_rejected_request_is_one_info_line(
    hybrid_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.api")
    async with serve(hybrid_path, tmp_path / "ckpt", server__max_body="4KiB") as srv, \
            aiohttp.ClientSession() as http:
        async with http.post(srv.url + CHAT, json={"messages": HELLO, "top_p": 7}) as r:
            assert r.status == 400
        async with http.get(srv.url + "/v1/nothing") as r:
            assert r.status == 404
        async with http.post(srv.url + CHAT, data=b"x" * 5000) as r:
            assert r.status == 413
        async with http.post(srv.url + CHAT, json={"messages": HELLO, "mirostat": 2}) as r:
            assert r.status == 400
    lines = [m for m in caplog.messages if m.startswith("rejected ")]
    assert len(lines) == 4, lines
    assert lines[0].startswith("rejected POST /v1/chat/completions: 400 'top_p' must be in")
    assert lines[1].startswith("rejected GET /v1/nothing: 404 no such endpoint")
    assert lines[2].startswith("rejected POST /v1/chat/completions: 413 request body too large")
    assert lines[3].startswith("rejected POST /v1/chat/completions: 400 'mirostat' is not")


async def test_parse_slots_bound_requests_read_at_once(hybrid_path: Path,
                                                       tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", server__parse_concurrency=1) as srv:
        slots = srv.app[SLOTS]
        # A: a client that sends half of its body and stalls, holding the only slot
        body = json.dumps({"messages": HELLO, "max_tokens": 2, "temperature": 0}).encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", srv.server.port)
        writer.write(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                     + body[:10])
        await writer.drain()
        for _ in range(100):
            if slots.locked():
                break
            await asyncio.sleep(0.05)
        assert slots.locked(), "the stalled request holds the slot"
        # B waits for the slot: its body is not read while A's is
        b = asyncio.ensure_future(srv.client.chat.completions.create(
            model="x", messages=HELLO, max_tokens=2, temperature=0))  # type: ignore[arg-type]
        await asyncio.sleep(1.0)
        assert not b.done()
        writer.write(body[10:])
        await writer.drain()
        head = await asyncio.wait_for(reader.readline(), 60)
        assert head.startswith(b"HTTP/1.1 200"), head
        writer.close()
        answer = await asyncio.wait_for(b, 60)
        assert answer.choices[0].finish_reason == "length"
        assert not slots.locked()  # every slot came back


async def test_seed_minus_one_and_a_vanishing_temperature_are_served_cleanly(
    hybrid_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with serve(hybrid_path, tmp_path / "ckpt", cache__enabled=False) as srv:
        random = await srv.client.chat.completions.create(
            model="x", messages=HELLO, max_tokens=4, seed=-1)  # type: ignore[arg-type]
        assert random.choices[0].finish_reason == "length"
        greedy = await srv.client.chat.completions.create(
            model="x", messages=HELLO, max_tokens=8, temperature=0)  # type: ignore[arg-type]
        tiny = await srv.client.chat.completions.create(
            model="x", messages=HELLO, max_tokens=8, temperature=1e-320)  # type: ignore[arg-type]
        assert tiny.choices[0].message == greedy.choices[0].message
        with pytest.raises(openai.BadRequestError) as err:
            await srv.client.chat.completions.create(
                model="x", messages=HELLO, max_tokens=2, seed=-5)  # type: ignore[arg-type]
        assert isinstance(err.value.body, dict) and err.value.body.get("param") == "seed"
        # llama-server fields that would not act here are refused by name
        for field, value in [("mirostat", 2), ("ignore_eos", True), ("samplers", ["top_k"])]:
            with pytest.raises(openai.BadRequestError) as err:
                await srv.client.chat.completions.create(
                    model="x", messages=HELLO, max_tokens=2,  # type: ignore[arg-type]
                    extra_body={field: value})
            assert isinstance(err.value.body, dict) and err.value.body.get("param") == field
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not errors, [r.getMessage() for r in errors]
