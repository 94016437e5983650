"""OpenAI Responses bodies: the ``response`` object, its SSE events, the stored turn.

Output items come in the order the templates render an assistant turn: a ``reasoning``
item (its text as one ``reasoning_text`` part), a ``message`` with one ``output_text``
part, then one ``function_call`` item per tool call. The reasoning item also carries
its text in ``encrypted_content`` (marked as ours), because some clients (the Codex
CLI) send back only that field: the next turn then renders the same reasoning and
resumes from the end of this reply.

A reply cut by the token limit ends ``incomplete`` (``response.incomplete``, with
``incomplete_details.reason = "max_output_tokens"``), as OpenAI's API does; otherwise
``response.completed``. Usage reports ``input_tokens_details.cached_tokens``.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Mapping
from typing import Any

from proxy.api.chat import ChatMessage, ToolCall
from proxy.api.reply import Delta, ParsedToolCall, ReplyParser
from proxy.api.responses import REASONING_MARK, ResponsesRequest
from proxy.engine.types import FinishEvent, StartEvent, TokenLogprob, Usage

JSON = dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def usage_json(u: Usage) -> JSON:
    return {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def response_head(response_id: str, model: str, req: ResponsesRequest) -> JSON:
    """The ``response`` object before any output: what the request asked for, echoed."""
    return {"id": response_id, "object": "response", "created_at": int(time.time()),
            "status": "in_progress", "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_tokens,
            "model": model, "output": [], "parallel_tool_calls": req.parallel_tool_calls,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning_effort, "summary": None},
            "store": req.store, "temperature": req.sampling.temperature,
            "text": {"format": {"type": "text"}},
            "tool_choice": _tool_choice_json(req.tool_choice),
            "tools": [dict(t) for t in req.tools_json], "top_p": req.sampling.top_p,
            "truncation": "disabled", "usage": None, "user": req.user,
            "metadata": dict(req.metadata)}


def _tool_choice_json(choice: object) -> object:
    if isinstance(choice, dict):  # chat form back to the Responses form
        return {"type": "function", "name": choice["function"]["name"]}
    return choice or "auto"


def reasoning_item(item_id: str, text: str, status: str = "completed") -> JSON:
    return {"type": "reasoning", "id": item_id, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}] if text else [],
            "encrypted_content": REASONING_MARK + text, "status": status}


def message_item(item_id: str, text: str | None, status: str = "completed") -> JSON:
    parts = [] if text is None else [_text_part(text)]
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": parts}


def _text_part(text: str) -> JSON:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(item_id: str, call: ParsedToolCall, namespaces: Mapping[str, str],
              arguments: str | None = None, status: str = "completed") -> JSON:
    item: JSON = {"type": "function_call", "id": item_id, "call_id": call.id,
                  "name": call.name,
                  "arguments": call.arguments if arguments is None else arguments,
                  "status": status}
    if call.name in namespaces:
        item["namespace"] = namespaces[call.name]
    return item


def finished(head: JSON, output: list[JSON], fin: FinishEvent) -> JSON:
    """The response when generation is over: completed, or incomplete at the token limit."""
    cut = fin.reason == "length"
    return {**head, "status": "incomplete" if cut else "completed",
            "completed_at": None if cut else int(time.time()),
            "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
            "output": output, "usage": usage_json(fin.usage)}


def output_items(reply: Delta, namespaces: Mapping[str, str]) -> list[JSON]:
    """The non-streaming output: reasoning, message, function calls."""
    out: list[JSON] = []
    if reply.reasoning:
        out.append(reasoning_item(new_id("rs"), reply.reasoning))
    if reply.content:
        out.append(message_item(new_id("msg"), reply.content))
    out.extend(call_item(new_id("fc"), c, namespaces) for c in reply.tool_calls)
    return out


def assistant_message(reply: Delta) -> ChatMessage:
    """The reply as the chat message a follow-up's history holds (for the store)."""
    return ChatMessage(role="assistant", content=reply.content,
                       reasoning_content=reply.reasoning or None,
                       tool_calls=tuple(ToolCall(c.id, c.name, c.arguments)
                                        for c in reply.tool_calls))


