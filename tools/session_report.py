"""A multi-turn agent session against statecache: per-turn prefill, reuse and TTFT.

By default (``--api`` not given) the session runs through chat completions twice, with
caching on and off, side by side: each turn sends the whole conversation back (the
server's previous reply with its reasoning, then a tool result of a few hundred tokens),
streams the reply and measures the time to the first token.

With ``--api chat|messages|responses|all`` the same agent session runs over each API
through its real SDK (openai for chat completions and Responses, anthropic for Messages),
each on a fresh server with caching on. The client keeps the conversation in the API's
own form and sends every reply back as that API's client does: chat messages with
``reasoning_content`` and ``tool_calls``; Anthropic content blocks (thinking, text,
tool_use) and ``tool_result`` blocks; Responses output items (reasoning, message,
function_call) and ``function_call_output`` items. The first request holds a system
prompt, the tools, a user message and an earlier tool call with its result; each later
turn adds the results of the reply's tool calls, or, when the reply called none, a tool
result and a user message in turn. One table per API: the cached tokens as the API
reports them (chat: ``prompt_tokens_details.cached_tokens``; responses:
``input_tokens_details.cached_tokens``; messages: ``cache_read_input_tokens``, with
``input_tokens`` the prefilled rest).

    python -m tools.session_report [--model models/hybrid-tiny.gguf] [--turns 10]
    python -m tools.session_report --api all --turns 4 --tool-chars 200 --max-tokens 32
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from proxy.server import build_app
from statecache.config import load_config

SYSTEM = "You are a coding agent. Read files, run tests, fix bugs. " * 20
TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "run_tests", "description": "Run the tests.",
    "parameters": {"type": "object", "properties": {"filter": {"type": "string"}}}}}]
APIS = ("chat", "messages", "responses")
PAGE = 32  # cache.page_size: a follow-up may re-prefill up to one page
CACHED_FIELD = {"chat": "usage.prompt_tokens_details.cached_tokens",
                "messages": "usage.cache_read_input_tokens (input_tokens: the prefilled rest)",
                "responses": "usage.input_tokens_details.cached_tokens"}
ENDPOINT = {"chat": "POST /v1/chat/completions, openai SDK",
            "messages": "POST /v1/messages, anthropic SDK",
            "responses": "POST /v1/responses, openai SDK"}
Row = dict[str, Any]


def tool_output(turn: int, size: int) -> str:
    line = f"tests/test_pool.py::test_{turn} FAILED assert evict() == [{turn}, {turn + 1}]\n"
    return (line * (size // len(line) + 1))[:size]


def tool_result(turn: int, size: int) -> dict[str, Any]:
    return {"role": "tool", "tool_call_id": f"call_{turn}", "content": tool_output(turn, size)}


@asynccontextmanager
async def serving(model: Path, cache: bool) -> AsyncIterator[int]:
    """A server on a free port (yielded), one lane, its own checkpoint directory."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, {"model.path": str(model), "server.lanes": 1,
                                 "model.n_ctx": 16384, "cache.enabled": cache,
                                 "cache.disk_path": tmp})
        runner = web.AppRunner(build_app(cfg))
        await runner.setup()
        try:
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            yield runner.addresses[0][1]
        finally:
            await runner.cleanup()


def row(turn: int, prev: Row | None, prompt: int, cached: int, output: int,
        ttft: float | None) -> Row:
    new = prompt - (prev["prompt"] + prev["output"] if prev else 0)
    return {"turn": turn, "prompt": prompt, "cached": cached, "prefilled": prompt - cached,
            "new": new, "output": output, "ttft": ttft or 0.0}


async def run_session(model: Path, cache: bool, turns: int, size: int,
                      max_tokens: int) -> list[Row]:
    async with serving(model, cache) as port:
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=600)
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": "Fix the failing tests."}]
        rows: list[Row] = []
        try:
            for turn in range(turns):
                if turn:
                    messages.append(tool_result(turn, size))
                t0 = time.perf_counter()
                ttft = None
                reasoning, content, usage = "", "", None
                kwargs: dict[str, Any] = {
                    "model": "m", "messages": messages, "tools": TOOLS, "temperature": 0,
                    "max_tokens": max_tokens, "stream": True,
                    "stream_options": {"include_usage": True},
                    "extra_body": {"chat_template_kwargs": {"preserve_thinking": True}}}
                stream = await client.chat.completions.create(**kwargs)
                async for chunk in stream:
                    if chunk.usage:
                        usage = chunk.usage
                    if not chunk.choices:
                        continue
                    d = chunk.choices[0].delta
                    r = (d.model_extra or {}).get("reasoning_content") or ""
                    if (r or d.content) and ttft is None:
                        ttft = time.perf_counter() - t0
                    reasoning += r
                    content += d.content or ""
                assert usage is not None and usage.prompt_tokens_details is not None
                cached = usage.prompt_tokens_details.cached_tokens or 0
                rows.append(row(turn + 1, rows[-1] if rows else None, usage.prompt_tokens,
                                cached, usage.completion_tokens, ttft))
                reply: dict[str, Any] = {"role": "assistant", "content": content}
                if reasoning:
                    reply["reasoning_content"] = reasoning
                messages.append(reply)
        finally:
            await client.close()
        return rows


