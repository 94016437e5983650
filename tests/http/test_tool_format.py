"""The tool-call syntax a server reads: probed from its chat template and named in the
start-up log and GET /v1/models, or set by ``model.tool_format``, which overrides the
probe (a reply is then read in the named family's syntax, not the template's)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from tests.http.conftest import serve

pytestmark = [pytest.mark.http, pytest.mark.model]

QWEN35 = Path(__file__).resolve().parents[2] / "vendor/templates/llama.cpp/Qwen3.5-4B.jinja"
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {
    "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}]
HERMES = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>'
XML = ("<tool_call>\n<function=read_file>\n<parameter=path>\na.py\n</parameter>\n"
       "</function>\n</tool_call>")


def _gbnf(text: str) -> str:
    return "root ::= " + '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace(
        "\n", "\\n") + '"'


@pytest.mark.parametrize(("tool_format", "syntax", "reads", "other"), [
    ("auto", "qwen3-xml", XML, HERMES), ("hermes", "hermes", HERMES, XML)])
async def test_the_syntax_is_probed_or_set_and_named(
        hybrid_path: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture,
        tool_format: str, syntax: str, reads: str, other: str) -> None:
    caplog.set_level(logging.INFO, logger="proxy.api.app")
    async with serve(hybrid_path, tmp_path / "ckpt", model__chat_template=str(QWEN35),
                     model__tool_format=tool_format, model__threads=1) as srv:
        listed = (await srv.client.models.list()).data[0].model_dump()["tool_format"]
        got = {}
        for text in (reads, other):
            r = await srv.client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "Read a.py."}], tools=TOOLS,
                max_tokens=3 * len(text), temperature=0,
                extra_body={"grammar": _gbnf(text),
                            "chat_template_kwargs": {"enable_thinking": False}})
            got[text] = r.choices[0].message
    assert listed == syntax
    how = "probed from the template" if tool_format == "auto" else "model.tool_format"
    started = [r.getMessage() for r in caplog.records if "chat template:" in r.getMessage()]
    assert len(started) == 1 and f"tool calls and reasoning: {syntax} syntax ({how})" \
        in started[0], started
    # the family's syntax is a call; the other family's is text
    calls = got[reads].tool_calls or []
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        ("read_file", '{"path": "a.py"}')]
    assert not got[other].tool_calls and got[other].content == other
