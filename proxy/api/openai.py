"""Parse and validate OpenAI request bodies into frozen records.

Every rejection is an ``ApiError`` (a ``ValueError``) that names the offending
parameter, so the app can answer 400 in OpenAI's error shape. Unknown top-level
fields are ignored (clients send many); a known field with a wrong type is not.
``null`` on an optional field means "absent", as OpenAI's own clients send it.

Choices where OpenAI leaves room:
- ``developer`` messages are rendered as ``system``.
- Text content parts are joined with "\\n" (as vLLM does); image, audio and file
  parts are rejected: the models served here read text only.
- ``max_completion_tokens`` wins over ``max_tokens`` when both are given.
- ``top_k`` of -1 (vLLM's "off") is read as 0 (off here).
- ``seed`` of -1 means "random" (llama.cpp's convention), as an absent seed does.
- A ``temperature`` above 0 but below ``MIN_TEMPERATURE`` is greedy: dividing logits
  by it would overflow, and sampling at it is greedy in effect.
- ``tool_choice``: ``"none"`` only turns off tool-call extraction (tools stay in the
  prompt so its prefix, and so the cache, does not change with the choice); ``"auto"``
  is the default.
- Fields the sampler cannot act on yet are refused by name (400) when set to anything
  but their default, never accepted and ignored: ``logit_bias``, ``presence_penalty``,
  ``frequency_penalty``, ``repetition_penalty``/``repeat_penalty``, a
  ``response_format`` other than text, a forced ``tool_choice`` ("required" or a
  named function), ``parallel_tool_calls: false`` with tools; for completions also
  ``echo``, ``best_of`` > 1 and ``suffix``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.engine.types import SamplingParams

# Template variables the renderer sets itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARS = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
     "raise_exception", "strftime_now"}
)
_ROLES = {"system": "system", "developer": "system", "user": "user",
          "assistant": "assistant", "tool": "tool"}
_UNSUPPORTED_PARTS = {"image_url", "input_image", "image", "input_audio", "audio", "file"}
MAX_STOP = 4
MIN_TEMPERATURE = 1e-6
MAX_SEED = 2**64 - 1
NOT_YET = "is not supported by this server yet; leave it out or send its default"


class ApiError(ValueError):
    """A request the client got wrong (HTTP 400), with the parameter at fault."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(slots=True, frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # a JSON text, as OpenAI sends it


@dataclass(slots=True, frozen=True)
class ChatMessage:
    role: str  # system | user | assistant | tool
    content: str | None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    reasoning_content: str | None = None