# --- the same agent session over chat completions, Anthropic Messages and Responses ---

USER_FIRST = "The tests in tests/test_pool.py fail. Find out why and fix them."
# The earlier exchange the client already holds: a reasoning turn that called a tool.
PRIOR_REASONING = "I should run the failing tests first."
PRIOR_CALL = ("call_0", "run_tests", json.dumps({"filter": "test_pool"}))


def user_text(turn: int) -> str:
    return f"Turn {turn}: look at the eviction order again and say what you would change."


@dataclass
class Reply:
    prompt: int
    cached: int
    output: int
    ttft: float | None
    calls: list[str]  # the ids of the tool calls the reply made


class Client(Protocol):
    """One API's client; it keeps the conversation in that API's own form."""

    def add_tool_result(self, call_id: str, text: str) -> None: ...

    def add_user(self, text: str) -> None: ...

    async def turn(self) -> Reply: ...

    async def close(self) -> None: ...


class ChatClient:
    """Chat completions (openai SDK): messages, ``reasoning_content``, ``tool_calls``."""

    def __init__(self, port: int, max_tokens: int) -> None:
        self.sdk = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                               timeout=600, max_retries=0)
        self.max_tokens = max_tokens
        call_id, name, args = PRIOR_CALL
        self.messages: list[dict[str, Any]] = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": USER_FIRST},
            {"role": "assistant", "content": "", "reasoning_content": PRIOR_REASONING,
             "tool_calls": [{"id": call_id, "type": "function",
                             "function": {"name": name, "arguments": args}}]}]

    def add_tool_result(self, call_id: str, text: str) -> None:
        self.messages.append({"role": "tool", "tool_call_id": call_id, "content": text})

    def add_user(self, text: str) -> None:
        self.messages.append({"role": "user", "content": text})

    async def turn(self) -> Reply:
        kwargs: dict[str, Any] = {
            "model": "statecache", "messages": copy.deepcopy(self.messages), "tools": TOOLS,
            "temperature": 0, "max_tokens": self.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        ttft = None
        reasoning, content, usage = "", "", None
        calls: dict[int, dict[str, Any]] = {}
        stream = await self.sdk.chat.completions.create(**kwargs)
        async for chunk in stream:
            if chunk.usage:
                usage = chunk.usage
            if not chunk.choices:
                continue
            d = chunk.choices[0].delta
            r = (d.model_extra or {}).get("reasoning_content") or ""
            if (r or d.content or d.tool_calls) and ttft is None:
                ttft = time.perf_counter() - t0
            reasoning += r
            content += d.content or ""
            for tc in d.tool_calls or ():
                c = calls.setdefault(tc.index, {"id": "", "type": "function",
                                                "function": {"name": "", "arguments": ""}})
                c["id"] = tc.id or c["id"]
                if tc.function is not None:
                    c["function"]["name"] += tc.function.name or ""
                    c["function"]["arguments"] += tc.function.arguments or ""
        assert usage is not None and usage.prompt_tokens_details is not None
        reply: dict[str, Any] = {"role": "assistant", "content": content}
        if reasoning:
            reply["reasoning_content"] = reasoning
        if calls:
            reply["tool_calls"] = [calls[k] for k in sorted(calls)]
        self.messages.append(reply)
        return Reply(usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens or 0,
                     usage.completion_tokens, ttft, [c["id"] for c in reply.get("tool_calls", [])])

    async def close(self) -> None:
        await self.sdk.close()


class MessagesClient:
    """Anthropic Messages (anthropic SDK): the reply's content blocks go back as returned;
    tool results are ``tool_result`` blocks of a user message."""

    TOOLS = [{"name": t["function"]["name"], "description": t["function"]["description"],
              "input_schema": t["function"]["parameters"]} for t in TOOLS]

    def __init__(self, port: int, max_tokens: int) -> None:
        self.sdk = AsyncAnthropic(base_url=f"http://127.0.0.1:{port}", api_key="-",
                                  timeout=600, max_retries=0)
        self.max_tokens = max_tokens
        call_id, name, args = PRIOR_CALL
        self.messages: list[dict[str, Any]] = [
            {"role": "user", "content": [{"type": "text", "text": USER_FIRST}]},
            {"role": "assistant", "content": [
                {"type": "thinking", "thinking": PRIOR_REASONING, "signature": ""},
                {"type": "tool_use", "id": call_id, "name": name, "input": json.loads(args)}]}]

    def _user_block(self, block: dict[str, Any]) -> None:
        last = self.messages[-1]
        if last["role"] == "user":
            last["content"].append(block)
        else:
            self.messages.append({"role": "user", "content": [block]})

    def add_tool_result(self, call_id: str, text: str) -> None:
        self._user_block({"type": "tool_result", "tool_use_id": call_id, "content": text})

    def add_user(self, text: str) -> None:
        self._user_block({"type": "text", "text": text})

    async def turn(self) -> Reply:
        kwargs: dict[str, Any] = {
            "model": "statecache", "system": SYSTEM, "messages": copy.deepcopy(self.messages),
            "tools": self.TOOLS, "max_tokens": self.max_tokens,
            "extra_body": {"temperature": 0}}  # this SDK's stream() takes no temperature
        t0 = time.perf_counter()
        ttft = None
        async with self.sdk.messages.stream(**kwargs) as stream:
            async for event in stream:
                if event.type == "content_block_delta" and ttft is None:
                    ttft = time.perf_counter() - t0
            m = await stream.get_final_message()
        blocks = [b.model_dump(exclude_none=True) for b in m.content]
        self.messages.append({"role": "assistant", "content": blocks})
        u = m.usage
        cached = u.cache_read_input_tokens or 0
        prompt = u.input_tokens + cached + (u.cache_creation_input_tokens or 0)
        return Reply(prompt, cached, u.output_tokens, ttft,
                     [b["id"] for b in blocks if b["type"] == "tool_use"])

    async def close(self) -> None:
        await self.sdk.close()


class ResponsesClient:
    """OpenAI Responses (openai SDK), the whole input every turn: the reply's output items
    go back as returned; tool results are ``function_call_output`` items."""

    TOOLS = [{"type": "function", "name": t["function"]["name"],
              "description": t["function"]["description"],
              "parameters": t["function"]["parameters"]} for t in TOOLS]

    def __init__(self, port: int, max_tokens: int) -> None:
        self.sdk = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-",
                               timeout=600, max_retries=0)
        self.max_tokens = max_tokens
        call_id, name, args = PRIOR_CALL
        self.items: list[dict[str, Any]] = [
            {"role": "user", "content": USER_FIRST},
            {"type": "reasoning", "summary": [],
             "content": [{"type": "reasoning_text", "text": PRIOR_REASONING}]},
            {"type": "function_call", "call_id": call_id, "name": name, "arguments": args}]

    def add_tool_result(self, call_id: str, text: str) -> None:
        self.items.append({"type": "function_call_output", "call_id": call_id, "output": text})

    def add_user(self, text: str) -> None:
        self.items.append({"role": "user", "content": text})

    async def turn(self) -> Reply:
        kwargs: dict[str, Any] = {
            "model": "statecache", "instructions": SYSTEM, "input": copy.deepcopy(self.items),
            "tools": self.TOOLS, "temperature": 0, "max_output_tokens": self.max_tokens,
            "stream": True}
        t0 = time.perf_counter()
        ttft = None
        final = None
        stream = await self.sdk.responses.create(**kwargs)
        async for event in stream:
            if event.type.endswith(".delta") and ttft is None:
                ttft = time.perf_counter() - t0
            if event.type in ("response.completed", "response.incomplete"):
                final = event.response
        assert final is not None and final.usage is not None, "no final response event"
        items = [item.model_dump(exclude_none=True) for item in final.output]
        self.items.extend(items)
        u = final.usage
        return Reply(u.input_tokens, u.input_tokens_details.cached_tokens, u.output_tokens,
                     ttft, [i["call_id"] for i in items if i["type"] == "function_call"])

    async def close(self) -> None:
        await self.sdk.close()


