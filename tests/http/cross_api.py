"""Agent sessions over chat completions, Anthropic Messages and OpenAI Responses.

The conversation is kept as chat messages (the form tests/http/agent.py uses) and written
in each API's own form for every request, by converters written here independently of
the server's parsers; a reply goes back the way that API's clients send it (Anthropic's
content blocks, Responses' output items, as the SDK returned them). So a session can
move from one API to another, and each answer can be compared with the same request
served cold through chat completions, with logprobs for the near-tie rule.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from tests.http.agent import PRIOR, SYSTEM, TOOLS, ask
from tests.http.conftest import DoneLines, serve

PAGE = 32
NEAR_TIE = 0.05  # the synthetic hybrid model (see test_sessions.py)
# Gemma 3: one prompt prefilled in other batches moves its logits by up to about 1.4
# (docs/design.md fact 10; test_sessions.py's bound for it)
GEMMA_NEAR_TIE = 1.5
ANTHROPIC_KEY = "_anthropic"  # the reply's content blocks, as the Messages API returned them
RESPONSES_KEY = "_responses"  # the reply's output items, as the Responses API returned them

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]
RESPONSES_TOOLS = [{"type": "function", "name": t["function"]["name"],
                    "description": t["function"]["description"],
                    "parameters": t["function"]["parameters"]} for t in TOOLS]


@dataclass
class Reply:
    message: dict[str, Any]  # the assistant message in chat form (+ the API's own form)
    text: str  # reasoning + content, as parsed
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    response_id: str = ""


Ask = Callable[[list[dict[str, Any]]], Awaitable[Reply]]


def _plain(m: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in m.items() if not k.startswith("_")}


def to_anthropic(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """(system, messages) of the Messages API for a chat conversation."""
    system = messages[0]["content"] if messages[0]["role"] == "system" else None
    out: list[dict[str, Any]] = []
    for m in messages[1 if system is not None else 0:]:
        if m["role"] == "user":
            out.append({"role": "user", "content": [{"type": "text", "text": m["content"]}]})
        elif m["role"] in ("system", "developer"):  # inside the conversation, as Claude Code
            out.append({"role": "system", "content": m["content"]})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": [{
                "type": "tool_result", "tool_use_id": m["tool_call_id"],
                "content": m["content"]}]})
        elif ANTHROPIC_KEY in m:
            out.append({"role": "assistant", "content": m[ANTHROPIC_KEY]})
        else:
            blocks: list[dict[str, Any]] = []
            if m.get("reasoning_content"):
                blocks.append({"type": "thinking", "thinking": m["reasoning_content"],
                               "signature": ""})
            if m.get("content"):
                blocks.append({"type": "text", "text": m["content"]})
            for c in m.get("tool_calls") or ():
                blocks.append({"type": "tool_use", "id": c["id"], "name": c["function"]["name"],
                               "input": json.loads(c["function"]["arguments"])})
            out.append({"role": "assistant", "content": blocks})
    return system, out


def to_responses(messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]]]:
    """(instructions, input items) of the Responses API for a chat conversation."""
    system = messages[0]["content"] if messages and messages[0]["role"] == "system" else None
    out: list[dict[str, Any]] = []
    for m in messages[1 if system is not None else 0:]:
        if m["role"] in ("user", "system", "developer"):
            out.append({"role": m["role"], "content": m["content"]})
        elif m["role"] == "tool":
            out.append({"type": "function_call_output", "call_id": m["tool_call_id"],
                        "output": m["content"]})
        elif RESPONSES_KEY in m:
            out.extend(m[RESPONSES_KEY])
        else:
            if m.get("reasoning_content"):
                out.append({"type": "reasoning", "summary": [], "content": [
                    {"type": "reasoning_text", "text": m["reasoning_content"]}]})
            # an empty reply (a call the token limit cut, dropped) stays an empty message,
            # as the chat client that got it sends it back: the history is the same turn
            if m.get("content") or not (m.get("reasoning_content") or m.get("tool_calls")):
                out.append({"type": "message", "role": "assistant", "content": [
                    {"type": "output_text", "text": m.get("content") or "",
                     "annotations": []}]})
            for c in m.get("tool_calls") or ():
                out.append({"type": "function_call", "call_id": c["id"],
                            "name": c["function"]["name"],
                            "arguments": c["function"]["arguments"]})
    return system, out


def _assistant(reasoning: str, content: str, calls: list[tuple[str, str, str]]
               ) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if reasoning:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = [{"id": i, "type": "function",
                                  "function": {"name": n, "arguments": a}} for i, n, a in calls]
    return message


def chat_api(client: AsyncOpenAI, max_tokens: int) -> Ask:
    async def run(messages: list[dict[str, Any]]) -> Reply:
        r = await ask(client, [_plain(m) for m in messages], max_tokens, tools=TOOLS)
        return Reply(r["message"], r["text"], r["prompt_tokens"], r["cached_tokens"],
                     r["completion_tokens"])
    return run


def anthropic_api(client: AsyncAnthropic, max_tokens: int, stream: bool) -> Ask:
    async def run(messages: list[dict[str, Any]]) -> Reply:
        system, msgs = to_anthropic(messages)
        kwargs: dict[str, Any] = {
            "model": "statecache", "max_tokens": max_tokens, "messages": msgs,
            "tools": ANTHROPIC_TOOLS, "extra_body": {"temperature": 0}}
        if system is not None:
            kwargs["system"] = system
        if stream:
            async with client.messages.stream(**kwargs) as s:
                m = await s.get_final_message()
        else:
            m = await client.messages.create(**kwargs)
        blocks = [b.model_dump(exclude_none=True) for b in m.content]
        reasoning = "".join(b["thinking"] for b in blocks if b["type"] == "thinking")
        content = "".join(b["text"] for b in blocks if b["type"] == "text")
        calls = [(b["id"], b["name"], json.dumps(b["input"])) for b in blocks
                 if b["type"] == "tool_use"]
        message = {**_assistant(reasoning, content, calls), ANTHROPIC_KEY: blocks}
        u = m.usage
        cached = u.cache_read_input_tokens or 0
        return Reply(message, reasoning + content,
                     u.input_tokens + cached + (u.cache_creation_input_tokens or 0), cached,
                     u.output_tokens, m.id)
    return run


def responses_api(client: AsyncOpenAI, max_tokens: int, stream: bool) -> Ask:
    async def run(messages: list[dict[str, Any]]) -> Reply:
        instructions, items = to_responses(messages)
        return await responses_request(client, max_tokens, stream, instructions=instructions,
                                       input=items)
    return run


async def responses_request(client: AsyncOpenAI, max_tokens: int, stream: bool,
                            **kwargs: Any) -> Reply:
    """One Responses request; the reply with its output items as the SDK returned them."""
    kwargs.update(model="statecache", tools=RESPONSES_TOOLS, max_output_tokens=max_tokens,
                  temperature=0)
    if stream:
        final = None
        async with client.responses.stream(**kwargs) as s:
            async for ev in s:
                if ev.type in ("response.completed", "response.incomplete"):
                    final = ev.response
        assert final is not None, "the stream ended without a final response event"
        r = final
    else:
        r = await client.responses.create(**kwargs)
    items = [item.model_dump(exclude_none=True) for item in r.output]
    reasoning = "".join(p["text"] for i in items if i["type"] == "reasoning"
                        for p in i.get("content", []))
    content = "".join(p["text"] for i in items if i["type"] == "message" for p in i["content"])
    calls = [(i["call_id"], i["name"], i["arguments"]) for i in items
             if i["type"] == "function_call"]
    assert r.usage is not None
    return Reply({**_assistant(reasoning, content, calls), RESPONSES_KEY: items},
                 reasoning + content, r.usage.input_tokens,
                 r.usage.input_tokens_details.cached_tokens, r.usage.output_tokens, r.id)


@dataclass
class Turn:
    sent: list[dict[str, Any]]  # the conversation as sent (chat form)
    reply: Reply


@dataclass
class Session:
    """One agent conversation; each turn may go through another API."""

    messages: list[dict[str, Any]] = field(
        default_factory=lambda: [{"role": "system", "content": SYSTEM}, *copy.deepcopy(PRIOR)])
    turns: list[Turn] = field(default_factory=list)

    async def turn(self, api: Ask, new: dict[str, Any] | None = None) -> Reply:
        if new is not None:
            self.messages.append(new)
        sent = copy.deepcopy(self.messages)
        reply = await api(sent)
        self.messages.append(reply.message)
        self.turns.append(Turn([_plain(m) for m in sent], reply))
        return reply


def check_reuse(turns: list[Turn], done: DoneLines) -> None:
    """The chat tests' rule: from turn 2 on, cached covers the previous prompt and reply
    minus at most one page, and the prefill is the new tokens plus at most one page."""
    assert len(done.rows) == len(turns)
    for k in range(1, len(turns)):
        prev, cur = turns[k - 1].reply, turns[k].reply
        before = prev.prompt_tokens + prev.completion_tokens
        prompt, cached, prefilled = done.rows[k]
        assert (cur.prompt_tokens, cur.cached_tokens) == (prompt, cached), (k, done.rows[k])
        assert cached >= before - PAGE, (k, cached, before)
        assert prefilled <= prompt - before + PAGE, (k, prefilled, prompt - before)


def assert_text_same_or_near_tie(text: str, cold: dict[str, Any], delta: float) -> None:
    """The near-tie rule of agent.py on parsed text: ``text`` must equal the cold reply,
    or first differ where the cold server saw a near-tie: at that token the cached text
    goes on with one of the cold server's alternatives within ``delta`` of its choice."""
    if text == cold["text"]:
        return
    tokens = cold["tokens"]
    raw = "".join(t["token"] for t in tokens)
    assert cold["text"] == raw.strip(), "only replies of one segment (reasoning) are compared"
    lead = len(raw) - len(raw.lstrip())
    i = next((j for j, (a, b) in enumerate(zip(text, cold["text"], strict=False)) if a != b),
             min(len(text), len(cold["text"])))
    at, start, k = lead + i, 0, 0
    while k < len(tokens) and start + len(tokens[k]["token"]) <= at:
        start += len(tokens[k]["token"])
        k += 1
    assert k < len(tokens), f"cached {text!r} vs cold {cold['text']!r}"
    t = tokens[k]
    rest = text[max(0, start - lead):]
    for alt in t["top_logprobs"]:
        a = alt["token"]
        fits = rest.startswith(a) or (not rest and not a.strip())
        if a != t["token"] and fits and t["logprob"] - alt["logprob"] <= delta:
            return
    raise AssertionError(f"token {k}: cached goes on with {rest[:8]!r}, cold chose "
                         f"{t['token']!r} among {t['top_logprobs']}")


async def same_as_cold(model: Path, tmp: Path, turns: list[Turn], max_tokens: int, *,
                       near_tie: float = NEAR_TIE, **overrides: Any) -> None:
    """Each request again through chat completions on a server with caching off: the
    same reply, or one that first differs at a near-tie (within ``near_tie``)."""
    overrides = {**overrides, "cache__enabled": False, "server__lanes": 1}
    async with serve(model, tmp / "cold", **overrides) as cold:
        for t in turns:
            r = await ask(cold.client, t.sent, max_tokens, tools=TOOLS)
            assert r["prompt_tokens"] == t.reply.prompt_tokens
            assert r["completion_tokens"] == t.reply.completion_tokens
            assert_text_same_or_near_tie(t.reply.text, r, near_tie)
