"""Anthropic Messages response bodies: the ``message`` JSON, its SSE events, errors.

Usage follows Anthropic's rule that the prompt is ``input_tokens +
cache_creation_input_tokens + cache_read_input_tokens``: ``cache_read_input_tokens``
is the reused prefix, ``input_tokens`` what was prefilled, and creation is 0 (every
prefilled token is cached as a matter of course; nothing is billed). ``message_start``
goes out once the request has a lane and its plan, before the prefill, with that split
(as Anthropic's API fills it: clients and gateways read usage there); ``message_delta``
repeats it with the output tokens.

A stop sequence that ended the reply gives ``stop_reason: "stop_sequence"`` and names it
in ``stop_sequence``.

Streams open with ``message_start`` and a ``ping``; reasoning, text and each tool call
are content blocks in the order they are generated; a tool call's input arrives as
one ``input_json_delta``. Thinking blocks carry an empty signature: nothing here signs.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from proxy.api.reply import Delta, ParsedToolCall, ReplyParser
from proxy.engine.types import FinishEvent, StartEvent, TokenLogprob, Usage

JSON = dict[str, Any]

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> JSON:
    """Anthropic's error shape (``param`` and ``code`` have no place in it)."""
    kind = _ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def new_message_id() -> str:
    return "msg_" + secrets.token_hex(12)


def new_tool_use_id() -> str:
    return "toolu_" + secrets.token_hex(12)


def usage_json(u: Usage) -> JSON:
    return {"input_tokens": u.prompt_tokens - u.cached_tokens,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens,
            "output_tokens": u.completion_tokens}


def stop_reason(fin: FinishEvent, tool_calls: bool, window: bool = False) -> str:
    """``window``: ``max_tokens`` was cut to the context's room, so a reply cut by the
    limit ran out of context, not out of the client's budget. A reply the limit cut
    says so even where it holds tool calls (the last one may be cut short)."""
    if fin.reason == "length":
        return "model_context_window_exceeded" if window else "max_tokens"
    if tool_calls:
        return "tool_use"
    if fin.stop_sequence is not None:
        return "stop_sequence"
    return "end_turn"


def _tool_input(call: ParsedToolCall) -> JSON:
    args = json.loads(call.arguments)  # reply.py only yields calls with JSON arguments
    return args if isinstance(args, dict) else {"arguments": args}


def _tool_use(call: ParsedToolCall) -> JSON:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": _tool_input(call)}


def message_body(message_id: str, model: str, reply: Delta, fin: FinishEvent,
                 window: bool = False) -> JSON:
    """The non-streaming ``message``."""
    content: list[JSON] = []
    if reply.reasoning:
        content.append({"type": "thinking", "thinking": reply.reasoning, "signature": ""})
    if reply.content:
        content.append({"type": "text", "text": reply.content})
    content.extend(_tool_use(c) for c in reply.tool_calls)
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": content,
            "stop_reason": stop_reason(fin, bool(reply.tool_calls), window),
            "stop_sequence": _stop_sequence(fin, bool(reply.tool_calls)),
            "usage": usage_json(fin.usage)}


def _stop_sequence(fin: FinishEvent, tool_calls: bool) -> str | None:
    return None if tool_calls else fin.stop_sequence


class MessageEvents:
    """The SSE events of one streamed message (the ``Chunks`` protocol of
    proxy/api/streaming.py)."""

    early = True  # message_start as soon as the plan is known
    named = True
    end = b""

    def __init__(self, message_id: str, model: str, parser: ReplyParser,
                 prompt_tokens: int, window: bool = False) -> None:
        self._id, self._model = message_id, model
        self._window = window
        self._parser = parser
        self._prompt_tokens = prompt_tokens
        self._index = -1  # index of the open block, or of the last one closed
        self._open: str | None = None  # type of the open block
        self._n_calls = 0

    def _close(self) -> list[JSON]:
        if self._open is None:
            return []
        self._open = None
        return [{"type": "content_block_stop", "index": self._index}]

    def _block(self, kind: str, delta_kind: str, field: str, text: str) -> list[JSON]:
        """Text for a thinking or text block, opening one when another kind is open."""
        out: list[JSON] = []
        if self._open != kind:
            out += self._close()
            self._index += 1
            self._open = kind
            start: JSON = {"type": kind, field: ""}
            if kind == "thinking":
                start["signature"] = ""
            out.append({"type": "content_block_start", "index": self._index,
                        "content_block": start})
        out.append({"type": "content_block_delta", "index": self._index,
                    "delta": {"type": delta_kind, field: text}})
        return out

    def _call(self, call: ParsedToolCall) -> list[JSON]:
        out = self._close()
        self._index += 1
        self._n_calls += 1
        return [*out,
                {"type": "content_block_start", "index": self._index,
                 "content_block": {"type": "tool_use", "id": call.id, "name": call.name,
                                   "input": {}}},
                {"type": "content_block_delta", "index": self._index,
                 "delta": {"type": "input_json_delta",
                           "partial_json": json.dumps(_tool_input(call), ensure_ascii=False)}},
                {"type": "content_block_stop", "index": self._index}]

    def _deltas(self, d: Delta) -> list[JSON]:
        out: list[JSON] = []
        if d.reasoning:
            out += self._block("thinking", "thinking_delta", "thinking", d.reasoning)
        if d.content:
            out += self._block("text", "text_delta", "text", d.content)
        for call in d.tool_calls:
            out += self._call(call)
        return out

    def start(self, started: StartEvent | None = None) -> list[JSON]:
        usage = usage_json(Usage(prompt_tokens=self._prompt_tokens,
                                 cached_tokens=started.cached_tokens if started else 0))
        message: JSON = {"id": self._id, "type": "message", "role": "assistant",
                   "model": self._model, "content": [], "stop_reason": None,
                   "stop_sequence": None, "usage": usage}
        return [{"type": "message_start", "message": message}, {"type": "ping"}]

    def text(self, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> list[JSON]:
        return self._deltas(self._parser.feed(text))

    def finish(self, fin: FinishEvent) -> list[JSON]:
        out = self._deltas(self._parser.finish(cut=fin.reason == "length")) + self._close()
        out.append({"type": "message_delta",
                    "delta": {"stop_reason": stop_reason(fin, self._n_calls > 0,
                                                         self._window),
                              "stop_sequence": _stop_sequence(fin, self._n_calls > 0)},
                    "usage": usage_json(fin.usage)})
        out.append({"type": "message_stop"})
        return out

    def error(self, status: int, message: str) -> JSON:
        return error_body(status, message)
