"""What coding agents send at the first request of a conversation, through the real SDKs:
new conversations that share instructions and tools, cache breakpoints, pre-warms,
usage in ``message_start``, stop sequences, ``HEAD /``, hosted tools, sessions.

The synthetic hybrid model (Qwen3.5-class memory, ChatML with thinking) serves them; a
cache test compares the reply with the same request served cold.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
import openai
import pytest
from anthropic import AsyncAnthropic

from proxy.api.anthropic import parse_messages_request
from proxy.api.app import ENGINE, TEMPLATE
from proxy.api.chat import ChatRequest
from proxy.api.prompt import chat_prompt
from proxy.api.responses import chat_request, parse_responses_request
from statecache.pages import common_prefix
from tests.http.conftest import DoneLines, HeldClock, Server, serve

pytestmark = pytest.mark.http

INSTRUCTIONS = "You are Codex, a coding agent. Work in the repository; run commands. " * 20
PERMISSIONS = "<permissions>Approval policy: never. Sandbox: workspace-write.</permissions> " * 6
ENVIRONMENT = "<environment_context><cwd>/repo</cwd><shell>bash</shell></environment_context> " * 6
FUNCTIONS = [{"type": "function", "name": "shell", "description": "Run a shell command.",
              "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}]
SYSTEM = "You are Claude Code, an interactive coding agent. Be concise. " * 20
REMINDER = "<system-reminder>CLAUDE.md: run make check before committing.</system-reminder> " * 8
TOOLS = [{"name": "Bash", "description": "Run a command.",
          "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]


def _codex(prompt: str) -> dict[str, Any]:
    """A first request of a Codex session, as its Responses body."""
    return {"model": "m", "instructions": INSTRUCTIONS, "tools": FUNCTIONS,
            "input": [{"type": "message", "role": "developer",
                       "content": [{"type": "input_text", "text": PERMISSIONS}]},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": ENVIRONMENT}]},
                      {"type": "message", "role": "user",
                       "content": [{"type": "input_text", "text": prompt}]}],
            "max_output_tokens": 16, "temperature": 0}


def _claude(prompt: str, **extra: Any) -> dict[str, Any]:
    """A first request of a Claude Code session: its reminders and the prompt are blocks
    of one user message."""
    return {"model": "m", "max_tokens": 16, "system": [{"type": "text", "text": SYSTEM}],
            "tools": TOOLS, "messages": [{"role": "user", "content": [
                {"type": "text", "text": REMINDER}, {"type": "text", "text": prompt}]}],
            "extra_body": {"temperature": 0}, **extra}


def _tokens(srv: Server, req: ChatRequest) -> np.ndarray:
    p = chat_prompt(srv.app[ENGINE].tokenizer, srv.app[TEMPLATE], req, "",
                    srv.app[ENGINE].n_ctx)
    return np.asarray(p.tokens, dtype=np.int32)


async def _responses(client: openai.AsyncOpenAI, body: dict[str, Any]) -> tuple[str, int, int]:
    r = await client.responses.create(**body)
    assert r.usage is not None
    return r.output_text, r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens


@pytest.mark.parametrize("share_points", [4, 0])
async def test_a_new_codex_session_reuses_what_it_shares(
        hybrid_path: Path, tmp_path: Path, share_points: int) -> None:
    """Same instructions, tools and environment, another first prompt: the new session
    reuses up to where it parts (at least 99%); with share points off it does not."""
    a, b = _codex("Fix the failing test in tests/test_pool.py."), _codex("Add a README.")
    async with serve(hybrid_path, tmp_path / "ckpt", cache__share_points=share_points) as srv:
        await _responses(srv.client, a)
        text, n, cached = await _responses(srv.client, b)
        shared = common_prefix(
            _tokens(srv, chat_request(parse_responses_request(a), ())),
            _tokens(srv, chat_request(parse_responses_request(b), ())))
    assert 1000 < shared < n - 8  # they part at the new prompt, well into the prompt
    if share_points:
        assert shared * 0.99 <= cached <= shared, (cached, shared)
        async with serve(hybrid_path, tmp_path / "cold", cache__enabled=False) as cold:
            assert (await _responses(cold.client, b))[0] == text
    else:
        assert cached < shared * 0.99, (cached, shared)


async def test_a_new_claude_code_session_reuses_up_to_its_prompt_block(
        hybrid_path: Path, tmp_path: Path, done_lines: DoneLines) -> None:
    a, b = _claude("Why does make check fail?"), _claude("Rename the pool module.")
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        client = AsyncAnthropic(base_url=srv.url, api_key="x", max_retries=0)
        await client.messages.create(**a)
        m = await client.messages.create(**b)
        await client.close()
        shared = common_prefix(*(_tokens(srv, parse_messages_request(
            {k: v for k, v in body.items() if k != "extra_body"})) for body in (a, b)))
    # the new prompt is the second block: everything before it is reused
    cached = m.usage.cache_read_input_tokens or 0
    assert cached + m.usage.input_tokens == done_lines.rows[1][0]
    assert shared * 0.99 <= cached <= shared, (cached, shared)


async def test_a_breakpoint_is_a_checkpoint_kept_for_its_ttl(
        hybrid_path: Path, tmp_path: Path) -> None:
    body = _claude("Why?")
    body["system"] = [{"type": "text", "text": SYSTEM + "END-OF-SYSTEM.",
                       "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        client = AsyncAnthropic(base_url=srv.url, api_key="x", max_retries=0)
        t0 = time.time()
        await client.messages.create(**body)
        await client.close()
        async with aiohttp.ClientSession() as http, \
                http.get(srv.url + "/admin/checkpoints") as r:
            checkpoints = (await r.json())["checkpoints"]
            async with http.get(srv.url + "/metrics") as r2:
                metrics = await r2.text()
    kept = [c for c in checkpoints if "kept_until" in c]
    assert len(kept) == 1, checkpoints
    assert kept[0]["kind"] == "full" and kept[0]["preview"].endswith("END-OF-SYSTEM.")
    assert t0 + 3500 < kept[0]["kept_until"] < time.time() + 3601
    assert "statecache_kept_checkpoints 1" in metrics


async def test_prewarm_then_the_request(hybrid_path: Path, tmp_path: Path,
                                        done_lines: DoneLines) -> None:
    """Anthropic's ``max_tokens: 0``: the prompt is prefilled and cached, no content, stop
    reason max_tokens; the same request then starts at its end, its first token sampled
    from the logits the pre-warm kept: nothing is prefilled again, and the reply is the
    one served cold. Chat and Responses take their own zero."""
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        client = AsyncAnthropic(base_url=srv.url, api_key="x", max_retries=0)
        warm = await client.messages.create(**_claude("Why?", max_tokens=0))
        real = await client.messages.create(**_claude("Why?"))
        await client.close()
        chat = await srv.client.chat.completions.create(
            model="m", max_tokens=0, messages=[{"role": "user", "content": "warm me"}])
        resp = await srv.client.responses.create(model="m", input="warm me too",
                                                 max_output_tokens=0)
        async with aiohttp.ClientSession() as http, http.get(srv.url + "/metrics") as r:
            metrics = await r.text()
    assert (warm.content, warm.stop_reason, warm.usage.output_tokens) == ([], "max_tokens", 0)
    n = warm.usage.input_tokens + (warm.usage.cache_read_input_tokens or 0)
    assert (real.usage.cache_read_input_tokens, real.usage.input_tokens) == (n, 0)
    assert chat.choices[0].finish_reason == "length" and not chat.choices[0].message.content
    assert chat.usage is not None and chat.usage.completion_tokens == 0
    assert resp.status == "incomplete" and resp.output == []
    assert "statecache_prewarms_total 3" in metrics
    async with serve(hybrid_path, tmp_path / "cold", cache__enabled=False) as cold:
        client = AsyncAnthropic(base_url=cold.url, api_key="x", max_retries=0)
        again = await client.messages.create(**_claude("Why?"))
        await client.close()
    assert [b.model_dump() for b in again.content] == [b.model_dump() for b in real.content]


async def test_a_prewarm_never_takes_a_live_conversations_lane(
        hybrid_path: Path, tmp_path: Path, done_lines: DoneLines) -> None:
    """Both lanes hold a conversation that just replied: the pre-warm waits until one has
    been idle ``engine.idle_save_s`` and saved in full, and both follow-ups find their
    conversation live in its lane. The lanes' clock is held still until the follow-ups
    are in, then moved on past the idle time: how long the requests take on a busy
    machine is not what decides which lane is idle."""
    async with serve(hybrid_path, tmp_path / "ckpt", engine__idle_save_s=0.5) as srv:
        clock = HeldClock()
        srv.app[ENGINE].parts.clock = clock
        client = AsyncAnthropic(base_url=srv.url, api_key="x", max_retries=0)
        first = [await client.messages.create(**_claude(p)) for p in ("One?", "Two?")]
        warm = asyncio.create_task(client.messages.create(**_claude("Three?", max_tokens=0)))
        await asyncio.sleep(0.3)
        assert not warm.done()
        for p, m in zip(("One?", "Two?"), first, strict=True):
            body = _claude(p)
            text = "".join(getattr(b, "thinking", "") or getattr(b, "text", "") for b in m.content)
            body["messages"] += [{"role": "assistant", "content": [
                {"type": "thinking", "thinking": text, "signature": ""}]},
                {"role": "user", "content": "Go on."}]
            await client.messages.create(**body)
        assert not warm.done()  # nothing idle yet, however long that took
        clock.now += 1.0  # now both lanes are
        assert (await warm).stop_reason == "max_tokens"
        await client.close()
    started = [e for e in done_lines.events if e.startswith("Started")]
    assert "(live, lane)" in started[2] and "(live, lane)" in started[3], started


async def test_message_start_carries_the_cached_split_and_stop_sequences_are_named(
        hybrid_path: Path, tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        client = AsyncAnthropic(base_url=srv.url, api_key="x", max_retries=0)
        first = await client.messages.create(**_claude("Why?", max_tokens=24))
        text = "".join(b.thinking for b in first.content if b.type == "thinking")
        stop = text[8:11]
        events: list[Any] = []
        async with client.messages.stream(**_claude("Why?", max_tokens=24,
                                                   stop_sequences=[stop])) as s:
            async for ev in s:
                events.append(ev)
            final = await s.get_final_message()
        await client.close()
    start = next(e for e in events if e.type == "message_start").message.usage
    assert start.cache_read_input_tokens and start.cache_read_input_tokens > 0
    assert (start.cache_read_input_tokens, start.input_tokens) == (
        final.usage.cache_read_input_tokens, final.usage.input_tokens)
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", stop)
    got = "".join(b.thinking for b in final.content if b.type == "thinking")
    assert got == text[:text.index(stop)].strip()


async def test_head_and_get_root_answer_quietly(hybrid_path: Path, tmp_path: Path,
                                                caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    async with serve(hybrid_path, tmp_path / "ckpt") as srv, aiohttp.ClientSession() as http:
        async with http.head(srv.url + "/") as r:
            assert r.status == 200
        async with http.get(srv.url + "/") as r:
            assert r.status == 200 and "statecache" in await r.text()
        async with http.get(srv.url + "/admin/requests") as r:
            recent = (await r.json())["requests"]
    assert [(q["method"], q["path"], q["status"]) for q in recent] == [
        ("HEAD", "/", 200), ("GET", "/", 200)]
    assert not [r for r in caplog.records if "rejected" in r.getMessage()]


async def test_hosted_tools_are_left_out_with_one_warning(
        hybrid_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    body = {**_codex("Fix it."), "tools": [*FUNCTIONS, {"type": "web_search"}]}
    plain = _codex("Fix it.")
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        with_search = [await _responses(srv.client, body) for _ in range(2)]
        without = await _responses(srv.client, plain)
        client = AsyncAnthropic(base_url=srv.url, api_key="x", max_retries=0)
        server_tool = {"type": "web_search_20250305", "name": "web_search", "max_uses": 3}
        m = await client.messages.create(**{**_claude("Why?"), "tools": [*TOOLS, server_tool]})
        n = await client.messages.count_tokens(**{k: v for k, v in _claude("Why?").items()
                                                  if k not in ("max_tokens", "extra_body")})
        await client.close()
        assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) == n.input_tokens
        async with aiohttp.ClientSession() as http, http.get(srv.url + "/metrics") as r:
            metrics = await r.text()
    assert with_search[0][1] == without[1]  # the same prompt: the hosted tool is not in it
    assert 'statecache_hosted_tools_ignored_total{type="web_search"} 2' in metrics
    assert 'statecache_hosted_tools_ignored_total{type="web_search_20250305"} 1' in metrics
    warnings = [r.getMessage() for r in caplog.records if "hosted tool" in r.getMessage()]
    assert len(warnings) == 2 and "'web_search'" in warnings[0], warnings  # one per type
    async with serve(hybrid_path, tmp_path / "strict", server__hosted_tools="reject") as srv:
        with pytest.raises(openai.BadRequestError, match="web_search"):
            await srv.client.responses.create(**body)


async def test_a_named_conversation_goes_back_to_its_lane(
        hybrid_path: Path, tmp_path: Path, done_lines: DoneLines) -> None:
    """Codex names its thread (``prompt_cache_key``). A thread whose instructions changed
    early on restarts in its own lane, not in the lane another thread holds, and its miss
    says what changed, not "new conversation"."""
    def ask(key: str, instructions: str, prompt: str) -> dict[str, Any]:
        return {**_codex(prompt), "instructions": instructions, "prompt_cache_key": key}

    async with serve(hybrid_path, tmp_path / "ckpt", engine__idle_save_s=0) as srv:
        await _responses(srv.client, ask("y", "Thread Y. " + INSTRUCTIONS, "Y?"))
        await _responses(srv.client, ask("x", "Thread X. " + INSTRUCTIONS, "X?"))
        changed = "Thread X. " + INSTRUCTIONS[:300] + "(edited) " + INSTRUCTIONS[300:]
        await _responses(srv.client, ask("x", changed, "X?"))
        await _responses(srv.client, ask("y", "Thread Y. " + INSTRUCTIONS, "Y?"))
    started = [e for e in done_lines.events if e.startswith("Started")]
    lanes = [e.split("·")[1].strip() for e in started]
    assert lanes[2] == lanes[1] != lanes[0] == lanes[3], started
    assert "(live, lane)" in started[3] or "(replay, lane)" in started[3], started
    done = [e for e in done_lines.events if e.startswith("Done")]
    assert "miss: system prompt changed" in done[2], done[2]
