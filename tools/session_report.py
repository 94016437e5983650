"""A multi-turn agent session against statecache, with caching on and off, side by side.

Each turn sends the whole conversation back (the server's previous reply with its
reasoning, then a tool result of a few hundred tokens), streams the reply and
measures the time to the first token. Prints one row per turn and the totals.

    python -m tools.session_report [--model models/hybrid-tiny.gguf] [--turns 10]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

from aiohttp import web
from openai import AsyncOpenAI

from proxy.server import build_app
from statecache.config import load_config

SYSTEM = "You are a coding agent. Read files, run tests, fix bugs. " * 20
TOOLS = [{"type": "function", "function": {
    "name": "run_tests", "description": "Run the tests.",
    "parameters": {"type": "object", "properties": {"filter": {"type": "string"}}}}}]


def tool_result(turn: int, size: int) -> dict[str, Any]:
    line = f"tests/test_pool.py::test_{turn} FAILED assert evict() == [{turn}, {turn + 1}]\n"
    return {"role": "tool", "tool_call_id": f"call_{turn}",
            "content": (line * (size // len(line) + 1))[:size]}


async def run_session(model: Path, cache: bool, turns: int, size: int,
                      max_tokens: int) -> list[dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, {"model.path": str(model), "server.lanes": 1,
                                 "model.n_ctx": 16384, "cache.enabled": cache,
                                 "cache.disk_path": tmp})
        runner = web.AppRunner(build_app(cfg))
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", timeout=600)
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM},
                                          {"role": "user", "content": "Fix the failing tests."}]
        rows = []
        try:
            for turn in range(turns):
                if turn:
                    messages.append(tool_result(turn, size))
                t0 = time.perf_counter()
                ttft = None
                reasoning, content, usage = "", "", None
                stream = await client.chat.completions.create(
                    model="m", messages=messages, tools=TOOLS, temperature=0,  # type: ignore[arg-type]
                    max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
                    extra_body={"chat_template_kwargs": {"preserve_thinking": True}})
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
                prev = rows[-1] if rows else None
                new = usage.prompt_tokens - (prev["prompt"] + prev["output"] if prev else 0)
                rows.append({"turn": turn + 1, "prompt": usage.prompt_tokens, "cached": cached,
                             "prefilled": usage.prompt_tokens - cached, "new": new,
                             "output": usage.completion_tokens, "ttft": ttft or 0.0})
                reply: dict[str, Any] = {"role": "assistant", "content": content}
                if reasoning:
                    reply["reasoning_content"] = reasoning
                messages.append(reply)
        finally:
            await client.close()
            await runner.cleanup()
        return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("models/hybrid-tiny.gguf"))
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--tool-chars", type=int, default=300, help="size of each tool result")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path, help="also write the rows here")
    args = ap.parse_args(argv)
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
