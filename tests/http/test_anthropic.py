"""Anthropic Messages through the real ``anthropic`` client: agent sessions reuse the cache
as chat sessions do and answer as the same request served cold; the SSE events, usage,
count_tokens and errors are what the SDK expects; a conversation moves between APIs."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import pytest
from anthropic import AsyncAnthropic

from tests.http.agent import tool_result, user_message
from tests.http.conftest import DoneLines, Server, serve
from tests.http.cross_api import (
    ANTHROPIC_TOOLS,
    Session,
    anthropic_api,
    chat_api,
    check_reuse,
    responses_api,
    same_as_cold,
    to_anthropic,
)

pytestmark = pytest.mark.http
MAX_TOKENS = 48


@asynccontextmanager
async def _client(srv: Server) -> AsyncIterator[AsyncAnthropic]:
    async with AsyncAnthropic(base_url=srv.url, api_key="unused", max_retries=0,
                              timeout=120) as client:
        yield client


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_agent_session_reuses_the_cache_and_matches_cold(
    stream: bool, hybrid_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv, _client(srv) as client:
        api = anthropic_api(client, MAX_TOKENS, stream)
        s = Session()
        first = await s.turn(api)
        assert first.message["reasoning_content"], "the template opens <think>: thinking"
        for k in range(1, 5):
            await s.turn(api, tool_result(k) if k % 2 else user_message(k))
    # thinking blocks went back as sent: each follow-up resumed at the end of the reply
    check_reuse(s.turns, done_lines)
    await same_as_cold(hybrid_path, tmp_path, s.turns, MAX_TOKENS)


async def test_conversation_moves_between_apis_and_hits_the_cache(
    hybrid_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    # One conversation: chat completions, then Anthropic, then Responses, then chat again.
    async with serve(hybrid_path, tmp_path / "ckpt") as srv, _client(srv) as client:
        apis = [chat_api(srv.client, MAX_TOKENS),
                anthropic_api(client, MAX_TOKENS, stream=True),
                responses_api(srv.client, MAX_TOKENS, stream=False),
                chat_api(srv.client, MAX_TOKENS)]
        s = Session()
        await s.turn(apis[0])
        for k, api in enumerate(apis[1:], start=1):
            await s.turn(api, tool_result(k) if k % 2 else user_message(k))
    check_reuse(s.turns, done_lines)
    await same_as_cold(hybrid_path, tmp_path, s.turns, MAX_TOKENS)


def _sse(raw: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


async def test_stream_events_headers_usage_and_count_tokens(
    hybrid_path: Path, tmp_path: Path
) -> None:
    system, messages = to_anthropic([{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Say hello."}])
    body = {"model": "m", "max_tokens": 8, "temperature": 0, "system": system,
            "messages": messages, "tools": ANTHROPIC_TOOLS, "stream": True,
            "metadata": {"user_id": "u1"}, "cache_control": {"type": "ephemeral"}}
    assert system is not None
    headers = {"x-api-key": "sk-any", "anthropic-version": "2023-06-01",
               "anthropic-beta": "interleaved-thinking-2025-05-14"}
    async with serve(hybrid_path, tmp_path / "ckpt") as srv, _client(srv) as client, \
            aiohttp.ClientSession() as http:
        async with http.post(srv.url + "/v1/messages", json=body, headers=headers) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            events = _sse(await r.text())
        n = await client.messages.count_tokens(model="m", system=system,
                                                     messages=messages,  # type: ignore[arg-type]
                                                     tools=ANTHROPIC_TOOLS)  # type: ignore[arg-type]
        async with http.post(srv.url + "/v1/messages", json={**body, "stream": False},
                             headers=headers) as r:
            again = await r.json()
    assert all(name == data["type"] for name, data in events)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(names[3:-3]) == {"content_block_delta"}
    assert events[2][1]["content_block"]["type"] == "thinking"
    end = events[-2][1]
    assert end["delta"]["stop_reason"] == "max_tokens"
    usage = end["usage"]
    assert usage["output_tokens"] == 8 and usage["cache_read_input_tokens"] == 0
    assert usage["input_tokens"] == events[0][1]["message"]["usage"]["input_tokens"]
    assert n.input_tokens == usage["input_tokens"]
    # the same request again: the prompt is cached, all but what the last page needs
    u2 = again["usage"]
    assert u2["input_tokens"] + u2["cache_read_input_tokens"] == n.input_tokens
    assert u2["cache_read_input_tokens"] >= n.input_tokens - 32
    assert again["content"][0]["thinking"] == "".join(
        d["delta"]["thinking"] for _, d in events if d["type"] == "content_block_delta")


async def test_max_tokens_past_the_context_runs_until_the_context_is_full(
    hybrid_path: Path, tmp_path: Path
) -> None:
    # Claude Code asks for max_tokens 32000 or 64000 whatever the context holds.
    async with serve(hybrid_path, tmp_path / "ckpt", model__n_ctx=256) as srv, \
            _client(srv) as client:
        m = await client.messages.create(model="m", max_tokens=64000,
                                         messages=HI)  # type: ignore[arg-type]
    assert m.stop_reason == "model_context_window_exceeded"
    assert m.usage.input_tokens + m.usage.output_tokens == 256


async def test_stop_sequences_end_the_reply(hybrid_path: Path, tmp_path: Path) -> None:
    msgs: Any = [{"role": "user", "content": "Say hello."}]
    async with serve(hybrid_path, tmp_path / "ckpt") as srv, _client(srv) as client:
        full = await client.messages.create(model="m", max_tokens=24, messages=msgs,
                                            extra_body={"temperature": 0})
        text = full.content[0].thinking  # type: ignore[union-attr]
        stop = text[len(text) // 2]
        cut = await client.messages.create(model="m", max_tokens=24, messages=msgs,
                                           stop_sequences=[stop], extra_body={"temperature": 0})
    assert (cut.stop_reason, cut.stop_sequence) == ("stop_sequence", stop)
    assert cut.content[0].thinking == text[:text.index(stop)].strip()  # type: ignore[union-attr]


HI = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(("body", "status", "words"), [
    ({"max_tokens": 8, "messages": []}, 400, "'messages' must be a non-empty list"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}]}]},
     400, "'image'"),
    ({"max_tokens": 8, "messages": [{"role": "user", "content": "x " * 5000}]},
     400, "context is 4096 tokens"),
])
async def test_errors_are_anthropic_shaped_and_logged(
    hybrid_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
    body: dict[str, Any], status: int, words: str
) -> None:
    caplog.set_level(logging.INFO, logger="proxy.api.app")
    async with serve(hybrid_path, tmp_path / "ckpt") as srv, _client(srv) as client:
        with pytest.raises(anthropic.APIStatusError) as err:
            await client.messages.create(model="m", **body)
        ok = await client.messages.create(model="m", max_tokens=2,
                                          messages=HI)  # type: ignore[arg-type]
    assert err.value.status_code == status
    error = err.value.body
    assert isinstance(error, dict) and error["type"] == "error", error
    assert error["error"]["type"] == "invalid_request_error"
    assert words in error["error"]["message"]
    assert ok.stop_reason == "max_tokens"  # the server is fine afterwards
    rejected = [r.getMessage() for r in caplog.records if "rejected" in r.getMessage()]
    assert rejected == [f"rejected POST /v1/messages: {status} {error['error']['message']}"]


async def test_routes_and_bad_json_answer_in_anthropic_shape(
    hybrid_path: Path, tmp_path: Path
) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv, aiohttp.ClientSession() as http:
        async with http.post(srv.url + "/v1/messages", data=b"{nope") as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with http.get(srv.url + "/v1/messages") as r:
            assert r.status == 405 and r.headers["Allow"] == "POST"
            assert (await r.json())["type"] == "error"
        async with http.post(srv.url + "/v1/messages/batches", json={}) as r:
            assert r.status == 404
            assert (await r.json())["error"]["type"] == "not_found_error"
        async with http.post(srv.url + "/v1/chat/completions", json={}) as r:
            assert r.status == 400 and "param" in (await r.json())["error"]  # OpenAI's shape
