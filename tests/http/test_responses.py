"""OpenAI Responses through the real ``openai`` client: agent sessions (full input, or
``previous_response_id``) reuse the cache as chat sessions do and answer as the same
request served cold; the SSE events are what the SDK's stream helper accepts; hosted
tools and unknown previous responses get clear 400s."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from tests.http.agent import SYSTEM, tool_result, user_message
from tests.http.conftest import DoneLines, serve
from tests.http.cross_api import (
    RESPONSES_TOOLS,
    Reply,
    Session,
    check_reuse,
    responses_api,
    responses_request,
    same_as_cold,
    to_responses,
)

pytestmark = pytest.mark.http
MAX_TOKENS = 48


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_agent_session_reuses_the_cache_and_matches_cold(
    stream: bool, hybrid_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    # Each request sends the whole conversation, the output items as the SDK returned them.
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        api = responses_api(srv.client, MAX_TOKENS, stream)
        s = Session()
        first = await s.turn(api)
        assert first.message["reasoning_content"], "the template opens <think>: reasoning"
        for k in range(1, 5):
            await s.turn(api, tool_result(k) if k % 2 else user_message(k))
    check_reuse(s.turns, done_lines)
    await same_as_cold(hybrid_path, tmp_path, s.turns, MAX_TOKENS)


class Chained:
    """Sends only what is new since the last response, with ``previous_response_id``;
    the instructions every time (OpenAI does not carry them over)."""

    def __init__(self, client: AsyncOpenAI, stream: bool) -> None:
        self.client, self.stream = client, stream
        self.known, self.last = 1, ""  # messages the server holds (the system: instructions)

    async def __call__(self, messages: list[dict[str, Any]]) -> Reply:
        _, items = to_responses(messages[self.known:])
        extra = {"previous_response_id": self.last} if self.last else {}
        reply = await responses_request(self.client, MAX_TOKENS, self.stream,
                                        instructions=SYSTEM, input=items, **extra)
        self.known, self.last = len(messages) + 1, reply.response_id
        return reply


async def test_previous_response_id_session(
    hybrid_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        s = Session()
        api = Chained(srv.client, stream=True)
        await s.turn(api)
        for k in range(1, 4):
            await s.turn(api, tool_result(k) if k % 2 else user_message(k))
        # a response that was not stored cannot be continued; an unknown id is a clear 400
        alone = await srv.client.responses.create(model="m", input="hi", store=False,
                                                  max_output_tokens=2)
        for missing in (alone.id, "resp_nothing"):
            with pytest.raises(openai.BadRequestError) as err:
                await srv.client.responses.create(model="m", input="more", max_output_tokens=2,
                                                  previous_response_id=missing)
            body = err.value.body
            assert isinstance(body, dict) and body["param"] == "previous_response_id"
            assert f"previous response '{missing}' is not found" in body["message"]
    check_reuse(s.turns, _first(done_lines, len(s.turns)))
    await same_as_cold(hybrid_path, tmp_path, s.turns, MAX_TOKENS)


def _first(done: DoneLines, n: int) -> DoneLines:
    out = DoneLines()
    out.rows = done.rows[:n]
    return out


def _sse(raw: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    for block in raw.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append((lines["event"], json.loads(lines["data"])))
    return events


async def test_stream_events(hybrid_path: Path, tmp_path: Path) -> None:
    _, items = to_responses([{"role": "user", "content": "Say hello."}])
    body: dict[str, Any] = {
        "model": "m", "input": items, "instructions": "Be brief.", "stream": True,
        "max_output_tokens": 8, "temperature": 0, "tools": RESPONSES_TOOLS,
        "include": ["reasoning.encrypted_content"], "store": True}
    async with serve(hybrid_path, tmp_path / "ckpt") as srv, aiohttp.ClientSession() as http:
        async with http.post(srv.url + "/v1/responses", json=body) as r:
            assert r.status == 200 and r.content_type == "text/event-stream"
            events = _sse(await r.text())
        # the same request again, not streamed: its prompt is cached
        again = await srv.client.responses.create(**{**body, "stream": False})
    assert all(name == data["type"] for name, data in events)
    assert [d["sequence_number"] for _, d in events] == list(range(len(events)))
    names = [name for name, _ in events]
    assert names[:4] == ["response.created", "response.in_progress",
                         "response.output_item.added", "response.content_part.added"]
    assert set(names[4:-4]) == {"response.reasoning_text.delta"}
    assert names[-4:] == ["response.reasoning_text.done", "response.content_part.done",
                          "response.output_item.done", "response.incomplete"]
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete"
    assert final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["usage"]["output_tokens"] == 8
    item = final["output"][0]
    assert item["type"] == "reasoning" and item["encrypted_content"].endswith(
        item["content"][0]["text"])
    assert again.usage is not None and again.usage.input_tokens == final["usage"]["input_tokens"]
    assert again.usage.input_tokens_details.cached_tokens >= again.usage.input_tokens - 32
    assert again.output[0].model_dump()["content"][0]["text"] == item["content"][0]["text"]


@pytest.mark.parametrize("tool", [
    {"type": "web_search"},
    {"type": "file_search", "vector_store_ids": ["vs_1"]},
    {"type": "computer_use_preview", "display_width": 800, "display_height": 600,
     "environment": "linux"},
])
async def test_hosted_tools_get_a_400_that_names_them_when_refused(
    tool: dict[str, Any], hybrid_path: Path, tmp_path: Path
) -> None:
    """``server.hosted_tools = "reject"``; by default they are left out (test_agent_requests)."""
    async with serve(hybrid_path, tmp_path / "ckpt", server__hosted_tools="reject") as srv:
        with pytest.raises(openai.BadRequestError) as err:
            await srv.client.responses.create(model="m", input="hi", max_output_tokens=2,
                                              tools=[tool])  # type: ignore[list-item]
    body = err.value.body
    assert isinstance(body, dict) and body["param"] == "tools[0].type"
    assert f"tools of type '{tool['type']}' are not supported" in body["message"]