@dataclass(slots=True, frozen=True)
class Sampling:
    """Sampling fields as sent; ``max_tokens`` stays None until the prompt length is known."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None

    def to_params(self, max_tokens: int) -> SamplingParams:
        # Every API's parser builds a Sampling: a vanishing temperature is greedy for all.
        temperature = 0.0 if self.temperature < MIN_TEMPERATURE else self.temperature
        return SamplingParams(temperature=temperature, top_p=self.top_p, top_k=self.top_k,
                              min_p=self.min_p, seed=self.seed, max_tokens=max_tokens,
                              stop=self.stop, logprobs=self.logprobs)


@dataclass(slots=True, frozen=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    tools: tuple[Mapping[str, Any], ...] | None
    tool_choice: str | Mapping[str, Any] | None
    template_kwargs: Mapping[str, Any]
    sampling: Sampling
    stream: bool
    include_usage: bool
    user: str | None

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(slots=True, frozen=True)
class CompletionRequest:
    model: str
    prompt: str
    sampling: Sampling
    stream: bool
    include_usage: bool
    user: str | None


def _type_name(v: object) -> str:
    return "null" if v is None else type(v).__name__


def _opt_str(body: Mapping[str, Any], key: str, param: str | None = None) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise ApiError(f"'{key}' must be a string, not {_type_name(v)}", param or key)
    return v


def _opt_bool(body: Mapping[str, Any], key: str, param: str | None = None) -> bool | None:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise ApiError(f"'{key}' must be a boolean, not {_type_name(v)}", param or key)
    return v


def _opt_int(body: Mapping[str, Any], key: str, lo: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # JSON has one number type; 100.0 is 100
    if not isinstance(v, int) or isinstance(v, bool):
        raise ApiError(f"'{key}' must be an integer, not {_type_name(v)}", key)
    if lo is not None and v < lo:
        raise ApiError(f"'{key}' must be >= {lo}, got {v}", key)
    return v


def _opt_float(body: Mapping[str, Any], key: str, lo: float, hi: float,
               lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise ApiError(f"'{key}' must be a number, not {_type_name(v)}", key)
    if not (lo < v if lo_open else lo <= v) or v > hi:
        bracket = "(" if lo_open else "["
        raise ApiError(f"'{key}' must be in {bracket}{lo:g}, {hi:g}], got {v}", key)
    return float(v)


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError("'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP:
        raise ApiError(f"'stop' may hold at most {MAX_STOP} strings, got {len(items)}", "stop")
    if any(s == "" for s in items):
        raise ApiError("'stop' strings must not be empty", "stop")
    return tuple(items)


def _seed(body: Mapping[str, Any]) -> int | None:
    seed = _opt_int(body, "seed", lo=-1)
    if seed is not None and seed > MAX_SEED:
        raise ApiError(f"'seed' must be at most {MAX_SEED} (or -1 for random), got {seed}",
                       "seed")
    return None if seed == -1 else seed


def _temperature(body: Mapping[str, Any]) -> float:
    t = _pick(_opt_float(body, "temperature", 0.0, 2.0), Sampling().temperature)
    return 0.0 if t < MIN_TEMPERATURE else t


def _set(body: Mapping[str, Any], key: str, default: object) -> bool:
    v = body.get(key)
    return v is not None and v != default


def refuse_unsupported(body: Mapping[str, Any]) -> None:
    """400 for a sampling field set to a value the sampler cannot honour yet."""
    for key, default in (("logit_bias", {}), ("presence_penalty", 0), ("frequency_penalty", 0),
                         ("repetition_penalty", 1), ("repeat_penalty", 1)):
        if _set(body, key, default):
            raise ApiError(f"'{key}' {NOT_YET}", key)


def parse_sampling(body: Mapping[str, Any]) -> Sampling:
    refuse_unsupported(body)
    top_k = _opt_int(body, "top_k", lo=-1)
    max_tokens = _opt_int(body, "max_tokens", lo=1)
    max_completion = _opt_int(body, "max_completion_tokens", lo=1)
    d = Sampling()
    return Sampling(
        temperature=_temperature(body),
        top_p=_pick(_opt_float(body, "top_p", 0.0, 1.0, lo_open=True), d.top_p),
        top_k=0 if top_k is None or top_k == -1 else top_k,
        min_p=_pick(_opt_float(body, "min_p", 0.0, 1.0), d.min_p),
        seed=_seed(body),
        max_tokens=max_completion if max_completion is not None else max_tokens,
        stop=_stop(body),
    )


MAX_TOP_LOGPROBS = 20


def _chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat: ``logprobs`` (bool) turns them on, ``top_logprobs`` (0-20) adds alternatives."""
    on = _opt_bool(body, "logprobs")
    top = _opt_int(body, "top_logprobs", lo=0)
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise ApiError(f"'top_logprobs' must be at most {MAX_TOP_LOGPROBS}", "top_logprobs")
    if top is not None and not on:
        raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def _completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """Completions: ``logprobs`` is the number of alternatives (0-5)."""
    n = _opt_int(body, "logprobs", lo=0)
    if n is not None and n > 5:
        raise ApiError("'logprobs' must be at most 5", "logprobs")
    return n


def _pick(v: float | None, default: float) -> float:
    return default if v is None else v


