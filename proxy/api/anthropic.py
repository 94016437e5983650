"""Parse Anthropic Messages requests into the shared ``ChatRequest``.

A Messages request becomes the same chat request an OpenAI client would send for the
same conversation, so rendering, tokenizing, planning and the cache are shared: a
conversation started on one API continues from the same checkpoints on another.

Mapping:
- ``system`` (a string or text blocks) is the first message, role ``system``; a
  ``system`` message inside ``messages`` (Claude Code sends them, beta
  ``mid-conversation-system``) stays where it is, if the template allows it there.
- User content blocks: ``text`` joins into a user message (parts joined with "\\n", as
  chat content parts are); each ``tool_result`` becomes a ``tool`` message, in order;
  ``is_error`` prefixes the result with "Error: ".
- Assistant content blocks: ``thinking`` is the reasoning (it goes back into the
  template), ``text`` the content, ``tool_use`` a tool call with its ``input`` as JSON
  text; ``redacted_thinking`` is opaque and dropped.
- ``tools`` (``name``, ``description``, ``input_schema``) become function tools;
  Anthropic's server tools and other tools whose ``type`` is not a client tool's (web
  search, web fetch, code execution, bash, text editor, computer use ...) are left out of
  the prompt (``server.hosted_tools = "reject"``: a 400 naming them).
  ``tool_choice`` any/tool/none map to required/function/none (a grammar forces the
  call, proxy/api/structured.py); ``disable_parallel_tool_use`` allows one call at most.
- ``output_config.format`` (``{"type": "json_schema", "schema": ...}``) constrains the
  reply to JSON that validates against the schema; ``output_config.effort`` is ignored.
- ``thinking: {"type": "disabled"}`` sets the template's ``enable_thinking`` to false.
- ``cache_control`` (on a tool, a system block or a content block) is a breakpoint: the
  prompt up to the end of that block is kept as a checkpoint, held above ordinary ones
  for its ``ttl`` ("5m", the default, or "1h"); at most four, as Anthropic allows. A
  ``cache_control`` on the request itself marks the end of its last block. Every prompt
  is cached anyway; a breakpoint says where.
- ``metadata.user_id`` names the conversation (the session), never the tenant (Claude
  Code sends one per session, which would keep its subagents from sharing the system
  prompt). The tenant is the ``X-Statecache-Tenant`` header.
- ``max_tokens: 0`` is a pre-warm: the prompt is prefilled and cached, nothing is
  generated, and the reply stops with ``max_tokens``.
- Images, documents and other non-text blocks are rejected: text-only models.
- A conversation that ends with an assistant message (a prefilled reply to continue)
  is rejected, as Anthropic does for models without prefill.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from typing import Any

from proxy.api.chat import TOOLS_END, ChatMessage, ChatRequest, Mark, ToolCall, joined_parts
from proxy.api.fields import (
    ApiError,
    obj,
    opt_bool,
    opt_float,
    opt_int,
    opt_str,
    session_key,
    template_kwargs,
)
from proxy.api.structured import constrained, constraint, json_format
from proxy.engine.types import SamplingParams

MAX_STOP_SEQUENCES = 16
MAX_BREAKPOINTS = 4  # cache_control blocks in one request, as Anthropic allows
TTLS = {"5m": 300.0, "1h": 3600.0}
_THINKING_ON = ("enabled", "adaptive", "between_tools")
_SERVER_TOOL_HINT = "only client tools (name, description, input_schema) are supported"


class _Marks:
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


def _texts(v: object, param: str, marks: _Marks | None = None, message: int = 0) -> str:
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
    text = "" if content is None else _texts(content, f"{param}.content")
    if opt_bool(block, "is_error", f"{param}.is_error"):
        text = "Error: " + text
    return ChatMessage(role="tool", content=text, tool_call_id=call_id)


def _user(content: list[Any], param: str, out: list[ChatMessage], marks: _Marks) -> None:
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


def _messages(v: object, out: list[ChatMessage], marks: _Marks) -> None:
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
            text = _texts(content, f"{param}.content", marks, len(out))
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


def _tool(t: object, param: str, hosted: str, ignored: list[str]) -> dict[str, Any] | None:
    """An Anthropic client tool as a chat-completions function tool (same key order);
    None for a server tool left out (its type noted in ``ignored``)."""
    tool = obj(t, param)
    kind = tool.get("type")
    if kind not in (None, "custom"):
        if hosted == "reject" or not isinstance(kind, str):
            raise ApiError(f"'{param}' is a server tool of type {kind!r}, which this server "
                           f"does not run; {_SERVER_TOOL_HINT}", param)
        ignored.append(kind)
        return None
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(f"'{param}.name' must be a non-empty string", f"{param}.name")
    fn: dict[str, Any] = {"name": name}
    desc = opt_str(tool, "description", f"{param}.description")
    if desc is not None:
        fn["description"] = desc
    fn["parameters"] = dict(obj(tool.get("input_schema"), f"{param}.input_schema"))
    return {"type": "function", "function": fn}


def _tools(v: object, hosted: str, ignored: list[str], marks: _Marks
           ) -> tuple[Mapping[str, Any], ...] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise ApiError("'tools' must be a list", "tools")
    out: list[Mapping[str, Any]] = []
    for k, t in enumerate(v):
        tool = _tool(t, f"tools[{k}]", hosted, ignored)
        if tool is not None:
            out.append(tool)
            marks.breakpoint(t, f"tools[{k}]", TOOLS_END, len(out))
    return tuple(out) or None


def _parallel(v: object) -> bool:
    """False when the tool choice asks for one tool use at most."""
    if not isinstance(v, dict):
        return True
    return not opt_bool(v, "disable_parallel_tool_use", "tool_choice.disable_parallel_tool_use")


def _output_format(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    config = body.get("output_config")
    if config is None:
        return None
    fmt = obj(config, "output_config").get("format")
    if fmt is not None and obj(fmt, "output_config.format").get("type") != "json_schema":
        raise ApiError("'output_config.format.type' must be 'json_schema'",
                       "output_config.format.type")
    return json_format(fmt, "output_config.format", nested=False)


def _tool_choice(v: object) -> str | Mapping[str, Any] | None:
    if v is None:
        return None
    choice = obj(v, "tool_choice")
    kind = choice.get("type")
    if kind in ("auto", "any", "none"):
        return {"auto": "auto", "any": "required", "none": "none"}[kind]
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ApiError("'tool_choice' must be {\"type\": \"auto\" | \"any\" | \"none\"} or "
                   "{\"type\": \"tool\", \"name\": ...}", "tool_choice")


def _thinking_kwargs(v: object) -> dict[str, Any]:
    if v is None:
        return {}
    kind = obj(v, "thinking").get("type")
    if kind == "disabled":
        return {"enable_thinking": False}
    if kind in _THINKING_ON:
        return {}
    raise ApiError(f"'thinking.type' must be one of {', '.join(_THINKING_ON)} or 'disabled'",
                   "thinking.type")


def _stop_sequences(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop_sequences")
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(s, str) and s for s in v):
        raise ApiError("'stop_sequences' must be a list of non-empty strings", "stop_sequences")
    if len(v) > MAX_STOP_SEQUENCES:
        raise ApiError(f"'stop_sequences' may hold at most {MAX_STOP_SEQUENCES} strings",
                       "stop_sequences")
    return tuple(v)


def _sampling(body: Mapping[str, Any], need_max_tokens: bool
              ) -> tuple[SamplingParams, int | None]:
    """The sampling fields, and the ``max_tokens`` asked (required but for counting)."""
    max_tokens = opt_int(body, "max_tokens", lo=0)  # 0: a pre-warm
    if max_tokens is None and need_max_tokens:
        raise ApiError("'max_tokens' is required", "max_tokens")
    temperature = opt_float(body, "temperature", 0.0, 1.0)
    top_p = opt_float(body, "top_p", 0.0, 1.0, lo_open=True)
    return SamplingParams(temperature=temperature, top_p=top_p,
                          top_k=opt_int(body, "top_k", lo=0), stop=_stop_sequences(body),
                          speculative=opt_bool(body, "speculative")), max_tokens


def unbounded(req: ChatRequest) -> ChatRequest:
    """The request without ``max_tokens``, to check its prompt against the context alone
    (``fit_max_tokens`` then cuts ``max_tokens`` to the room left)."""
    return dataclasses.replace(req, max_tokens=None)


def fit_max_tokens(asked: int | None, n_ctx: int, n_prompt: int) -> int | None:
    """``max_tokens`` cut to the room the context leaves: clients such as Claude Code
    always ask for tens of thousands, and Anthropic's API runs until the context is full
    (``stop_reason: model_context_window_exceeded``) rather than refusing."""
    room = n_ctx - n_prompt
    if asked is None or room <= 0 or asked <= room:
        return asked
    return room


def _session(body: Mapping[str, Any]) -> str | None:
    metadata = body.get("metadata")
    if metadata is None:
        return None
    return session_key(obj(metadata, "metadata").get("user_id"), "metadata.user_id")


def parse_messages_request(body: object, *, count_only: bool = False,
                           hosted_tools: str = "ignore") -> ChatRequest:
    """A ``POST /v1/messages`` body (``count_only``: a ``count_tokens`` body, no max_tokens).
    ``hosted_tools``: "ignore" leaves server tools out, "reject" refuses them."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    opt_str(body, "model")
    session = _session(body)
    marks = _Marks()
    ignored: list[str] = []
    tools, choice = (_tools(body.get("tools"), hosted_tools, ignored, marks),
                     _tool_choice(body.get("tool_choice")))
    messages: list[ChatMessage] = []
    system = body.get("system")
    if system is not None:
        messages.append(ChatMessage(role="system", content=_texts(system, "system", marks)))
    _messages(body.get("messages"), messages, marks)
    # a top-level cache_control: the breakpoint goes on the last block of the conversation
    last = messages[-1]
    marks.breakpoint(body, "request", len(messages) - 1, len(last.content or ""))
    kwargs = {**_thinking_kwargs(body.get("thinking")), **template_kwargs(body)}
    grammar = constraint(json_schema=_output_format(body),
                         json_path="output_config.format.schema", tools=tools,
                         tool_choice=choice, parallel=_parallel(body.get("tool_choice")),
                         params_key="input_schema")
    sampling, max_tokens = _sampling(body, need_max_tokens=not count_only)
    return ChatRequest(
        model=body.get("model") or "",
        messages=tuple(messages),
        tools=tools,
        tool_choice=choice,
        template_kwargs=kwargs,
        sampling=constrained(sampling, grammar),
        stream=bool(opt_bool(body, "stream")) and not count_only,
        include_usage=True,
        user=None,
        max_tokens=max_tokens,
        marks=tuple(marks.marks),
        session=session,
        ignored_tools=tuple(ignored),
    )
