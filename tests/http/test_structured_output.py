"""Structured output, forced tool calls and every sampling field through the real server
and the real openai and anthropic clients.

The synthetic models have random weights: whatever they would write, a grammar keeps
the reply inside its schema, so each reply must parse and validate, seed after seed.
Their ChatML template opens ``<think>``, which a random model never closes: requests
turn thinking off (``enable_thinking: false``), except the one that checks that a
reasoning block may come first (a bias on ``</think>`` closes it at once).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest
from anthropic import AsyncAnthropic

from tests.http.conftest import DoneLines, serve
from tools.synth_gguf import SPECIAL_IDS, VOCAB

pytestmark = pytest.mark.http

ASK = [{"role": "user", "content": "Describe a customer order as JSON."}]
NO_THINK: dict[str, Any] = {"chat_template_kwargs": {"enable_thinking": False}}
NAME = {"type": "string", "maxLength": 12}

# nesting, enums, arrays and required fields; strings are bounded so that a random model
# (which closes a string only when it happens to pick '"') finishes well within max_tokens
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {
        "id": {"type": "integer"}, "status": {"enum": ["open", "paid", "shipped"]},
        "paid": {"type": "boolean"}},
     "required": ["id", "status", "paid"]},
    {"type": "object", "properties": {
        "customer": {"type": "object", "properties": {
            "name": NAME, "address": {"type": "object", "properties": {
                "city": NAME, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"]}},
            "required": ["name", "address"]},
        "items": {"type": "array", "maxItems": 3, "items": {
            "type": "object", "properties": {
                "sku": NAME, "qty": {"type": "integer"},
                "size": {"enum": ["S", "M", "L", None]}},
            "required": ["sku", "qty"]}},
        "note": {"anyOf": [NAME, {"type": "null"}]}},
     "required": ["customer", "items"]},
    {"type": "array", "minItems": 1, "maxItems": 4, "items": {
        "type": "array", "maxItems": 3, "items": {"enum": [1, 2.5, "three", True]}}},
    {"$defs": {"money": {"type": "object", "properties": {
        "amount": {"type": "number"}, "currency": {"enum": ["EUR", "USD"]}},
        "required": ["amount", "currency"]}},
     "type": "object", "properties": {"total": {"$ref": "#/$defs/money"},
                                      "tax": {"$ref": "#/$defs/money"},
                                      "when": {"type": "string", "format": "date"}},
     "required": ["total", "when"]},
]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": NAME, "unit": {"enum": ["c", "f"]},
                                     "days": {"type": "array", "items": {"type": "integer"},
                                              "maxItems": 2}},
    "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "local"]}},
    "required": ["zone"]}}}
TOOLS = [WEATHER, CLOCK]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def check_calls(message: Any, names: set[str]) -> int:
    """``message`` is tool calls only (none cut short), each naming one of ``names`` with
    valid arguments."""
    calls = message.tool_calls or []
    assert calls and not message.content, message
    for c in calls:
        assert c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])
    return len(calls)


async def test_json_schema_replies_validate_over_seeds(hybrid_path: Path,
                                                       tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        for k, schema in enumerate(SCHEMAS):
            for seed in range(4):
                fmt = {"type": "json_schema", "json_schema": {"name": f"s{k}", "schema": schema}}
                r = await srv.client.chat.completions.create(
                    model="x", messages=ASK, max_tokens=1500, seed=seed, temperature=1.0,  # type: ignore[arg-type]
                    response_format=fmt, extra_body=NO_THINK)  # type: ignore[arg-type]
                choice = r.choices[0]
                assert choice.finish_reason == "stop", (k, seed)
                jsonschema.validate(json.loads(choice.message.content or ""), schema)
        # streamed, the deltas join into the same kind of reply
        text = ""
        stream = await srv.client.chat.completions.create(
            model="x", messages=ASK, max_tokens=1500, seed=9, stream=True,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": {  # type: ignore[arg-type]
                "name": "s", "schema": SCHEMAS[1]}}, extra_body=NO_THINK)
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
        jsonschema.validate(json.loads(text), SCHEMAS[1])
        # json_object: any object (a bias towards '"' keeps a random model's strings short)
        r = await srv.client.chat.completions.create(
            model="x", messages=ASK, max_tokens=1500, seed=3,  # type: ignore[arg-type]
            response_format={"type": "json_object"},
            logit_bias={str(VOCAB.id('"')): 4}, extra_body=NO_THINK)
        assert isinstance(json.loads(r.choices[0].message.content or ""), dict)


async def test_forced_tool_calls_always_validate(hybrid_path: Path, tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        counts = []
        for seed in range(6):
            r = await srv.client.chat.completions.create(
                model="x", messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                max_tokens=600, seed=seed, temperature=1.0, extra_body=NO_THINK)
            # a random model may write call after call until the limit cuts it (3 of 6
            # seeds with the family's grammar): then it says length and lists the calls
            # it completed. A call (under 100 tokens) never alone reaches 600.
            fin = r.choices[0].finish_reason
            assert fin in ("tool_calls", "length"), r
            n = check_calls(r.choices[0].message, {"get_weather", "get_time"})
            if fin == "length":
                assert r.usage is not None and r.usage.completion_tokens == 600 and n > 1, r
            counts.append(n)
            one = await srv.client.chat.completions.create(
                model="x", messages=ASK, tools=TOOLS, tool_choice="required",  # type: ignore[arg-type]
                parallel_tool_calls=False, max_tokens=600, seed=seed, extra_body=NO_THINK)
            assert check_calls(one.choices[0].message, {"get_weather", "get_time"}) == 1
            named = await srv.client.chat.completions.create(
                model="x", messages=ASK, tools=TOOLS, max_tokens=600, seed=seed,  # type: ignore[arg-type]
                tool_choice={"type": "function", "function": {"name": "get_time"}},
                extra_body=NO_THINK)
            check_calls(named.choices[0].message, {"get_time"})
        assert max(counts) > 1, "parallel calls are allowed by default"
        # "auto" with parallel calls off: a call, when the model makes one, is alone
        r = await srv.client.chat.completions.create(
            model="x", messages=ASK, tools=TOOLS, parallel_tool_calls=False,  # type: ignore[arg-type]
            max_tokens=600, seed=1, logit_bias={str(SPECIAL_IDS["<tool_call>"]): 30},
            extra_body=NO_THINK)
        assert check_calls(r.choices[0].message, {"get_weather", "get_time"}) == 1
        # "none" keeps today's behaviour: no grammar, no parsing of calls
        r = await srv.client.chat.completions.create(
            model="x", messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=20,  # type: ignore[arg-type]
            logit_bias={str(SPECIAL_IDS["<tool_call>"]): 30}, extra_body=NO_THINK)
        assert not r.choices[0].message.tool_calls
        assert (r.choices[0].message.content or "").startswith("<tool_call>")


async def test_reasoning_comes_before_a_forced_call(hybrid_path: Path, tmp_path: Path) -> None:
    """The template opens <think>: the grammar lets the reply reason, then call. A bias
    on </think> closes the reasoning at once (a random model would ramble on)."""
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        r = await srv.client.chat.completions.create(
            model="x", messages=ASK, tools=[CLOCK], tool_choice="required", max_tokens=200,  # type: ignore[arg-type]
            parallel_tool_calls=False, seed=1,
            logit_bias={str(SPECIAL_IDS["</think>"]): 100})
        msg = r.choices[0].message
        assert check_calls(msg, {"get_time"}) == 1
        assert getattr(msg, "reasoning_content", None) in (None, "")


async def test_fields_that_act(hybrid_path: Path, tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", cache__enabled=False) as srv:
        async def text(max_tokens: int = 40, extra_body: dict[str, Any] | None = None,
                       **fields: Any) -> str:
            r = await srv.client.chat.completions.create(
                model="x", messages=ASK, max_tokens=max_tokens,  # type: ignore[arg-type]
                extra_body={**NO_THINK, **(extra_body or {})}, **fields)
            return r.choices[0].message.content or ""

        # the same seed gives the same text; another seed another
        a = await text(seed=5, temperature=1.0)
        assert a == await text(seed=5, temperature=1.0)
        assert a != await text(seed=6, temperature=1.0)
        # logit_bias: +100 forces its token, -100 bans one
        x = VOCAB.id("x")
        assert await text(max_tokens=12, seed=1, logit_bias={str(x): 100}) == "x" * 12
        greedy = await text(temperature=0)
        top = max(set(greedy), key=greedy.count)
        banned = await text(temperature=0, logit_bias={str(VOCAB.id(top)): -100})
        assert top not in banned and banned != greedy
        # a token the vocabulary lacks: the engine knows (the message names the field)
        with pytest.raises(openai.BadRequestError) as err:
            await text(logit_bias={"999999": 1})
        assert "'logit_bias' names token 999999" in str(err.value)
        # completions take it too
        c = await srv.client.completions.create(model="x", prompt="a", max_tokens=5,
                                                logit_bias={str(x): 100})
        assert c.choices[0].text == "xxxxx"

        # presence and frequency penalties lower repetition (five favoured characters)
        favoured = {str(VOCAB.id(ch)): 8 for ch in "abcde"}

        def repeats(s: str) -> int:
            return len(s) - len(set(s))

        window = {"repeat_last_n": -1}
        plain = await text(max_tokens=100, seed=2, logit_bias=favoured, extra_body=window)
        presence = await text(max_tokens=100, seed=2, logit_bias=favoured, presence_penalty=2.0,
                              extra_body=window)
        frequency = await text(max_tokens=100, seed=2, logit_bias=favoured,
                               frequency_penalty=2.0, extra_body=window)
        assert repeats(presence) < 0.7 * repeats(plain)
        assert repeats(frequency) < 0.3 * repeats(plain)
        # llama-server's GBNF
        assert await text(max_tokens=20, extra_body={"grammar": 'root ::= "yes" | "no"'}) \
            in ("yes", "no")


@pytest.mark.parametrize(("extra", "param"), [
    ({"mirostat": 2}, "mirostat"),
    ({"ignore_eos": True}, "ignore_eos"),
    ({"n_probs": 2}, "n_probs"),
    ({"samplers": ["top_k"]}, "samplers"),
    ({"grammar": "root ::= nothing"}, "grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "properties": {"n": {"type": "integer", "minimum": 0}}}}}},
     "response_format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     "tool_choice"),
])
async def test_fields_that_cannot_act_are_400s_naming_them(
        hybrid_path: Path, tmp_path: Path, extra: dict[str, Any], param: str) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        with pytest.raises(openai.BadRequestError) as err:
            await srv.client.chat.completions.create(
                model="x", messages=ASK, max_tokens=4, extra_body=extra)  # type: ignore[arg-type]
        body = err.value.body
        assert isinstance(body, dict) and body.get("param") == param, body
        ok = await srv.client.chat.completions.create(model="x", messages=ASK, max_tokens=2)  # type: ignore[arg-type]
        assert ok.choices[0].finish_reason == "length"


async def test_constrained_requests_reuse_cached_prefixes(
        hybrid_path: Path, tmp_path: Path, done_lines: DoneLines) -> None:
    """The grammar is the request's, never the cached state's: a schema-constrained
    follow-up starts from the conversation's checkpoint, and a plain request after it
    from the constrained one's."""
    system = {"role": "system", "content": "You answer in JSON. " * 40}
    fmt: Any = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0]}}
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        first = await srv.client.chat.completions.create(
            model="x", messages=[system, *ASK], max_tokens=300, temperature=0,  # type: ignore[arg-type]
            response_format=fmt, extra_body=NO_THINK)
        reply = first.choices[0].message.content or ""
        jsonschema.validate(json.loads(reply), SCHEMAS[0])
        follow = [system, *ASK, {"role": "assistant", "content": reply},
                  {"role": "user", "content": "Another one."}]
        second = await srv.client.chat.completions.create(
            model="x", messages=follow, max_tokens=300, temperature=0,  # type: ignore[arg-type]
            response_format=fmt, extra_body=NO_THINK)
        jsonschema.validate(json.loads(second.choices[0].message.content or ""), SCHEMAS[0])
        usage = second.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        assert usage.prompt_tokens_details.cached_tokens > first.usage.prompt_tokens - 40  # type: ignore[union-attr]
        third = await srv.client.chat.completions.create(
            model="x", messages=follow, max_tokens=8, temperature=0, extra_body=NO_THINK)  # type: ignore[arg-type]
        assert third.usage is not None and third.usage.prompt_tokens_details is not None
        assert third.usage.prompt_tokens_details.cached_tokens >= usage.prompt_tokens - 1