def _common(body: object) -> tuple[Mapping[str, Any], bool, bool]:
    """Checks shared by both endpoints; returns (body, stream, include_usage)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    _opt_str(body, "model")
    _opt_str(body, "user")
    n = _opt_int(body, "n", lo=1)
    if n not in (None, 1):
        raise ApiError(f"only n=1 is supported, got n={n}", "n")
    stream = bool(_opt_bool(body, "stream"))
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise ApiError("'stream_options' must be an object", "stream_options")
    usage = bool(_opt_bool(opts or {}, "include_usage", "stream_options.include_usage"))
    return body, stream, usage


def _content(v: object, param: str) -> str | None:
    if v is None or isinstance(v, str):
        return v
    if not isinstance(v, list):
        raise ApiError(f"'{param}' must be a string or a list of content parts", param)
    texts: list[str] = []
    for j, part in enumerate(v):
        p = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _UNSUPPORTED_PARTS:
            raise ApiError(f"content parts of type '{kind}' are not supported: "
                           "this server serves text-only models", p)
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ApiError(f"'{p}' must be {{\"type\": \"text\", \"text\": <string>}}", p)
        texts.append(part["text"])
    return "\n".join(texts)


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
    call_id = _opt_str(v, "id", f"{param}.id") or ""
    return ToolCall(id=call_id, name=fn["name"], arguments=args)


def _message(v: object, i: int) -> ChatMessage:
    param = f"messages[{i}]"
    if not isinstance(v, dict):
        raise ApiError(f"'{param}' must be an object", param)
    role = v.get("role")
    if role not in _ROLES:
        raise ApiError(f"'{param}.role' must be one of {', '.join(_ROLES)}; got {role!r}",
                       f"{param}.role")
    role = _ROLES[role]
    content = _content(v.get("content"), f"{param}.content")
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
        name=_opt_str(v, "name", f"{param}.name"),
        tool_calls=tuple(_tool_call(c, f"{param}.tool_calls[{k}]")
                         for k, c in enumerate(calls or ())),
        tool_call_id=_opt_str(v, "tool_call_id", f"{param}.tool_call_id"),
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
    if v is None or v in ("none", "auto"):
        return v
    if v == "required" or (isinstance(v, dict) and v.get("type") == "function"):
        raise ApiError(f"a forced 'tool_choice' {NOT_YET} (use 'auto' or 'none')",
                       "tool_choice")
    raise ApiError("'tool_choice' must be 'none', 'auto', 'required' or "
                   "{\"type\": \"function\", ...}", "tool_choice")


def _refuse_chat_only(body: Mapping[str, Any]) -> None:
    fmt = body.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        raise ApiError(f"'response_format' other than {{\"type\": \"text\"}} {NOT_YET}",
                       "response_format")
    if body.get("parallel_tool_calls") is False and body.get("tools"):
        raise ApiError(f"'parallel_tool_calls': false {NOT_YET}", "parallel_tool_calls")


def _refuse_completion_only(body: Mapping[str, Any]) -> None:
    for key, default in (("echo", False), ("best_of", 1), ("suffix", "")):
        if _set(body, key, default):
            raise ApiError(f"'{key}' {NOT_YET}", key)


def _template_kwargs(body: Mapping[str, Any]) -> Mapping[str, Any]:
    v = body.get("chat_template_kwargs")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ApiError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    clash = sorted(RESERVED_TEMPLATE_VARS & v.keys())
    if clash:
        raise ApiError(f"'chat_template_kwargs' may not set {', '.join(clash)}",
                       "chat_template_kwargs")
    return dict(v)


def parse_chat_request(body: object) -> ChatRequest:
    body, stream, usage = _common(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ApiError("'messages' must be a non-empty list", "messages")
    _refuse_chat_only(body)
    return ChatRequest(
        model=body.get("model") or "",
        messages=tuple(_message(m, i) for i, m in enumerate(msgs)),
        tools=_tools(body.get("tools")),
        tool_choice=_tool_choice(body.get("tool_choice")),
        template_kwargs=_template_kwargs(body),
        sampling=dataclasses.replace(parse_sampling(body), logprobs=_chat_logprobs(body)),
        stream=stream,
        include_usage=usage,
        user=body.get("user"),
    )


def parse_completion_request(body: object) -> CompletionRequest:
    body, stream, usage = _common(body)
    _refuse_completion_only(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise ApiError("'prompt' must be a string (or a list of exactly one string)", "prompt")
    return CompletionRequest(model=body.get("model") or "", prompt=prompt,
                             sampling=dataclasses.replace(
                                 parse_sampling(body), logprobs=_completion_logprobs(body)),
                             stream=stream,
                             include_usage=usage, user=body.get("user"))
