"""Request text is checked where the body is read: a lone UTF-16 surrogate anywhere in a
body is a 400 naming where it is, on every API, before the engine sees the request."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from anthropic import AsyncAnthropic

from tests.http.conftest import serve

pytestmark = pytest.mark.http

HI = b'[{"role": "user", "content": "hi"}]'
# (route, body, where the surrogate is); json.loads accepts each of them
BODIES = [
    # the request: it raised UnicodeEncodeError inside the engine's admission
    ("/v1/chat/completions", b'{"max_tokens": 2, "messages": ' + HI + b', "user": "\\ud800"}',
     "'user'"),
    ("/v1/chat/completions", b'{"max_tokens": 2, "messages": [{"role": "user", '
     b'"content": "hi \\uDFFF there"}]}', "'messages[0].content'"),
    # UTF-8 forbids the bytes of a surrogate; json.loads lets them through
    ("/v1/chat/completions", b'{"max_tokens": 2, "messages": ' + HI
     + b', "user": "\xed\xa0\x80"}', "'user'"),
    ("/v1/messages", b'{"max_tokens": 2, "messages": [{"role": "user", "content": '
     b'[{"type": "text", "text": "\\udc00"}]}]}', "'messages[0].content[0].text'"),
    ("/v1/messages", b'{"max_tokens": 2, "messages": ' + HI
     + b', "metadata": {"\\ud83d": "x"}}', "a key of 'metadata'"),
    ("/v1/responses", b'{"max_output_tokens": 2, "input": "hi", "instructions": '
     b'"be \\ud83d brief"}', "'instructions'"),
    ("/v1/responses", b'{"max_output_tokens": 2, "input": "hi", "\\udbff": 1}',
     "a top-level key"),
]


async def _post(http: aiohttp.ClientSession, url: str, body: bytes) -> tuple[int, Any]:
    async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        return r.status, await r.json()


async def test_a_lone_surrogate_is_a_400_naming_it_on_every_api(
    hybrid_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async with serve(hybrid_path, tmp_path / "ckpt") as srv, aiohttp.ClientSession() as http:
        for route, body, where in BODIES:
            status, answer = await _post(http, srv.url + route, body)
            assert status == 400, (route, answer)
            if route.startswith("/v1/messages"):  # Anthropic's error shape
                assert answer["type"] == "error", answer
                assert answer["error"]["type"] == "invalid_request_error"
            message = answer["error"]["message"]
            assert message.startswith(f"{where} holds a lone UTF-16 surrogate (U+"), message
            assert "not a character" in message
        # a surrogate pair is one character, and an escaped backslash is no escape
        status, answer = await _post(http, srv.url + "/v1/chat/completions", (
            b'{"max_tokens": 2, "temperature": 0, "messages": [{"role": "user", "content": '
            b'"hi \\ud83d\\ude00 \\\\ud800"}]}'))
        assert status == 200, answer
        # the server serves the APIs' own clients as before
        chat = await srv.client.chat.completions.create(
            model="x", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        async with AsyncAnthropic(base_url=srv.url, api_key="unused", max_retries=0) as client:
            message = await client.messages.create(
                model="m", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        response = await srv.client.responses.create(model="x", input="hi",
                                                     max_output_tokens=2)
    assert chat.choices[0].finish_reason == "length" and message.stop_reason == "max_tokens"
    assert response.status == "incomplete"
    # refused where the body is read: one info line each, no traceback, no error
    assert not [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not [m for m in caplog.messages if "UnicodeEncodeError" in m or "Traceback" in m]
    rejected = [m for m in caplog.messages if m.startswith("rejected POST")]
    assert len(rejected) == len(BODIES), rejected
    assert all("lone UTF-16 surrogate" in m for m in rejected)