CLIENTS: dict[str, Callable[[int, int], Client]] = {
    "chat": ChatClient, "messages": MessagesClient, "responses": ResponsesClient}


def add_next(client: Client, turn: int, calls: list[str], size: int) -> None:
    """What the client adds before request ``turn`` (0-based): the results of the
    previous reply's tool calls (turn 0: of the earlier call); when it called none, a
    tool result and a user message in turn."""
    if calls:
        for k, call_id in enumerate(calls):
            client.add_tool_result(call_id, tool_output(turn + k, size))
    elif turn % 2:
        # No call to answer (a synthetic model's reply runs out of tokens while reasoning):
        # a result arrives anyway, as in the default session.
        client.add_tool_result(f"call_{turn}", tool_output(turn, size))
    else:
        client.add_user(user_text(turn))


async def run_api_session(api: str, model: Path, turns: int, size: int,
                          max_tokens: int) -> list[Row]:
    """The agent session over one API, on a fresh server with caching on."""
    async with serving(model, cache=True) as port:
        client: Client = CLIENTS[api](port, max_tokens)
        rows: list[Row] = []
        calls = [PRIOR_CALL[0]]
        try:
            for turn in range(turns):
                add_next(client, turn, calls, size)
                reply = await client.turn()
                calls = reply.calls
                rows.append(row(turn + 1, rows[-1] if rows else None, reply.prompt,
                                reply.cached, reply.output, reply.ttft))
        finally:
            await client.close()
        return rows


