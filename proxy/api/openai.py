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
- Sampling runs on llama.cpp's sampler chain (proxy/engine/sampling.py): OpenAI's
  ``temperature``, ``top_p``, ``seed``, ``stop``, ``logit_bias`` (token id -> bias in
  [-100, 100]; ``false`` bans it, as llama-server reads it), ``presence_penalty``,
  ``frequency_penalty``, ``logprobs``; llama-server's ``top_k``, ``min_p``,
  ``typical_p``, ``repeat_penalty`` (``repetition_penalty`` too), ``repeat_last_n``,
  ``dry_*``, ``xtc_*``, ``grammar`` (GBNF) and ``json_schema``. A field left out takes
  the ``[sampling]`` config's value, or the model's own recommendation in its GGUF.
- ``response_format`` json_object / json_schema and a forced ``tool_choice``
  ("required" or a named function) constrain the reply with a grammar
  (proxy/api/structured.py); ``parallel_tool_calls: false`` allows one call at most.
  A schema the grammar cannot enforce is a 400 naming the part.
- Fields that would not act are refused by name (400) when set to anything but their
  default, never accepted and ignored: llama-server's ``mirostat``, ``ignore_eos``,
  ``n_probs``, ``top_n_sigma``, ``dynatemp_range``, ``samplers``; for completions
  ``echo``, ``best_of`` > 1 and ``suffix``.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.api.reply import THINK_CLOSE, THINK_OPEN
