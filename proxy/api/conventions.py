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

import dataclasses
import hashlib
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
    short_ids: bool = False  # call ids of 9 letters and digits (Mistral's templates)


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
    if not (conv.null_content or conv.string_arguments or conv.short_ids):
        return out
    for m in out:
        if conv.short_ids and isinstance(m.get("tool_call_id"), str):
            m["tool_call_id"] = short_id(m["tool_call_id"])
        calls = m.get("tool_calls")
        if not calls:
            continue
        if conv.short_ids:
            calls = m["tool_calls"] = [_short_ids(c) for c in calls]
        if conv.null_content and m.get("content") == "":
            m["content"] = None
        if conv.string_arguments:
            m["tool_calls"] = [_string_arguments(c) for c in calls]
    return out


_ALNUM = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


def short_id(cid: str) -> str:
    """A call id as 9 letters and digits: itself if it is one (the model's own), else
    one derived from it, the same for the call and its result."""
    if len(cid) == 9 and cid.isascii() and cid.isalnum():
        return cid
    n = int.from_bytes(hashlib.sha256(cid.encode("utf-8")).digest()[:8], "big")
    return "".join(_ALNUM[(n >> (6 * k)) % 62] for k in range(9))


def _short_ids(call: Any) -> Any:
    if not isinstance(call, Mapping) or not isinstance(call.get("id"), str):
        return call
    return {**call, "id": short_id(call["id"])}


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
                return dataclasses.replace(conv, short_ids=_wants_short_ids(render, msgs,
                                                                            tools, conv))
    return Conventions(supplied=supplied)


def _wants_short_ids(render: Render, msgs: list[dict[str, Any]], tools: Any,
                     conv: Conventions) -> bool:
    """Whether the template refuses a call id of another shape than its own 9 letters
    and digits (Mistral's), which it takes where the id is one."""
    def renders(cid: str) -> bool:
        call = {**msgs[-1]["tool_calls"][0], "id": cid}
        turn = [*msgs[:-1], {**msgs[-1], "tool_calls": [call]},
                {"role": "tool", "tool_call_id": cid, "content": "zqres"}]
        try:
            render(adapt(turn, conv), tools, False, conv)
        except ValueError:
            return False
        return True
    return renders("zqcA1b2C3") and not renders("call_0123456789abcdefghijklmn")


def probe_trailer(render: Render, tools: Sequence[Mapping[str, Any]]) -> str:
    """Text the template writes after the last message whatever it is (Command R+'s
    closing instruction turn), or "": the next turn writes its messages where that text
    was, so the history a later turn can share ends before it."""
    head = [{"role": "system", "content": "zqsys"}, {"role": "user", "content": "zqa"}]
    try:
        a = render(head, tools, False, Conventions())
        b = render([*head, {"role": "assistant", "content": "zqb"},
                    {"role": "user", "content": "zqc"}], tools, False, Conventions())
    except ValueError:
        return ""
    if b.startswith(a):
        return ""
    at = 0
    while at < min(len(a), len(b)) and a[at] == b[at]:
        at += 1
    if a.rfind("<", 0, at) > a.rfind(">", 0, at):  # parted inside a tag: from its start
        at = a.rfind("<", 0, at)
    trailer = a[at:]
    return trailer if len(trailer.strip()) >= 16 and b.endswith(trailer) else ""
