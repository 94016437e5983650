"""Anthropic Messages content blocks as chat messages, and the marks they carry: where
content parts start and where ``cache_control`` breakpoints end (proxy/api/hints.py
places them in the prompt).

The mapping is in proxy/api/anthropic.py's docstring.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from proxy.api.chat import ChatMessage, Mark, ToolCall, joined_parts
from proxy.api.fields import ApiError, obj, opt_bool

MAX_BREAKPOINTS = 4  # cache_control blocks in one request, as Anthropic allows
TTLS = {"5m": 300.0, "1h": 3600.0}


class Marks:
    """Where the message list being built stands, and the marks found in it: content
    parts' starts and cache breakpoints (ends of blocks with ``cache_control``)."""

    def __init__(self) -> None:
        self.marks: list[Mark] = []

    def parts(self, message: int, starts: tuple[int, ...]) -> None:
        self.marks.extend(Mark(message, at) for at in starts)

    def breakpoint(self, block: object, param: str, message: int, offset: int) -> None:
        ttl = _cache_ttl(block, param)
        if ttl:
            if sum(1 for m in self.marks if m.ttl) >= MAX_BREAKPOINTS:
                raise ApiError(f"at most {MAX_BREAKPOINTS} blocks may have 'cache_control'",
                               param)
            self.marks.append(Mark(message, offset, ttl))


def _cache_ttl(block: object, param: str) -> float:
    """The ``ttl`` of a block's ``cache_control`` in seconds; 0 without one."""
    if not isinstance(block, dict) or block.get("cache_control") is None:
        return 0.0
    cc = obj(block["cache_control"], f"{param}.cache_control")
    if cc.get("type", "ephemeral") != "ephemeral":
        raise ApiError(f"'{param}.cache_control.type' must be 'ephemeral'",
                       f"{param}.cache_control.type")
    ttl = cc.get("ttl", "5m")
    if ttl not in TTLS:
        raise ApiError(f"'{param}.cache_control.ttl' must be one of {', '.join(TTLS)}",
                       f"{param}.cache_control.ttl")
    return TTLS[ttl]


def _block_type(block: object, param: str) -> str:
    kind = obj(block, param).get("type")
    if not isinstance(kind, str):
        raise ApiError(f"'{param}.type' must be a string", f"{param}.type")
    return kind


def _text_of(block: Mapping[str, Any], param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise ApiError(f"'{param}.text' must be a string", f"{param}.text")
    return text


def _unsupported(kind: str, param: str) -> ApiError:
    return ApiError(f"content blocks of type '{kind}' are not supported here: this server "
                    "serves text-only models with client tools", param)


def texts(v: object, param: str, marks: Marks | None = None, message: int = 0) -> str:
    """A string, or a list of text blocks joined with "\\n" (system, tool results);
    ``marks`` takes their starts and breakpoints as points of message ``message``."""
    if isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise ApiError(f"'{param}' must be a string or a list of text blocks", param)
    out: list[str] = []
    for j, block in enumerate(v):
        p = f"{param}[{j}]"
        kind = _block_type(block, p)
        if kind != "text":
            raise _unsupported(kind, p)
        out.append(_text_of(block, p))
    text, starts = joined_parts(out)
    if marks is not None:
        marks.parts(message, starts)
        for j, block in enumerate(v):
            end = (starts[j] if j < len(starts) else len(text) + 1) - 1
            marks.breakpoint(block, f"{param}[{j}]", message, end)
    return text


def _tool_result(block: Mapping[str, Any], param: str) -> ChatMessage:
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str):
        raise ApiError(f"'{param}.tool_use_id' must be a string", f"{param}.tool_use_id")
    content = block.get("content")
    text = "" if content is None else texts(content, f"{param}.content")
    if opt_bool(block, "is_error", f"{param}.is_error"):
        text = "Error: " + text
    return ChatMessage(role="tool", content=text, tool_call_id=call_id)