from proxy.api.structured import ANY_OBJECT, reply_grammar
from proxy.engine.binding import check_grammar
from proxy.engine.grammar import SchemaError
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
MAX_LOGIT_BIAS = 1024
MAX_GRAMMAR = 256 * 1024
MAX_BREAKERS = 32


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
    """Sampling fields as sent (None: not sent, the server's default applies);
    ``max_tokens`` stays None until the prompt length is known."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: tuple[str, ...] | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    seed: int | None = None
    max_tokens: int | None = None
    stop: tuple[str, ...] = ()
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str = ""
    reasoning: tuple[str, str] | None = None
    speculative: bool | None = None

    def to_params(self, max_tokens: int) -> SamplingParams:
        # Every API's parser builds a Sampling: a vanishing temperature is greedy for all.
        t = self.temperature
        values = {f: getattr(self, f) for f in _SHARED}
        values["temperature"] = 0.0 if t is not None and t < MIN_TEMPERATURE else t
        return SamplingParams(**values, max_tokens=max_tokens)


_SHARED = tuple(f.name for f in dataclasses.fields(Sampling) if f.name != "max_tokens")


TOOLS_END = -1  # Mark.message of a point after a tool definition


@dataclass(slots=True, frozen=True)
class Mark:
    """A point of the conversation that the request names: ``offset`` characters into the
    content of message ``message`` (for ``TOOLS_END``: after the first ``offset`` tools).

    Where a content part (a text block) starts, new conversations may share the prompt up
    to there; with ``ttl`` > 0 it is a client's cache breakpoint (Anthropic
    ``cache_control``), kept for ``ttl`` seconds (proxy/api/hints.py)."""

    message: int
    offset: int
    ttl: float = 0.0


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
    marks: tuple[Mark, ...] = ()
    # the conversation this request belongs to, as the client names it (Codex's
    # prompt_cache_key, Claude Code's session and agent ids): lane affinity, miss reasons
    session: str | None = None
    ignored_tools: tuple[str, ...] = ()  # types of hosted tools left out of the prompt

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


def _temperature(body: Mapping[str, Any]) -> float | None:
    t = _opt_float(body, "temperature", 0.0, 2.0)
    return 0.0 if t is not None and t < MIN_TEMPERATURE else t


def _set(body: Mapping[str, Any], key: str, default: object) -> bool:
    v = body.get(key)
    return v is not None and v != default


def refuse_unsupported(body: Mapping[str, Any]) -> None:
    """400 for a llama-server sampling field that would not act here."""
    for key, default in (("mirostat", 0), ("ignore_eos", False), ("n_probs", 0),
                         ("top_n_sigma", -1), ("dynatemp_range", 0), ("samplers", None)):
        if _set(body, key, default):
            raise ApiError(f"'{key}' {NOT_YET}", key)


def parse_sampling(body: Mapping[str, Any]) -> Sampling:
    """The sampling fields both endpoints share (chat adds its constraints later)."""
    refuse_unsupported(body)
    top_k = _opt_int(body, "top_k", lo=-1)
    max_tokens = _opt_int(body, "max_tokens", lo=0)  # 0: a pre-warm (prefill and cache only)
    max_completion = _opt_int(body, "max_completion_tokens", lo=0)
    return Sampling(
        temperature=_temperature(body),
        top_p=_opt_float(body, "top_p", 0.0, 1.0, lo_open=True),
        top_k=0 if top_k == -1 else top_k,
        min_p=_opt_float(body, "min_p", 0.0, 1.0),
        typical_p=_opt_float(body, "typical_p", 0.0, 1.0, lo_open=True),
        repeat_penalty=_repeat_penalty(body),
        repeat_last_n=_opt_int(body, "repeat_last_n", lo=-1),
        presence_penalty=_opt_float(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=_opt_float(body, "frequency_penalty", -2.0, 2.0),
        dry_multiplier=_opt_float(body, "dry_multiplier", 0.0, 100.0),
        dry_base=_opt_float(body, "dry_base", 1.0, 100.0),
        dry_allowed_length=_opt_int(body, "dry_allowed_length", lo=0),
        dry_penalty_last_n=_opt_int(body, "dry_penalty_last_n", lo=-1),
        dry_sequence_breakers=_breakers(body),
        xtc_probability=_opt_float(body, "xtc_probability", 0.0, 1.0),
        xtc_threshold=_opt_float(body, "xtc_threshold", 0.0, 1.0),
        seed=_seed(body),
        max_tokens=max_completion if max_completion is not None else max_tokens,
        stop=_stop(body),
        logit_bias=_logit_bias(body),
        speculative=_opt_bool(body, "speculative"),
        **_grammar(body),
    )


def _repeat_penalty(body: Mapping[str, Any]) -> float | None:
    """llama-server's ``repeat_penalty``, or vLLM's name for it."""
    key = "repeat_penalty" if body.get("repeat_penalty") is not None else "repetition_penalty"
    return _opt_float(body, key, 0.0, 100.0, lo_open=True)


def _breakers(body: Mapping[str, Any]) -> tuple[str, ...] | None:
    v = body.get("dry_sequence_breakers")
    if v is None:
        return None
    if (not isinstance(v, list) or len(v) > MAX_BREAKERS
            or not all(isinstance(s, str) and s for s in v)):
        raise ApiError(f"'dry_sequence_breakers' must be a list of at most {MAX_BREAKERS} "
                       "non-empty strings", "dry_sequence_breakers")
    return tuple(v)


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}; ``false`` bans the token (llama-server's reading)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise ApiError("'logit_bias' must be an object mapping token ids to biases",
                       "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise ApiError(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    out: list[tuple[int, float]] = []
    for key, bias in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()
                and int(key) < 2**31):
            raise ApiError(f"'logit_bias' keys must be token ids (non-negative integers), "
                           f"got {key!r}", "logit_bias")
        if bias is False:
            out.append((int(key), float("-inf")))
            continue
        if (not isinstance(bias, int | float) or isinstance(bias, bool)
                or not -100 <= bias <= 100):
            raise ApiError(f"'logit_bias' values must be numbers in [-100, 100] (or false), "
                           f"got {bias!r} for token {key}", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def _grammar(body: Mapping[str, Any]) -> dict[str, Any]:
    """llama-server's ``grammar`` (GBNF: the whole reply must match it) or ``json_schema``
    (the reply, after any reasoning, is JSON that validates): Sampling's fields."""
    text = _opt_str(body, "grammar")
    schema = body.get("json_schema")
    if text and schema is not None:
        raise ApiError("give either 'grammar' or 'json_schema', not both", "json_schema")
    if schema is not None:
        if not isinstance(schema, dict):
            raise ApiError("'json_schema' must be an object (a JSON schema)", "json_schema")
        return {"grammar": constraint(json_schema=schema, json_path="json_schema"),
                "reasoning": (THINK_OPEN, THINK_CLOSE)}
    if not text:
        return {}
    if len(text) > MAX_GRAMMAR:
        raise ApiError(f"'grammar' may be at most {MAX_GRAMMAR:,} characters", "grammar")
    try:
        check_grammar(text)
    except ValueError as e:
        raise ApiError(f"'grammar': {e}", "grammar") from None
    return {"grammar": text}


