"""Parse and validate OpenAI request bodies (chat completions, completions) into the
shared frozen records of proxy/api/chat.py.

Every rejection is an ``ApiError`` (a ``ValueError``, proxy/api/fields.py) that names
the offending parameter, so the app can answer 400 in OpenAI's error shape. Unknown
top-level fields are ignored (clients send many); a known field with a wrong type is
not. ``null`` on an optional field means "absent", as OpenAI's own clients send it.

Choices where OpenAI leaves room:
- ``developer`` messages are rendered as ``system``.
- Text content parts are joined with "\\n" (as vLLM does); image, audio and file
  parts are rejected: the models served here read text only.
- ``tool_choice``: ``"none"`` only turns off tool-call extraction (tools stay in the
  prompt so its prefix, and so the cache, does not change with the choice); ``"auto"``
  is the default.
- The sampling fields, OpenAI's and llama-server's: proxy/api/sampling.py.
- ``response_format`` json_object / json_schema and a forced ``tool_choice``
  ("required" or a named function) constrain the reply with a grammar
  (proxy/api/structured.py); ``parallel_tool_calls: false`` allows one call at most.
  A schema the grammar cannot enforce is a 400 naming the part.
- Fields that would not act are refused by name (400) when set to anything but their
  default, never accepted and ignored: llama-server's sampling fields of that kind
  (proxy/api/sampling.py); for completions ``echo``, ``best_of`` > 1 and ``suffix``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from proxy.api.chat import (
    ChatMessage,
    ChatRequest,
    CompletionRequest,
    Mark,
    ToolCall,
    content_text,
)
from proxy.api.fields import (
    ApiError,
    opt_bool,
    opt_int,
    opt_str,
    refuse_set,
    session_key,
    template_kwargs,
)
from proxy.api.sampling import chat_logprobs, completion_logprobs, parse_sampling
from proxy.api.structured import constrained, constraint, json_format, spec
from proxy.api.thinking import chat_thinking

_ROLES = {"system": "system", "developer": "system", "user": "user",
          "assistant": "assistant", "tool": "tool"}
_TEXT_PARTS = {"text": "text"}  # the content parts read, and the key of their text
_COMPLETION_ONLY = (("echo", False), ("best_of", 1), ("suffix", ""))


def _common(body: object) -> tuple[Mapping[str, Any], bool, bool]:
    """Checks shared by both endpoints; returns (body, stream, include_usage)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    opt_str(body, "model")
    opt_str(body, "user")
    n = opt_int(body, "n", lo=1)
    if n not in (None, 1):
        raise ApiError(f"only n=1 is supported, got n={n}", "n")
    stream = bool(opt_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError("'stream_options' must be an object", "stream_options")
    usage = bool(opt_bool(opts or {}, "include_usage", "stream_options.include_usage"))
    return body, stream, usage


def _content(v: object, param: str) -> tuple[str | None, tuple[int, ...]]:
    """A message's content as one text (None: absent), and where its parts after the
    first start."""
    return (None, ()) if v is None else content_text(v, param, _TEXT_PARTS)


def _tool_call(v: object, param: str) -> ToolCall:
    if not isinstance(v, dict):
        raise ApiError(f"'{param}' must be an object", param)
    if v.get("type", "function") != "function":
        raise ApiError(f"'{param}.type' must be 'function'", f"{param}.type")
    fn = v.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ApiError(f"'{param}.function' must be an object with a string 'name'",
                       f"{param}.function")
    args = fn.get("arguments", "{}")
    if isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)  # lenient: some clients send the object
    if not isinstance(args, str):
        raise ApiError(f"'{param}.function.arguments' must be a JSON string",
                       f"{param}.function.arguments")
    call_id = opt_str(v, "id", f"{param}.id") or ""
    return ToolCall(id=call_id, name=fn["name"], arguments=args)