async def test_anthropic_and_responses_equivalents(hybrid_path: Path, tmp_path: Path) -> None:
    tools = [{"name": t["function"]["name"], "input_schema": t["function"]["parameters"]}
             for t in TOOLS]
    async with serve(hybrid_path, tmp_path / "ckpt") as srv, \
            AsyncAnthropic(base_url=srv.url, api_key="unused", max_retries=0) as claude:
        for seed_choice in ({"type": "any"}, {"type": "tool", "name": "get_weather"},
                            {"type": "any", "disable_parallel_tool_use": True}):
            msg = await claude.messages.create(
                model="m", max_tokens=600, messages=ASK, tools=tools,  # type: ignore[arg-type]
                tool_choice=seed_choice, thinking={"type": "disabled"})  # type: ignore[arg-type]
            uses = [b for b in msg.content if b.type == "tool_use"]
            # Anthropic's API takes no seed, so these replies are sampled afresh each run.
            # With parallel calls allowed a random model may keep writing calls until the
            # limit cuts it (8 replies of 60 here): then it says max_tokens and lists
            # the calls it completed. A call (under 100 tokens) never alone reaches 600.
            assert uses and msg.stop_reason in ("tool_use", "max_tokens"), msg
            if msg.stop_reason == "max_tokens":
                assert msg.usage.output_tokens == 600 and len(uses) > 1, msg
            for b in uses:
                jsonschema.validate(b.input, PARAMS[b.name])
            if seed_choice.get("type") == "tool":
                assert {b.name for b in uses} == {"get_weather"}
            if seed_choice.get("disable_parallel_tool_use"):
                assert len(uses) == 1
        msg = await claude.messages.create(
            model="m", max_tokens=1500, messages=ASK, thinking={"type": "disabled"},  # type: ignore[arg-type]
            output_config={"format": {"type": "json_schema", "schema": SCHEMAS[1]}})
        text = "".join(b.text for b in msg.content if b.type == "text")
        jsonschema.validate(json.loads(text), SCHEMAS[1])

        resp = await srv.client.responses.create(
            model="m", input="An order as JSON.", max_output_tokens=1500,
            reasoning={"effort": "none"},  # type: ignore[arg-type]
            text={"format": {"type": "json_schema", "name": "o", "schema": SCHEMAS[0]}})  # type: ignore[typeddict-item]
        jsonschema.validate(json.loads(resp.output_text), SCHEMAS[0])
        resp = await srv.client.responses.create(
            model="m", input="Call it.", max_output_tokens=600, reasoning={"effort": "none"},  # type: ignore[arg-type]
            tools=[{"type": "function", "name": "get_time", "strict": True,
                    "parameters": CLOCK["function"]["parameters"]}],  # type: ignore[list-item]
            tool_choice="required")
        calls = [o for o in resp.output if o.type == "function_call"]
        assert calls and all(c.name == "get_time" for c in calls)
        for c in calls:
            jsonschema.validate(json.loads(c.arguments), PARAMS["get_time"])


async def test_gemma_template_forced_call_and_json(gemma_path: Path, tmp_path: Path) -> None:
    """Gemma 3's GGUF has no chat template: the vendored fallback writes tool calls the
    same way, and the grammar makes a base model produce one (and JSON)."""
    async with serve(gemma_path, tmp_path / "ckpt", model__n_ctx=2048) as srv:
        r = await srv.client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "Weather in Oslo?"}],  # type: ignore[arg-type]
            tools=[WEATHER], tool_choice="required", parallel_tool_calls=False,
            max_tokens=120, temperature=0)
        assert check_calls(r.choices[0].message, {"get_weather"}) == 1
        r = await srv.client.chat.completions.create(
            model="x", messages=ASK, max_tokens=200, temperature=0,  # type: ignore[arg-type]
            response_format={"type": "json_schema", "json_schema": {"name": "s",
                                                                    "schema": SCHEMAS[0]}})
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content or ""), SCHEMAS[0])