def shortfall(rows: list[Row]) -> int:
    """The most that cached fell short of the previous prompt and reply, from turn 2 on."""
    return max((a["prompt"] + a["output"] - b["cached"] for a, b in zip(rows, rows[1:],
                                                                        strict=False)),
               default=0)


def print_api(api: str, rows: list[Row]) -> None:
    print(f"\n{api} ({ENDPOINT[api]}); cached = {CACHED_FIELD[api]}")
    print("turn  prompt  cached  prefilled   new  output  TTFT s")
    for r in rows:
        print(f"{r['turn']:4}  {r['prompt']:6}  {r['cached']:6}  {r['prefilled']:9}  "
              f"{r['new']:4}  {r['output']:6}  {r['ttft']:6.3f}")
    follow_on = rows[1:]
    short = shortfall(rows)
    excess = max((r["prefilled"] - r["new"] for r in follow_on), default=0)
    print(f"from turn 2 on: prefilled {sum(r['prefilled'] for r in follow_on):,}, new "
          f"{sum(r['new'] for r in follow_on):,}; cached short of the previous prompt + "
          f"reply by at most {short} (page {PAGE}: {'ok' if short <= PAGE else 'TOO MUCH'}); "
          f"prefill beyond the new tokens at most {excess}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("models/hybrid-tiny.gguf"))
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tool-chars", type=int, default=300, help="size of each tool result")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--api", choices=[*APIS, "all"],
                    help="run the agent session over this API (or each) with its SDK, caching "
                         "on; without it: chat completions with caching on and off")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
    if args.api:
        apis = APIS if args.api == "all" else (args.api,)
        print(f"model {args.model.name}: {args.turns} turns, tool results of "
              f"{args.tool_chars} characters, replies of {args.max_tokens} tokens, "
              "a fresh server per API")
        out = {}
        for api in apis:
            out[api] = asyncio.run(run_api_session(api, args.model, args.turns,
                                                   args.tool_chars, args.max_tokens))
            print_api(api, out[api])
        if args.json:
            args.json.write_text(json.dumps(out, indent=2))
        return 0
    on = asyncio.run(run_session(args.model, True, args.turns, args.tool_chars, args.max_tokens))
    off = asyncio.run(run_session(args.model, False, args.turns, args.tool_chars,
                                  args.max_tokens))
    print(f"model {args.model.name}: {args.turns} turns, tool results of {args.tool_chars} "
          f"characters, replies of {args.max_tokens} tokens")
    print("turn  prompt  new  | cache on: cached  prefilled  TTFT s | cache off: prefilled  TTFT s")
    for a, b in zip(on, off, strict=True):
        print(f"{a['turn']:4}  {a['prompt']:6}  {a['new']:4} | {a['cached']:16}  "
              f"{a['prefilled']:9}  {a['ttft']:6.3f} | {b['prefilled']:19}  {b['ttft']:6.3f}")
    follow_on = on[1:]
    print(f"prefilled from turn 2 on: cache on {sum(r['prefilled'] for r in follow_on):,}, "
          f"new tokens {sum(r['new'] for r in follow_on):,}, "
          f"cache off {sum(r['prefilled'] for r in off[1:]):,}")
    excess = max((r["prefilled"] - r["new"] for r in follow_on), default=0)
    print(f"largest prefill beyond the new tokens on a follow-up turn: {excess}")
    if args.json:
        args.json.write_text(json.dumps({"cache_on": on, "cache_off": off}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
