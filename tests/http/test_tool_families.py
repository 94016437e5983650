"""Every vendored template that renders tool calls, served for real: the model writes a
call in its family's own syntax, and the openai and anthropic SDKs get it back as a call
on all three APIs, streaming and not, with typed arguments.

A random-weight model writes any exact text when a GBNF ``grammar`` forces it: the reply
is what the template renders for an assistant turn with reasoning and one call of
``read_file`` (``path`` a string, ``limit`` an integer), from where its generation
prompt ends. One engine (the tiny synthetic hybrid, whose vocabulary of single
characters writes any text) serves an app per template, each on its own port, so the
model is loaded once: the cheapest path that is still the real server and real clients.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestServer
from anthropic import AsyncAnthropic
from openai import AsyncOpenAI

from proxy.api.app import create_app
from proxy.api.render import ChatTemplate
from proxy.api.syntax.probe import PROBE_TOOLS, probe_reply
from proxy.engine.engine import Engine
from proxy.engine.grammar import literal
from proxy.models import resolve_model
from statecache.config import load_config

pytestmark = [pytest.mark.http, pytest.mark.model]

TEMPLATES = Path(__file__).resolve().parents[2] / "vendor" / "templates" / "llama.cpp"
ARGS = {"path": "src/a b.py", "limit": 5}
CALL = (("zqcA1b2C3", ARGS),)
USER = "Read the file."


# Each template costs 20 to 70 s here (six grammar-forced replies of 100 to 200 tokens
# on two busy cores), too long for every run of the suite over 52 templates:
# STATECACHE_ALL_TEMPLATES=1 serves every one; by default, these three families.
QUICK = ("Qwen3.5-4B.jinja", "GLM-4.6.jinja", "Qwen-Qwen3-0.6B.jinja")


def _served() -> list[str]:
    """Templates whose calls we read back (the rest render none, or a syntax we lack)."""
    if not os.environ.get("STATECACHE_ALL_TEMPLATES"):
        return list(QUICK)
    out = []
    for f in sorted(TEMPLATES.glob("*.jinja")):
        t = ChatTemplate(f.read_text(encoding="utf-8"), bos_token="<s>", eos_token="</s>")
        if t.syntax.name != "none":
            out.append(f.name)
    return out


@pytest.fixture(scope="module")
def engine(hybrid_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("families")
    cfg = load_config(None, {"model.path": str(hybrid_path), "model.n_ctx": 8192,
                             "server.lanes": 1, "cache.disk_path": str(tmp / "ckpt"),
                             "cache.secret_path": str(tmp / "secret.key")})
    eng = Engine(cfg, resolve_model(cfg.model.path))
    yield eng
    eng.close()


def _reply(name: str, engine: Engine) -> tuple[ChatTemplate, str]:
    src = (TEMPLATES / name).read_text(encoding="utf-8")
    t = ChatTemplate(src, bos_token=engine.bos_token, eos_token=engine.eos_token)
    reply = probe_reply(t.render, CALL, (engine.eos_token,))
    assert reply, name
    return t, reply


def _calls_ok(calls: list[tuple[str, Any]]) -> None:
    assert [(n, json.loads(a) if isinstance(a, str) else a) for n, a in calls] == \
        [("read_file", ARGS)]


@pytest.mark.parametrize("name", _served())
async def test_each_family_calls_come_back_as_calls(name: str, engine: Engine,
                                                    tmp_path: Path) -> None:
    tpl, reply = _reply(name, engine)
    app = create_app(engine, template_path=TEMPLATES / name, admin=False)
    server = TestServer(app, host="127.0.0.1", port=0)
    await server.start_server()
    base = f"http://127.0.0.1:{server.port}"
    oa = AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=120)
    an = AsyncAnthropic(base_url=base, api_key="x", max_retries=0, timeout=120)
    force = {"grammar": f"root ::= {literal(reply)}"}
    tools_chat = PROBE_TOOLS
    tools_anth = [{"name": "read_file", "description": "Read a file",
                   "input_schema": PROBE_TOOLS[0]["function"]["parameters"]}]
    tools_resp = [{"type": "function", **PROBE_TOOLS[0]["function"]}]
    n = len(reply) + 8
    try:
        models = await oa.models.list()
        assert models.data[0].model_dump()["tool_format"] == tpl.syntax.name
        # chat completions
        r = await oa.chat.completions.create(
            model="m", messages=[{"role": "user", "content": USER}], tools=tools_chat,
            max_tokens=n, temperature=0, extra_body=force)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", (name, msg)
        _calls_ok([(c.function.name, c.function.arguments) for c in msg.tool_calls or []])
        calls: dict[int, list[str]] = {}
        seen_content = ""
        async for chunk in await oa.chat.completions.create(
                model="m", messages=[{"role": "user", "content": USER}], tools=tools_chat,
                max_tokens=n, temperature=0, extra_body=force, stream=True):
            for ch in chunk.choices:
                seen_content += ch.delta.content or ""
                for tc in ch.delta.tool_calls or []:
                    entry = calls.setdefault(tc.index, ["", ""])
                    if tc.function and tc.function.name:
                        assert not entry[0] and tc.id  # the id and name come first
                        entry[0] = tc.function.name
                    entry[1] += (tc.function.arguments or "") if tc.function else ""
        _calls_ok([(a, b) for a, b in calls.values()])
        assert (msg.content or "") == seen_content.strip()
        # Anthropic Messages
        m = await an.messages.create(model="m", max_tokens=n, tools=tools_anth,
                                     messages=[{"role": "user", "content": USER}],
                                     extra_body=force)
        _calls_ok([(b.name, b.input) for b in m.content if b.type == "tool_use"])
        assert m.stop_reason == "tool_use"
        async with an.messages.stream(model="m", max_tokens=n, tools=tools_anth,
                                      messages=[{"role": "user", "content": USER}],
                                      extra_body=force) as s:
            final = await s.get_final_message()
        _calls_ok([(b.name, b.input) for b in final.content if b.type == "tool_use"])
        # Responses
        resp = await oa.responses.create(model="m", input=USER, tools=tools_resp,
                                         max_output_tokens=n, extra_body=force)
        _calls_ok([(o.name, o.arguments) for o in resp.output if o.type == "function_call"])
        done: list[tuple[str, str]] = []
        async for ev in await oa.responses.create(model="m", input=USER, tools=tools_resp,
                                                  max_output_tokens=n, extra_body=force,
                                                  stream=True):
            if ev.type == "response.output_item.done" and ev.item.type == "function_call":
                done.append((ev.item.name, ev.item.arguments))
        _calls_ok(done)
    finally:
        await oa.close()
        await an.close()
        await server.close()
