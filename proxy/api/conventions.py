"""How a chat template wants its messages, learned by rendering it once when it loads.

Templates disagree on two things an assistant turn of tool calls carries:
- its ``content``: most concatenate it with strings and need "" (what we send by
  default), a few render the calls only when it is null (DeepSeek R1 Distill Llama:
  ``message['content'] is none``);
- each call's ``arguments``: most read an object (``arguments|items``, ``tojson``), a
  few concatenate a JSON text (Functionary v3.2, DeepSeek R1 Distill Llama).
The probe renders one call each way and keeps the first way whose render shows the
call's argument value (llama.cpp's chat-template capabilities probe the same two).

Some templates read variables that only llama.cpp supplies (FireFunction v2:
``functions``, the tools as indented JSON, and ``datetime``). A template whose source
reads one of ``SUPPLIED`` without setting it gets it, as llama.cpp renders it; the date
is the day (llama.cpp writes the second, which would change the system prompt on every
request and so miss the cache from its first tokens).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

SUPPLIED = ("functions", "datetime")
_PROBE_ARGS = {"path": "zqarg7.py"}


@dataclass(slots=True, frozen=True)
class Conventions:
    null_content: bool = False  # a turn of calls only gets content None, not ""
    string_arguments: bool = False  # call arguments as JSON text, not an object
    supplied: frozenset[str] = frozenset()  # the SUPPLIED variables the template reads


_CODE = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.S)
_STRING = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.S)


def reads(source: str, names: Sequence[str]) -> frozenset[str]:
    """Which of ``names`` a template reads as variables: named in its expressions and
    statements, outside their string literals, not as an attribute (``message.thinking``)
    (a look at its source: jinja2.meta's full analysis would double the cost of loading
    it). A template that sets one where the caller left it undefined still reads it."""
    code = " ".join(_STRING.sub("''", c) for c in _CODE.findall(source))
    return frozenset(n for n in names if re.search(rf"(?<![.\w]){n}\b", code))


def adapt(messages: Sequence[Mapping[str, Any]], conv: Conventions) -> list[dict[str, Any]]:
    """``messages`` as the template wants them."""
    out = [dict(m) for m in messages]
    if not (conv.null_content or conv.string_arguments):
        return out
    for m in out:
        calls = m.get("tool_calls")
        if not calls:
            continue
        if conv.null_content and m.get("content") == "":
            m["content"] = None
        if conv.string_arguments:
            m["tool_calls"] = [_string_arguments(c) for c in calls]
    return out


def _string_arguments(call: Any) -> Any:
    if not isinstance(call, Mapping):
        return call
    c = dict(call)
    fn = c.get("function")
    if isinstance(fn, Mapping) and not isinstance(fn.get("arguments"), str):
        c["function"] = {**fn, "arguments": json.dumps(fn.get("arguments"), ensure_ascii=False)}
    if "arguments" in c and not isinstance(c["arguments"], str):
        c["arguments"] = json.dumps(c["arguments"], ensure_ascii=False)
    return c


def supplied_vars(conv: Conventions, tools: Sequence[Mapping[str, Any]] | None
                  ) -> dict[str, str]:
    """The values of the ``SUPPLIED`` variables the template reads."""
    out: dict[str, str] = {}
    if "functions" in conv.supplied:
        out["functions"] = json.dumps(list(tools), indent=2, ensure_ascii=False) \
            if tools else ""
    if "datetime" in conv.supplied:
        out["datetime"] = datetime.now(UTC).strftime("%b %d %Y")
    return out


Render = Callable[..., str]


def probe_conventions(render: Render, supplied: frozenset[str]) -> Conventions:
    """The first way of writing a call-only turn whose render shows the call; ``render``
    takes messages already adapted (``ChatTemplate._render``)."""
    tools = [{"type": "function", "function": {
        "name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string", "description": "the file"}}}}}]
    call = {"id": "zqcA1b2C3", "type": "function",
            "function": {"name": "read_file", "arguments": _PROBE_ARGS},
            "arguments": _PROBE_ARGS}
    head = [{"role": "system", "content": "zqsys"}, {"role": "user", "content": "zquser"}]
    msgs: list[dict[str, Any]] = [*head, {"role": "assistant", "content": "",
                                          "tool_calls": [call]}]
    for string_arguments in (False, True):
        for null_content in (False, True):
            conv = Conventions(null_content, string_arguments, supplied)
            try:
                text = render(adapt(msgs, conv), tools, False, conv)
            except ValueError:
                continue
            if _PROBE_ARGS["path"] in text:
                return conv
    return Conventions(supplied=supplied)