def _message(v: object, i: int, marks: list[Mark]) -> ChatMessage:
    param = f"messages[{i}]"
    if not isinstance(v, dict):
        raise ApiError(f"'{param}' must be an object", param)
    role = v.get("role")
    if role not in _ROLES:
        raise ApiError(f"'{param}.role' must be one of {', '.join(_ROLES)}; got {role!r}",
                       f"{param}.role")
    role = _ROLES[role]
    content, starts = _content(v.get("content"), f"{param}.content")
    marks.extend(Mark(i, at) for at in starts)
    if content is None and role != "assistant":
        raise ApiError(f"'{param}.content' is required for role '{role}'", f"{param}.content")
    calls = v.get("tool_calls")
    if calls is not None and (role != "assistant" or not isinstance(calls, list)):
        raise ApiError(f"'{param}.tool_calls' must be a list, on assistant messages only",
                       f"{param}.tool_calls")
    reasoning = v.get("reasoning_content")
    if reasoning is None:
        reasoning = v.get("reasoning")  # the name some servers and clients use
    if reasoning is not None and not isinstance(reasoning, str):
        raise ApiError(f"'{param}.reasoning_content' must be a string",
                       f"{param}.reasoning_content")
    return ChatMessage(
        role=role,
        content=content,
        name=opt_str(v, "name", f"{param}.name"),
        tool_calls=tuple(_tool_call(c, f"{param}.tool_calls[{k}]")
                         for k, c in enumerate(calls or ())),
        tool_call_id=opt_str(v, "tool_call_id", f"{param}.tool_call_id"),
        reasoning_content=reasoning,
    )


def _tools(v: object) -> tuple[Mapping[str, Any], ...] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise ApiError("'tools' must be a list", "tools")
    for k, t in enumerate(v):
        fn = t.get("function") if isinstance(t, dict) else None
        if (not isinstance(t, dict) or t.get("type") != "function" or not isinstance(fn, dict)
                or not isinstance(fn.get("name"), str)):
            raise ApiError(f"'tools[{k}]' must be {{\"type\": \"function\", \"function\": "
                           "{\"name\": ...}}", f"tools[{k}]")
    return tuple(v) or None


def _tool_choice(v: object) -> str | Mapping[str, Any] | None:
    if v is None or v in ("none", "auto", "required"):
        return v
    fn = v.get("function") if isinstance(v, dict) else None
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(fn, dict) \
            and isinstance(fn.get("name"), str):
        return {"type": "function", "function": {"name": fn["name"]}}
    raise ApiError("'tool_choice' must be 'none', 'auto', 'required' or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def parse_chat_request(body: object) -> ChatRequest:
    body, stream, usage = _common(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("'messages' must be a non-empty list", "messages")
    tools, choice = _tools(body.get("tools")), _tool_choice(body.get("tool_choice"))
    parallel = opt_bool(body, "parallel_tool_calls")
    sampling, max_tokens = parse_sampling(body)
    sampling = dataclasses.replace(sampling, logprobs=chat_logprobs(body))
    grammar = constraint(json_schema=json_format(body.get("response_format"),
                                                 "response_format"),
                         json_path="response_format.json_schema.schema", tools=tools,
                         tool_choice=choice, parallel=parallel is not False)
    marks: list[Mark] = []
    messages = tuple(_message(m, i, marks) for i, m in enumerate(msgs))
    return ChatRequest(
        model=body.get("model") or "",
        messages=messages,
        tools=tools,
        tool_choice=choice,
        template_kwargs=template_kwargs(body),
        sampling=constrained(sampling, grammar),
        constraint=spec(json_schema=json_format(body.get("response_format"), "response_format"),
                        json_path="response_format.json_schema.schema", tools=tools,
                        tool_choice=choice, parallel=parallel is not False,
                        params_key="function.parameters", grammar=grammar),
        stream=stream,
        include_usage=usage,
        user=body.get("user"),
        max_tokens=max_tokens,
        marks=tuple(marks),
        session=session_key(body.get("prompt_cache_key"), "prompt_cache_key"),
        thinking=chat_thinking(body),
    )


def parse_completion_request(body: object) -> CompletionRequest:
    body, stream, usage = _common(body)
    refuse_set(body, _COMPLETION_ONLY)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError("'prompt' must be a string (or a list of exactly one string)", "prompt")
    sampling, max_tokens = parse_sampling(body)
    return CompletionRequest(model=body.get("model") or "", prompt=prompt,
                             sampling=dataclasses.replace(
                                 sampling, logprobs=completion_logprobs(body)),
                             stream=stream, include_usage=usage, user=body.get("user"),
                             max_tokens=max_tokens)
