"""OpenAI response bodies: chat.completion(.chunk), text_completion, errors."""

from __future__ import annotations

import time
from typing import Any

from proxy.api.reply import Delta, ReplyParser
from proxy.engine.types import FinishEvent, StartEvent, TokenLogprob

JSON = dict[str, Any]


def error_body(status: int, message: str, *, param: str | None = None,
               code: str | None = None) -> JSON:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


# OpenAI's streams: bare ``data:`` lines, the last one ``[DONE]``
_END = b"data: [DONE]\n\n"


def finish_reason(fin: FinishEvent, tool_calls: bool) -> str:
    """A chat completion's ``finish_reason``: ``tool_calls`` where the reply ended with
    calls, but ``length`` where the token limit cut it, calls or not (a call may be cut
    short in the text; the client must know the reply is not whole), as llama-server
    and OpenAI's API say; the Responses API says ``incomplete``, Anthropic's
    ``max_tokens`` (proxy/api/anthropic_events.py)."""
    if tool_calls and fin.reason != "length":
        return "tool_calls"
    return fin.reason


class ChatChunks:
    """``chat.completion.chunk`` events, the text split by a ``StreamParser`` (the
    ``Chunks`` protocol of proxy/api/streaming.py)."""

    early = False
    named = False
    end = _END

    def __init__(self, request_id: str, model: str, parser: ReplyParser,
                 include_usage: bool) -> None:
        self._head = {"id": request_id, "object": "chat.completion.chunk",
                      "created": int(time.time()), "model": model}
        self._parser = parser
        self._usage = include_usage
        self._n_calls = 0

    def _chunk(self, delta: JSON, finish_reason: str | None = None) -> JSON:
        return {**self._head, "choices": [{"index": 0, "delta": delta, "logprobs": None,
                                           "finish_reason": finish_reason}]}

    def _deltas(self, d: Delta) -> list[JSON]:
        out = []
        if d.reasoning:
            out.append(self._chunk({"reasoning_content": d.reasoning}))
        if d.content:
            out.append(self._chunk({"content": d.content}))
        for call in d.tool_calls:  # the id and name first, then the arguments
            start = {"index": self._n_calls, "id": call.id, "type": "function",
                     "function": {"name": call.name, "arguments": ""}}
            args = {"index": self._n_calls, "function": {"arguments": call.arguments}}
            out += [self._chunk({"tool_calls": [start]}), self._chunk({"tool_calls": [args]})]
            self._n_calls += 1
        return out

    def start(self, started: StartEvent | None = None) -> list[JSON]:
        return [self._chunk({"role": "assistant", "content": ""})]

    def text(self, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> list[JSON]:
        out = self._deltas(self._parser.feed(text))
        if logprobs:
            # the tokens' logprobs ride on this event's first chunk (or an empty delta)
            if not out:
                out.append(self._chunk({}))
            out[0]["choices"][0]["logprobs"] = {"content": [lp.to_json() for lp in logprobs]}
        return out

    def finish(self, fin: FinishEvent) -> list[JSON]:
        out = self._deltas(self._parser.finish(cut=fin.reason == "length"))
        out.append(self._chunk({}, finish_reason(fin, self._n_calls > 0)))
        if self._usage:
            out.append({**self._head, "choices": [], "usage": fin.usage.to_json()})
        return out

    def error(self, status: int, message: str) -> JSON:
        return error_body(status, message)

    @staticmethod
    def completion(request_id: str, model: str, reply: Delta, fin: FinishEvent,
                   logprobs: list[TokenLogprob] | None = None) -> JSON:
        """The non-streaming ``chat.completion`` body."""
        message: JSON = {"role": "assistant",
                         "content": reply.content or (None if reply.tool_calls else "")}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.tool_calls:
            message["tool_calls"] = [c.to_json() for c in reply.tool_calls]
        reason = finish_reason(fin, bool(reply.tool_calls))
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                "model": model,
                "choices": [{"index": 0, "message": message,
                             "logprobs": None if logprobs is None else
                             {"content": [lp.to_json() for lp in logprobs]},
                             "finish_reason": reason}],
                "usage": fin.usage.to_json()}


class CompletionChunks:
    """``text_completion`` bodies and stream events."""

    early = False
    named = False
    end = _END

    def __init__(self, request_id: str, model: str, include_usage: bool) -> None:
        self._head = {"id": request_id, "object": "text_completion",
                      "created": int(time.time()), "model": model}
        self._usage = include_usage

    def _chunk(self, text: str, finish_reason: str | None = None) -> JSON:
        return {**self._head, "choices": [{"index": 0, "text": text, "logprobs": None,
                                           "finish_reason": finish_reason}]}

    def start(self, started: StartEvent | None = None) -> list[JSON]:
        return []

    def text(self, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> list[JSON]:
        if not text and not logprobs:
            return []
        chunk = self._chunk(text)
        if logprobs:
            chunk["choices"][0]["logprobs"] = _legacy_logprobs(list(logprobs))
        return [chunk]

    def finish(self, fin: FinishEvent) -> list[JSON]:
        out = [self._chunk("", fin.reason)]
        if self._usage:
            out.append({**self._head, "choices": [], "usage": fin.usage.to_json()})
        return out

    def error(self, status: int, message: str) -> JSON:
        return error_body(status, message)

    def completion(self, text: str, fin: FinishEvent,
                   logprobs: list[TokenLogprob] | None = None) -> JSON:
        body = {**self._chunk(text, fin.reason), "usage": fin.usage.to_json()}
        if logprobs is not None:
            body["choices"][0]["logprobs"] = _legacy_logprobs(logprobs)
        return body


def _legacy_logprobs(logprobs: list[TokenLogprob]) -> JSON:
    """The completions endpoint's form: parallel lists."""
    offsets, at = [], 0
    for lp in logprobs:
        offsets.append(at)
        at += len(lp.token)
    return {"tokens": [lp.token for lp in logprobs],
            "token_logprobs": [lp.logprob for lp in logprobs],
            "top_logprobs": [dict(lp.top) for lp in logprobs],
            "text_offset": offsets}