def _user(content: list[Any], param: str, out: list[ChatMessage], marks: Marks) -> None:
    """Tool results become tool messages; runs of text between them, user messages."""
    texts: list[tuple[str, object, str]] = []  # (text, block, param)

    def flush() -> None:
        if texts:
            text, starts = joined_parts([t for t, _, _ in texts])
            marks.parts(len(out), starts)
            for k, (_, block, p) in enumerate(texts):
                end = (starts[k] if k < len(starts) else len(text) + 1) - 1
                marks.breakpoint(block, p, len(out), end)
            out.append(ChatMessage(role="user", content=text))
            texts.clear()

    for j, block in enumerate(content):
        p = f"{param}[{j}]"
        kind = _block_type(block, p)
        if kind == "text":
            texts.append((_text_of(block, p), block, p))
        elif kind == "tool_result":
            flush()
            result = _tool_result(block, p)
            marks.breakpoint(block, p, len(out), len(result.content or ""))
            out.append(result)
        else:
            raise _unsupported(kind, p)
    flush()


def _tool_use(block: Mapping[str, Any], param: str) -> ToolCall:
    call_id, name = block.get("id"), block.get("name")
    if not isinstance(call_id, str) or not isinstance(name, str):
        raise ApiError(f"'{param}' must have a string 'id' and 'name'", param)
    args = block.get("input", {})
    if not isinstance(args, dict):
        raise ApiError(f"'{param}.input' must be an object", f"{param}.input")
    return ToolCall(id=call_id, name=name, arguments=json.dumps(args, ensure_ascii=False))


def _assistant(content: list[Any], param: str) -> ChatMessage:
    reasoning: list[str] = []
    texts: list[str] = []
    calls: list[ToolCall] = []
    for j, block in enumerate(content):
        p = f"{param}[{j}]"
        kind = _block_type(block, p)
        if kind == "text":
            texts.append(_text_of(block, p))
        elif kind == "thinking":
            thinking = block.get("thinking")
            if not isinstance(thinking, str):
                raise ApiError(f"'{p}.thinking' must be a string", f"{p}.thinking")
            reasoning.append(thinking)
        elif kind == "tool_use":
            calls.append(_tool_use(block, p))
        elif kind != "redacted_thinking":
            raise _unsupported(kind, p)
    return ChatMessage(role="assistant", content="\n".join(texts),
                       reasoning_content="\n".join(reasoning) if reasoning else None,
                       tool_calls=tuple(calls))


def append_messages(v: object, out: list[ChatMessage], marks: Marks) -> None:
    """Appends the ``messages`` to ``out`` (which may hold the system prompt)."""
    if not isinstance(v, list) or not v:
        raise ApiError("'messages' must be a non-empty list", "messages")
    for i, m in enumerate(v):
        param = f"messages[{i}]"
        role = obj(m, param).get("role")
        content = m.get("content")
        if role not in ("user", "assistant", "system"):
            raise ApiError(f"'{param}.role' must be 'user', 'assistant' or 'system'; "
                           f"got {role!r}", f"{param}.role")
        if isinstance(content, str):
            out.append(ChatMessage(role=role, content=content))
            continue
        if role == "system":
            text = texts(content, f"{param}.content", marks, len(out))
            out.append(ChatMessage(role=role, content=text))
            continue
        if not isinstance(content, list):
            raise ApiError(f"'{param}.content' must be a string or a list of content blocks",
                           f"{param}.content")
        if role == "user":
            _user(content, f"{param}.content", out, marks)
        else:
            message = _assistant(content, f"{param}.content")
            for j, block in enumerate(content):
                marks.breakpoint(block, f"{param}.content[{j}]", len(out),
                                 len(message.content or ""))
            out.append(message)
    if v[-1].get("role") == "assistant":
        # The template would close the turn and open a new one: not a continuation.
        raise ApiError("the last message is from the assistant: continuing a prefilled reply "
                       "is not supported", f"messages[{len(v) - 1}]")