class ResponseEvents:
    """The SSE events of one streamed response (the ``Chunks`` protocol of
    proxy/api/streaming.py).

    ``reply`` gathers the parsed reply and ``final`` is the finished response, for the
    store, once ``finish`` has run.
    """

    early = False
    named = True
    end = b""

    def __init__(self, head: JSON, parser: ReplyParser,
                 namespaces: Mapping[str, str]) -> None:
        self._head = head
        self._namespaces = namespaces
        self._parser = parser
        self._seq = 0
        self._output: list[JSON] = []  # finished items
        self._open: str | None = None  # "reasoning" | "message": the item taking text
        self._open_id = ""
        self._text = ""
        self.reply = Delta()
        self.final: JSON | None = None

    def _event(self, kind: str, **fields: Any) -> JSON:
        ev = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return ev

    def _item_event(self, kind: str, item: JSON) -> JSON:
        return self._event(kind, output_index=len(self._output), item=item)

    def _part_event(self, kind: str, **fields: Any) -> JSON:
        return self._event(kind, item_id=self._open_id, output_index=len(self._output),
                           content_index=0, **fields)

    def _item(self, kind: str, text: str, status: str) -> JSON:
        if kind == "reasoning":
            return reasoning_item(self._open_id, text, status)
        return message_item(self._open_id, text if status == "completed" else None, status)

    def _part(self, kind: str, text: str) -> JSON:
        if kind == "reasoning":
            return {"type": "reasoning_text", "text": text}
        return _text_part(text)

    def _close(self) -> list[JSON]:
        kind = self._open
        if kind is None:
            return []
        done = "response.reasoning_text.done" if kind == "reasoning" \
            else "response.output_text.done"
        extra: JSON = {} if kind == "reasoning" else {"logprobs": []}
        item = self._item(kind, self._text, "completed")
        out = [self._part_event(done, text=self._text, **extra),
               self._part_event("response.content_part.done", part=self._part(kind, self._text)),
               self._item_event("response.output_item.done", item)]
        self._output.append(item)
        self._open, self._text = None, ""
        return out

    def _append(self, kind: str, text: str) -> list[JSON]:
        out: list[JSON] = []
        if self._open != kind:
            out += self._close()
            self._open, self._open_id = kind, new_id("rs" if kind == "reasoning" else "msg")
            out.append(self._item_event("response.output_item.added",
                                        self._item(kind, "", "in_progress")))
            out.append(self._part_event("response.content_part.added",
                                        part=self._part(kind, "")))
        self._text += text
        if kind == "reasoning":
            out.append(self._part_event("response.reasoning_text.delta", delta=text))
        else:
            out.append(self._part_event("response.output_text.delta", delta=text, logprobs=[]))
        return out

    def _call(self, call: ParsedToolCall) -> list[JSON]:
        out = self._close()
        item_id = new_id("fc")
        item = call_item(item_id, call, self._namespaces)
        out.append(self._item_event("response.output_item.added",
                                    call_item(item_id, call, self._namespaces, "",
                                              "in_progress")))
        out.append(self._event("response.function_call_arguments.delta", item_id=item_id,
                               output_index=len(self._output), delta=call.arguments))
        out.append(self._event("response.function_call_arguments.done", item_id=item_id,
                               output_index=len(self._output), name=call.name,
                               arguments=call.arguments))
        out.append(self._item_event("response.output_item.done", item))
        self._output.append(item)
        return out

    def _deltas(self, d: Delta) -> list[JSON]:
        self.reply.extend(d)
        out: list[JSON] = []
        if d.reasoning:
            out += self._append("reasoning", d.reasoning)
        if d.content:
            out += self._append("message", d.content)
        for call in d.tool_calls:
            out += self._call(call)
        return out

    def start(self, started: StartEvent | None = None) -> list[JSON]:
        return [self._event("response.created", response=self._head),
                self._event("response.in_progress", response=self._head)]

    def text(self, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> list[JSON]:
        return self._deltas(self._parser.feed(text))

    def finish(self, fin: FinishEvent) -> list[JSON]:
        out = self._deltas(self._parser.finish(cut=fin.reason == "length")) + self._close()
        self.final = finished(self._head, self._output, fin)
        kind = "response.incomplete" if fin.reason == "length" else "response.completed"
        out.append(self._event(kind, response=self.final))
        return out

    def error(self, status: int, message: str) -> JSON:
        code = "invalid_request_error" if status < 500 else "server_error"
        return self._event("error", code=code, message=message, param=None)
