"""Every vendored template that renders tool calls, served for real: the model writes a
call in its family's own syntax, and the openai and anthropic SDKs get it back as a call
on all three APIs, streaming and not, with typed arguments, each API's stream in its
owner's events (a chat call's id and name before its arguments, Anthropic's thinking and
tool_use blocks with input_json_delta, Responses' function_call_arguments deltas adding up
to .done, the same blocks and items as the whole reply); and a call the server forces
in the family's own form (tool_choice, after a reasoning budget) reads back as a call.

A random-weight model writes any exact text when a GBNF ``grammar`` forces it: the reply
is what the template renders for an assistant turn with reasoning and one call of
``read_file`` (``path`` a string, ``limit`` an integer), from where its generation
prompt ends. One engine (the tiny synthetic hybrid, whose vocabulary of single
characters writes any text) serves an app per template, each on its own port, so the
model is loaded once; the templates' requests run eight at a time, one lane each, so the
engine decodes them in one batch. The engine runs one thread: on a machine whose cores
are busy with other work, llama.cpp's two threads wait on each other at every step and
decode twenty times slower (150 tokens: 20 s against 0.9 s here).

The work runs once, in a fixture; each template's test asserts on its own results.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from anthropic import AsyncAnthropic
from gguf import TokenType
from openai import AsyncOpenAI

from proxy.api.app import create_app
from proxy.api.appstate import TEMPLATE
from proxy.api.render import ChatTemplate
from proxy.api.syntax.probe import PROBE_TOOLS, probe_reply
from proxy.engine.engine import Engine
from proxy.engine.grammar import literal
from statecache.config import load_config
from tools.synth_gguf import SPECIAL_IDS, VOCAB
from tools.tool_families import lost_chars, reuse

pytestmark = [pytest.mark.http, pytest.mark.model]

TEMPLATES = Path(__file__).resolve().parents[2] / "vendor" / "templates" / "llama.cpp"
ARGS = {"path": "src/a b.py", "limit": 5}
CALL = (("zqcA1b2C3", ARGS),)
USER = "Read the file."
LANES = 8
CANONICAL = {str(i): 100 for i in SPECIAL_IDS.values()} | {
    str(i): -100 for i, t in enumerate(VOCAB.types) if t == TokenType.BYTE}
# described parameters: Command R+'s template concatenates their descriptions
PICK = {"name": "pick", "description": "Pick one",
        "input_schema": {"type": "object", "properties": {
            "n": {"type": "integer", "description": "how many"},
            "mode": {"type": "string", "enum": ["fast", "slow"], "description": "how"}},
            "required": ["n", "mode"]}}


def _families() -> list[str]:
    """Templates whose calls we read back (the rest render none we know of)."""
    out = []
    for f in sorted(TEMPLATES.glob("*.jinja")):
        t = ChatTemplate(f.read_text(encoding="utf-8"), bos_token="<s>", eos_token="</s>")
        if t.syntax.name != "none":
            out.append(f.name)
    return out


FAMILIES = _families()


@dataclass
class Outcome:
    syntax: str = ""
    failures: list[str] = field(default_factory=list)
    prompt: int = 0  # turn N's prompt tokens
    reply: int = 0  # ...and its reply's
    cached: int = -1  # tokens turn N+1 (the call sent back, and its result) reused
    reuse: str = ""  # what tools/tool_families.py finds turn N+1 keeps, by the text
    lost: int = 0  # characters of turn N's prompt the template renders otherwise
    # the reply holds U+2581, which the synthetic vocabulary reads as its space: such a
    # text never tokenizes back as the model wrote it (DeepSeek's markers; a real
    # DeepSeek vocabulary has them as special tokens)
    spaced: bool = False


def _calls_ok(calls: list[tuple[str, Any]]) -> None:
    got = [(n, json.loads(a) if isinstance(a, str) else a) for n, a in calls]
    assert got == [("read_file", ARGS)], got


async def _check(name: str, engine: Engine, out: Outcome) -> None:
    app = create_app(engine, template_path=TEMPLATES / name, admin=False)
    tpl = app[TEMPLATE]
    out.syntax = tpl.syntax.name
    out.reuse = reuse(tpl)
    out.lost = lost_chars(tpl)
    reply = probe_reply(tpl.render, CALL, (engine.eos_token,))
    if not reply and tpl.call_form is not None:  # a template that lists tools only
        reply = tpl.call_form.write("read_file", ARGS)
    assert reply, name
    out.spaced = "\u2581" in reply
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    base = f"http://127.0.0.1:{server.port}"
    oa = AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
    an = AsyncAnthropic(base_url=base, api_key="x", max_retries=0, timeout=300)
    force = {"grammar": f"root ::= {literal(reply)}"}
    tools_anth = [{"name": "read_file", "description": "Read a file",
                   "input_schema": PROBE_TOOLS[0]["function"]["parameters"]}]
    tools_resp = [{"type": "function", **PROBE_TOOLS[0]["function"]}]
    n = 3 * len(reply) + 16  # a character outside the vocabulary takes a token a byte
    user = [{"role": "user", "content": USER}]

    async def models() -> None:
        m = await oa.models.list()
        assert m.data[0].model_dump()["tool_format"] == tpl.syntax.name

    async def chat() -> None:
        r = await oa.chat.completions.create(model="m", messages=user, tools=PROBE_TOOLS,
                                             max_tokens=n, temperature=0, extra_body=force)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", msg
        _calls_ok([(c.function.name, c.function.arguments) for c in msg.tool_calls or []])
        calls: dict[int, list[str]] = {}
        seen = thought = ""
        async for chunk in await oa.chat.completions.create(
                model="m", messages=user, tools=PROBE_TOOLS, max_tokens=n, temperature=0,
                extra_body=force, stream=True):
            for ch in chunk.choices:
                seen += ch.delta.content or ""
                thought += (ch.delta.model_extra or {}).get("reasoning_content") or ""
                for tc in ch.delta.tool_calls or []:
                    entry = calls.setdefault(tc.index, ["", ""])
                    if tc.function and tc.function.name:
                        assert not entry[0] and tc.id  # the id and name come first
                        entry[0] = tc.function.name
                    entry[1] += (tc.function.arguments or "") if tc.function else ""
        _calls_ok([(a, b) for a, b in calls.values()])
        assert (msg.content or "") == seen.strip()
        assert (msg.model_extra or {}).get("reasoning_content", "") == thought

    async def anthropic() -> None:
        m = await an.messages.create(model="m", max_tokens=n, tools=tools_anth,
                                     messages=user, extra_body=force)
        _calls_ok([(b.name, b.input) for b in m.content if b.type == "tool_use"])
        assert m.stop_reason == "tool_use"
        kinds: list[str] = []  # each block's type as it starts, and its deltas' types
        async with an.messages.stream(model="m", max_tokens=n, tools=tools_anth,
                                      messages=user, extra_body=force) as s:
            async for ev in s:
                if ev.type == "content_block_start":
                    kinds.append(ev.content_block.type)
                elif ev.type == "content_block_delta" and ev.delta.type not in kinds:
                    kinds.append(ev.delta.type)
            final = await s.get_final_message()
        _calls_ok([(b.name, b.input) for b in final.content if b.type == "tool_use"])
        assert final.stop_reason == "tool_use"
        assert "input_json_delta" in kinds[kinds.index("tool_use"):], kinds
        # streamed or not, the same blocks: thinking where the reply reasons, text, the call
        assert [(b.type, getattr(b, "thinking", None), getattr(b, "text", None))
                for b in final.content] == [
            (b.type, getattr(b, "thinking", None), getattr(b, "text", None))
            for b in m.content], (final.content, m.content)
        assert ("thinking" in kinds) == any(b.type == "thinking" for b in m.content)

    async def responses() -> None:
        resp = await oa.responses.create(model="m", input=USER, tools=tools_resp,
                                         max_output_tokens=n, extra_body=force)
        _calls_ok([(o.name, o.arguments) for o in resp.output if o.type == "function_call"])
        done: list[tuple[str, str]] = []
        deltas: dict[str, str] = {}  # a call item's arguments as their deltas add up
        finished: dict[str, str] = {}  # ... and as .done gives them
        items: list[Any] = []
        async for ev in await oa.responses.create(model="m", input=USER, tools=tools_resp,
                                                  max_output_tokens=n, extra_body=force,
                                                  stream=True):
            if ev.type == "response.function_call_arguments.delta":
                deltas[ev.item_id] = deltas.get(ev.item_id, "") + ev.delta
            elif ev.type == "response.function_call_arguments.done":
                finished[ev.item_id] = ev.arguments
            elif ev.type == "response.output_item.done":
                items.append(ev.item)
                if ev.item.type == "function_call":
                    done.append((ev.item.name, ev.item.arguments))
        _calls_ok(done)
        assert deltas == finished and list(finished.values()) == [a for _, a in done]
        # the same items, streamed or not: reasoning where the reply reasons, the call
        def shape(o: Any) -> tuple[str, str]:
            return o.type, json.dumps(o.model_dump(include={"content", "arguments", "name"}))
        assert [shape(o) for o in items] == [shape(o) for o in resp.output], items

    async def next_turn() -> None:
        # turn N+1: the call sent back as the client got it, and its result. A grammar
        # lets a random model spell the reply in any tokens (a special token's text in
        # characters, a character in bytes): biased to the tokens the text tokenizes to,
        # as a trained model writes it, so the reply can come back token for token
        r = await oa.chat.completions.create(model="m", messages=user, tools=PROBE_TOOLS,
                                             max_tokens=n, temperature=0, extra_body=force,
                                             logit_bias=CANONICAL)
        msg = r.choices[0].message.model_dump(exclude_none=True)
        msg.pop("refusal", None)
        result = {"role": "tool", "tool_call_id": msg["tool_calls"][0]["id"],
                  "content": "zqresult"}
        r2 = await oa.chat.completions.create(
            model="m", messages=[*user, msg, result], tools=PROBE_TOOLS, max_tokens=1,
            temperature=0)
        assert r.usage is not None and r2.usage is not None
        details = r2.usage.prompt_tokens_details
        out.prompt, out.reply = r.usage.prompt_tokens, r.usage.completion_tokens
        out.cached = details.cached_tokens if details and details.cached_tokens else 0

    async def forced() -> None:
        # the server's own grammar, in the family's form, after at most 8 tokens of
        # reasoning: a random model writes a call that the family's parser reads
        m = await an.messages.create(
            model="m", max_tokens=400, messages=user, tools=[PICK],
            tool_choice={"type": "tool", "name": "pick", "disable_parallel_tool_use": True},
            thinking={"type": "enabled", "budget_tokens": 8},
            extra_body={"temperature": 0})
        calls = [b for b in m.content if b.type == "tool_use"]
        assert [c.name for c in calls] == ["pick"], m.content
        assert isinstance(calls[0].input["n"], int), calls[0].input
        assert calls[0].input["mode"] in ("fast", "slow"), calls[0].input

    steps: list[tuple[str, Callable[[], Awaitable[None]]]] = [
        ("models", models), ("chat", chat), ("anthropic", anthropic), ("responses", responses),
        ("forced", forced), ("next turn", next_turn)]
    try:
        for label, step in steps:
            try:
                await step()
            except Exception as e:  # noqa: BLE001 - each step's failure is reported
                out.failures.append(f"{label}: {type(e).__name__}: {e}"[:2000])
    finally:
        await oa.close()
        await an.close()
        await server.close()


@pytest.fixture(scope="module")
def outcomes(hybrid_path: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Outcome]:
    tmp = tmp_path_factory.mktemp("families")
    cfg = load_config(None, {"model.path": str(hybrid_path), "model.n_ctx": 8192,
                             "model.threads": 1, "server.lanes": LANES,
                             "cache.disk_path": str(tmp / "ckpt"),
                             "cache.secret_path": str(tmp / "secret.key")})
    engine = Engine(cfg, hybrid_path)
    results = {name: Outcome() for name in FAMILIES}

    async def run_all() -> None:
        gate = asyncio.Semaphore(LANES)

        async def one(name: str) -> None:
            async with gate:
                try:
                    await _check(name, engine, results[name])
                except Exception as e:  # noqa: BLE001
                    results[name].failures.append(f"setup: {type(e).__name__}: {e}")

        await asyncio.gather(*(one(n) for n in FAMILIES))

    try:
        asyncio.run(run_all())
    finally:
        engine.close()
    return results


def test_every_template_that_renders_calls_is_served() -> None:
    # 64 of the 70 vendored templates write tool calls (the rest: Gemma 2, Phi 3.5,
    # RWKV, SmolLM3, Granite 3.3 and LFM2.5 Instruct render none)
    assert len(FAMILIES) == 64


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_calls_come_back_as_calls(name: str, outcomes: dict[str, Outcome]) -> None:
    out = outcomes[name]
    assert not out.failures, f"{name} ({out.syntax}):\n" + "\n".join(out.failures)


# the template moves the system text into the last user message: the next turn parts from
# this one inside the conversation (docs/tool-calls.md)
MOVES_SYSTEM = {"mistralai-Mistral-Nemo-Instruct-2407.jinja"}


@pytest.mark.parametrize("name", FAMILIES)
def test_the_turn_after_a_call_reuses_turn_n(name: str, outcomes: dict[str, Outcome]) -> None:
    # turn N's whole prompt and reply where the template renders them again, its prompt
    # where only that; else all but what it renders otherwise (the generation prompt,
    # Command R+'s closing turn) and the page the checkpoint before it falls in
    out = outcomes[name]
    if name in MOVES_SYSTEM or out.cached < 0:
        pytest.skip(out.reuse if name in MOVES_SYSTEM else "no turn N+1 (see the calls' test)")
    if out.reuse == "prompt+reply" and not out.spaced:  # from the reply's end
        want = out.prompt + out.reply - 1
    elif out.reuse.startswith("prompt,"):  # from the prompt's end
        want = out.prompt - 1
    else:
        # the synthetic vocabulary lacks most families' special tokens, so the prompt may
        # be cut for the replay point only where one of its own starts: a page of slack
        want = out.prompt - out.lost - 64
    assert out.cached >= want, (out.reuse, out.prompt, out.cached)
