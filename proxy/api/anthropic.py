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
  text; ``redacted_thinking`` is opaque and dropped (content blocks:
  proxy/api/anthropic_blocks.py).
- ``tools`` (``name``, ``description``, ``input_schema``) become function tools;
  Anthropic's server tools and other tools whose ``type`` is not a client tool's (web
  search, web fetch, code execution, bash, text editor, computer use ...) are left out of
  the prompt (``server.hosted_tools = "reject"``: a 400 naming them).
  ``tool_choice`` any/tool/none map to required/function/none (a grammar forces the
  call, proxy/api/structured.py); ``disable_parallel_tool_use`` allows one call at most.
- ``output_config.format`` (``{"type": "json_schema", "schema": ...}``) constrains the
  reply to JSON that validates against the schema; ``output_config.effort`` is ignored.
- ``thinking`` switches the template's reasoning on or off, and ``budget_tokens`` bounds it
  (proxy/api/thinking.py).
- ``cache_control`` (on a tool, a system block or a content block) is a breakpoint: the
  prompt up to the end of that block is kept as a checkpoint, held above ordinary ones
  for its ``ttl`` ("5m", the default, or "1h"); at most four, as Anthropic allows. A
  ``cache_control`` on the request itself marks the end of its last block. Every prompt
  is cached anyway; a breakpoint says where.
- ``metadata.user_id`` names the conversation (the session), never the tenant (Claude
  Code sends one per session, which would keep its subagents from sharing the system
  prompt). The tenant is the ``X-Statecache-Tenant`` header.
- ``max_tokens`` is cut to the room the context leaves (``fit_max_tokens`` of
  proxy/api/generation.py); ``max_tokens: 0`` is a pre-warm: the prompt is prefilled
  and cached, nothing is generated, and the reply stops with ``max_tokens``.
- Images, documents and other non-text blocks are rejected: text-only models.
- A conversation that ends with an assistant message (a prefilled reply to continue)
  is rejected, as Anthropic does for models without prefill.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from proxy.api.anthropic_blocks import Marks, append_messages, texts
from proxy.api.chat import TOOLS_END, ChatMessage, ChatRequest
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
from proxy.api.sampling import engine_fields, grammar_fields
from proxy.api.structured import constrained, constraint, json_format, spec
from proxy.api.thinking import anthropic_thinking
from proxy.engine.types import SamplingParams

MAX_STOP_SEQUENCES = 16
_SERVER_TOOL_HINT = "only client tools (name, description, input_schema) are supported"


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


def _tools(v: object, hosted: str, ignored: list[str], marks: Marks
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
                          **engine_fields(body),
                          **grammar_fields(body)), max_tokens


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
    marks = Marks()
    ignored: list[str] = []
    tools, choice = (_tools(body.get("tools"), hosted_tools, ignored, marks),
                     _tool_choice(body.get("tool_choice")))
    messages: list[ChatMessage] = []
    system = body.get("system")
    if system is not None:
        messages.append(ChatMessage(role="system", content=texts(system, "system", marks)))
    append_messages(body.get("messages"), messages, marks)
    # a top-level cache_control: the breakpoint goes on the last block of the conversation
    last = messages[-1]
    marks.breakpoint(body, "request", len(messages) - 1, len(last.content or ""))
    kwargs = template_kwargs(body)
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
        constraint=spec(json_schema=_output_format(body),
                        json_path="output_config.format.schema", tools=tools,
                        tool_choice=choice, parallel=_parallel(body.get("tool_choice")),
                        params_key="input_schema", grammar=grammar),
        stream=bool(opt_bool(body, "stream")) and not count_only,
        include_usage=True,
        user=None,
        max_tokens=max_tokens,
        marks=tuple(marks.marks),
        session=session,
        ignored_tools=tuple(ignored),
        thinking=anthropic_thinking(body.get("thinking")),
    )