def constraint(*, json_schema: Mapping[str, Any] | None, json_path: str,
               tools: tuple[Mapping[str, Any], ...] | None = None, tool_choice: object = None,
               parallel: bool = True, params_key: str = "function.parameters") -> str:
    """``structured.reply_grammar`` with its errors as 400s naming the field at fault."""
    try:
        return reply_grammar(json_schema=json_schema, json_path=json_path, tools=tools,
                             tool_choice=tool_choice, parallel=parallel,
                             params_key=params_key)
    except SchemaError as e:
        raise ApiError(str(e), _top(e.path)) from None


def _top(path: str) -> str:
    """The request field a JSON path starts with ("response_format.json_schema" ->
    "response_format")."""
    for i, c in enumerate(path):
        if c in ".[":
            return path[:i]
    return path


def constrained(sampling: Sampling, grammar: str) -> Sampling:
    """``sampling`` with the reply grammar of a chat request (structured output or a
    forced tool call), which a thinking template's reasoning may precede."""
    if not grammar:
        return sampling
    if sampling.grammar:
        raise ApiError("'grammar' and 'json_schema' cannot be combined with "
                       "'response_format' or a forced 'tool_choice'", "grammar")
    return dataclasses.replace(sampling, grammar=grammar, reasoning=(THINK_OPEN, THINK_CLOSE))


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


def joined_parts(texts: list[str], sep: str = "\n") -> tuple[str, tuple[int, ...]]:
    """Content parts joined into one text, and where each part after the first starts."""
    starts: list[int] = []
    at = 0
    for k, t in enumerate(texts):
        if k:
            at += len(sep)
            starts.append(at)
        at += len(t)
    return sep.join(texts), tuple(starts)


def _content(v: object, param: str) -> tuple[str | None, tuple[int, ...]]:
    """A message's content as one text, and where its parts after the first start."""
    if v is None or isinstance(v, str):
        return v, ()
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
    return joined_parts(texts)


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
    if v is None or v in ("none", "auto", "required"):
        return v
    fn = v.get("function") if isinstance(v, dict) else None
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(fn, dict) \
            and isinstance(fn.get("name"), str):
        return {"type": "function", "function": {"name": fn["name"]}}
    raise ApiError("'tool_choice' must be 'none', 'auto', 'required' or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def json_format(fmt: object, param: str, *, nested: bool = True) -> Mapping[str, Any] | None:
    """The JSON schema a reply format asks for: None for text, any object for
    json_object; ``nested``: json_schema's schema sits in a "json_schema" object (chat's
    ``response_format``), else beside "type" (Responses' ``text.format``)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        spec, where = (fmt.get("json_schema"), f"{param}.json_schema") if nested \
            else (fmt, param)
        if not isinstance(spec, dict):
            raise ApiError(f"'{where}' must be an object with the 'schema'", _top(param))
        schema = spec.get("schema", ANY_OBJECT)
        if not isinstance(schema, dict):
            raise ApiError(f"'{where}.schema' must be an object (a JSON schema)", _top(param))
        return schema
    raise ApiError(f"'{param}.type' must be 'text', 'json_object' or 'json_schema'",
                   _top(param))


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
    tools, choice = _tools(body.get("tools")), _tool_choice(body.get("tool_choice"))
    parallel = _opt_bool(body, "parallel_tool_calls")
    sampling = dataclasses.replace(parse_sampling(body), logprobs=_chat_logprobs(body))
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
        template_kwargs=_template_kwargs(body),
        sampling=constrained(sampling, grammar),
        stream=stream,
        include_usage=usage,
        user=body.get("user"),
        marks=tuple(marks),
        session=session_key(body.get("prompt_cache_key"), "prompt_cache_key"),
    )


MAX_SESSION = 256


def session_key(v: object, param: str) -> str | None:
    """A client's name for its conversation (``prompt_cache_key``, an agent id): a string
    of at most ``MAX_SESSION`` characters, or absent."""
    if v is None:
        return None
    if not isinstance(v, str):
        raise ApiError(f"'{param}' must be a string, not {_type_name(v)}", param)
    if len(v) > MAX_SESSION:
        raise ApiError(f"'{param}' may be at most {MAX_SESSION} characters", param)
    return v or None


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
