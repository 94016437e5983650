"""Parse OpenAI Responses requests into the shared ``ChatRequest``.

Input items become the chat messages an OpenAI chat client would send for the same
conversation, so rendering, tokenizing, planning and the cache are shared with the
other APIs.

Mapping:
- ``instructions`` is the first message, role ``system``; as OpenAI does, the
  instructions of a previous response are not carried over.
- ``input``: a string is one user message. Items: ``message`` (``input_text`` /
  ``output_text`` parts joined with "\\n"; ``developer`` is ``system``);
  ``function_call_output`` is a ``tool`` message. ``reasoning``, assistant
  ``message`` and ``function_call`` items in a row are one assistant turn (reasoning,
  content, tool calls, the order the templates render); a ``reasoning`` item's text
  comes from its ``reasoning_text`` parts, else from an ``encrypted_content`` this
  server wrote (clients such as the Codex CLI send back only that).
- ``previous_response_id``: the stored conversation of that response (its input and
  output) comes before the new input (proxy/api/response_store.py); unknown ids are a
  400.
- Only ``function`` tools, and ``namespace`` tools (groups of functions, which the Codex
  CLI sends): their functions are offered by their own names and a call of one carries
  its ``namespace``. Hosted tools (web search, file search, image generation, computer
  use, code interpreter, remote MCP), which the Codex CLI sends unless told otherwise,
  are left out of the prompt (``server.hosted_tools = "reject"``: a 400 naming them);
  other tool types are a 400. ``tool_choice`` and ``parallel_tool_calls`` as in chat: a
  forced choice is a grammar.
- ``text.format`` json_object / json_schema constrains the reply to JSON (as chat's
  ``response_format``); ``text.verbosity`` is accepted.
- ``reasoning.effort`` switches the template's reasoning off ("none") or sets its effort
  (proxy/api/thinking.py).
- ``prompt_cache_key`` names the conversation (Codex sends its thread id): lane affinity
  and miss reasons. ``include``, ``metadata``, ``truncation`` are accepted;
  ``background``, ``conversation`` and ``prompt`` are rejected.
- ``max_output_tokens: 0`` is a pre-warm: the prompt is prefilled and cached, and the
  response is ``incomplete`` with no output.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.api.chat import (
    ChatMessage,
    ChatRequest,
    Constraint,
    Mark,
    Thinking,
    ToolCall,
    content_text,
)
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
from proxy.api.thinking import from_effort
from proxy.engine.types import SamplingParams

# Reasoning sent back in ``encrypted_content`` is ours only with this prefix.
REASONING_MARK = "statecache-reasoning:"
# the content parts read, and the key of their text
_TEXT_PARTS = {"input_text": "text", "output_text": "text", "text": "text",
               "refusal": "refusal"}
_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_REJECTED_FIELDS = ("background", "conversation", "prompt")
# Tools that OpenAI's servers run (by type, or its prefix: web_search_preview_2025_03_11)
HOSTED_TYPES = ("web_search", "file_search", "image_generation", "code_interpreter",
                "computer_use", "mcp")


@dataclass(slots=True, frozen=True)
class ResponsesRequest:
    """A parsed request; ``messages`` is the new input only (see ``chat_request``)."""

    model: str
    instructions: str | None
    messages: tuple[ChatMessage, ...]
    previous_response_id: str | None
    tools: tuple[Mapping[str, Any], ...] | None  # as chat tools, for the template
    tools_json: tuple[Mapping[str, Any], ...]  # as sent, echoed in the response
    namespaces: Mapping[str, str]  # function name -> its namespace, for namespaced tools
    tool_choice: str | Mapping[str, Any] | None
    parallel_tool_calls: bool
    template_kwargs: Mapping[str, Any]
    sampling: SamplingParams  # its max_tokens is not the request's (see ``max_tokens``)
    stream: bool
    store: bool
    user: str | None
    metadata: Mapping[str, Any]
    reasoning_effort: str | None
    max_tokens: int | None = None  # max_output_tokens as asked
    marks: tuple[Mark, ...] = ()  # content parts' starts, by index into ``messages``
    session: str | None = None  # prompt_cache_key
    ignored_tools: tuple[str, ...] = ()  # types of hosted tools left out
    constraint: Constraint | None = None
    thinking: Thinking | None = None

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


def _str(v: Mapping[str, Any], key: str, param: str) -> str:
    s = v.get(key)
    if not isinstance(s, str):
        raise ApiError(f"'{param}.{key}' must be a string", f"{param}.{key}")
    return s


def _text(v: object, param: str) -> str:
    """A string, or text parts (``input_text``, ``output_text``) joined with "\\n"."""
    return _parts(v, param)[0]


def _parts(v: object, param: str) -> tuple[str, tuple[int, ...]]:
    """``_text``, and where its parts after the first start."""
    return content_text(v, param, _TEXT_PARTS)


def _reasoning_text(item: Mapping[str, Any], param: str) -> str | None:
    content = item.get("content")
    if isinstance(content, list) and content:
        texts = [_str(obj(c, f"{param}.content[{j}]"), "text", f"{param}.content[{j}]")
                 for j, c in enumerate(content)]
        return "\n".join(texts)
    secret = item.get("encrypted_content")
    if isinstance(secret, str) and secret.startswith(REASONING_MARK):
        return secret[len(REASONING_MARK):]
    return None  # a summary, or another server's encrypted reasoning: not the text


class _Turns:
    """Builds chat messages from items, gathering an assistant turn's pieces."""

    def __init__(self) -> None:
        self.messages: list[ChatMessage] = []
        self.marks: list[Mark] = []
        self._reasoning: str | None = None
        self._content: str | None = None
        self._calls: list[ToolCall] = []

    def flush(self) -> None:
        if self._reasoning is None and self._content is None and not self._calls:
            return
        self.messages.append(ChatMessage(role="assistant", content=self._content or "",
                                         reasoning_content=self._reasoning,
                                         tool_calls=tuple(self._calls)))
        self._reasoning, self._content, self._calls = None, None, []

    def reasoning(self, text: str | None) -> None:
        if self._content is not None or self._calls:
            self.flush()
        if text is not None:
            self._reasoning = text if self._reasoning is None else self._reasoning + "\n" + text

    def content(self, text: str) -> None:
        if self._calls:
            self.flush()
        self._content = text if self._content is None else self._content + "\n" + text

    def call(self, call: ToolCall) -> None:
        self._calls.append(call)

    def other(self, message: ChatMessage, starts: tuple[int, ...] = ()) -> None:
        self.flush()
        self.marks.extend(Mark(len(self.messages), at) for at in starts)
        self.messages.append(message)


def _item(turns: _Turns, item: object, param: str) -> None:
    v = obj(item, param)
    kind = v.get("type", "message" if "role" in v else None)
    if kind == "message":
        role = v.get("role")
        if role not in _ROLES:
            raise ApiError(f"'{param}.role' must be one of {', '.join(_ROLES)}; got {role!r}",
                           f"{param}.role")
        text, starts = _parts(v.get("content"), f"{param}.content")
        if role == "assistant":
            turns.content(text)
        else:
            turns.other(ChatMessage(role=_ROLES[role], content=text), starts)
    elif kind == "reasoning":
        turns.reasoning(_reasoning_text(v, param))
    elif kind == "function_call":
        args = _str(v, "arguments", param)
        turns.call(ToolCall(id=_str(v, "call_id", param), name=_str(v, "name", param),
                            arguments=args))
    elif kind == "function_call_output":
        turns.other(ChatMessage(role="tool", content=_text(v.get("output"), f"{param}.output"),
                                tool_call_id=_str(v, "call_id", param)))
    else:
        raise ApiError(f"input items of type {kind!r} are not supported: only message, "
                       "reasoning, function_call and function_call_output", f"{param}.type")


def _input(v: object) -> tuple[tuple[ChatMessage, ...], tuple[Mark, ...]]:
    if isinstance(v, str):
        return (ChatMessage(role="user", content=v),), ()
    if not isinstance(v, list) or not v:
        raise ApiError("'input' must be a string or a non-empty list of items", "input")
    turns = _Turns()
    for i, item in enumerate(v):
        _item(turns, item, f"input[{i}]")
    turns.flush()
    return tuple(turns.messages), tuple(turns.marks)


def _function(tool: Mapping[str, Any], param: str) -> dict[str, Any]:
    """A Responses function tool as a chat-completions tool (same key order as chat's)."""
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(f"'{param}.name' must be a non-empty string", f"{param}.name")
    fn: dict[str, Any] = {"name": name}
    desc = opt_str(tool, "description", f"{param}.description")
    if desc is not None:
        fn["description"] = desc
    params = tool.get("parameters")
    if params is not None:
        fn["parameters"] = dict(obj(params, f"{param}.parameters"))
    return {"type": "function", "function": fn}


def _unsupported_tool(kind: object, param: str) -> ApiError:
    return ApiError(f"tools of type {kind!r} are not supported: only 'function' tools (and "
                    "namespaces of them), which the client runs; no hosted web search, file "
                    "search, computer use, code interpreter or MCP", f"{param}.type")


def _hosted(kind: object) -> bool:
    return isinstance(kind, str) and kind.startswith(HOSTED_TYPES)


def _tool(t: object, param: str, chat: list[dict[str, Any]], namespaces: dict[str, str],
          ignored: list[str] | None) -> None:
    """Adds a function tool to ``chat``, or a namespace's functions (noting their namespace);
    a hosted tool's type goes to ``ignored`` (None: hosted tools are refused)."""
    tool = obj(t, param)
    kind = tool.get("type")
    if kind == "function":
        chat.append(_function(tool, param))
        return
    if ignored is not None and _hosted(kind):
        assert isinstance(kind, str)
        ignored.append(kind)
        return
    if kind != "namespace":
        raise _unsupported_tool(kind, param)
    space, inner = tool.get("name"), tool.get("tools")
    if not isinstance(space, str) or not isinstance(inner, list):
        raise ApiError(f"'{param}' must have a string 'name' and a list of 'tools'", param)
    for j, f in enumerate(inner):
        p = f"{param}.tools[{j}]"
        if obj(f, p).get("type") != "function":
            raise _unsupported_tool(f.get("type"), p)
        chat.append(_function(f, p))
        namespaces[chat[-1]["function"]["name"]] = space


def _tools(v: object, ignored: list[str] | None
           ) -> tuple[tuple[Mapping[str, Any], ...] | None, Mapping[str, str]]:
    """The tools as chat tools (a namespace's functions in its place), and the namespace
    of each function that has one. Names must be unique: the model calls tools by name."""
    if v is None:
        return None, {}
    if not isinstance(v, list):
        raise ApiError("'tools' must be a list", "tools")
    chat: list[dict[str, Any]] = []
    namespaces: dict[str, str] = {}
    for k, t in enumerate(v):
        _tool(t, f"tools[{k}]", chat, namespaces, ignored)
    names = [t["function"]["name"] for t in chat]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ApiError(f"tool names must be unique; given more than once: {', '.join(twice)}",
                       "tools")
    return tuple(chat) or None, namespaces


def _tool_choice(v: object) -> str | Mapping[str, Any] | None:
    if v is None or v in ("none", "auto", "required"):
        return v
    if isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("name"), str):
        return {"type": "function", "function": {"name": v["name"]}}
    raise ApiError("'tool_choice' must be 'none', 'auto', 'required' or "
                   "{\"type\": \"function\", \"name\": ...}", "tool_choice")


def _reasoning_effort(body: Mapping[str, Any]) -> str | None:
    v = body.get("reasoning")
    if v is None:
        return None
    return opt_str(obj(v, "reasoning"), "effort", "reasoning.effort")


def _sampling(body: Mapping[str, Any]) -> tuple[SamplingParams, int | None]:
    """The sampling fields, and ``max_output_tokens`` as asked."""
    temperature = opt_float(body, "temperature", 0.0, 2.0)
    top_p = opt_float(body, "top_p", 0.0, 1.0, lo_open=True)
    max_tokens = opt_int(body, "max_output_tokens", lo=0)  # 0: pre-warm
    return SamplingParams(temperature=temperature, top_p=top_p,
                          **engine_fields(body),
                          **grammar_fields(body)), max_tokens


def _text_format(body: Mapping[str, Any]) -> Mapping[str, Any] | None:
    text = body.get("text")
    if text is None:
        return None
    return json_format(obj(text, "text").get("format"), "text.format", nested=False)


def parse_responses_request(body: object, *, hosted_tools: str = "ignore"
                            ) -> ResponsesRequest:
    """``hosted_tools``: "ignore" leaves hosted tools out of the prompt, "reject" refuses
    them."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object")
    for key in _REJECTED_FIELDS:
        if body.get(key) not in (None, False):
            raise ApiError(f"'{key}' is not supported by this server", key)
    metadata = body.get("metadata")
    ignored: list[str] | None = [] if hosted_tools == "ignore" else None
    tools, namespaces = _tools(body.get("tools"), ignored)
    messages, marks = _input(body.get("input"))
    effort = _reasoning_effort(body)
    kwargs = template_kwargs(body)
    store = opt_bool(body, "store")
    parallel = opt_bool(body, "parallel_tool_calls")
    choice = _tool_choice(body.get("tool_choice"))
    grammar = constraint(json_schema=_text_format(body), json_path="text.format.schema",
                         tools=tools, tool_choice=choice, parallel=parallel is not False,
                         params_key="parameters")
    model, instructions = opt_str(body, "model") or "", opt_str(body, "instructions")
    previous = opt_str(body, "previous_response_id")
    sampling, max_tokens = _sampling(body)
    return ResponsesRequest(
        model=model,
        instructions=instructions,
        messages=messages,
        previous_response_id=previous,
        tools=tools,
        tools_json=tuple(body.get("tools") or ()),
        namespaces=namespaces,
        tool_choice=choice,
        parallel_tool_calls=True if parallel is None else parallel,
        template_kwargs=kwargs,
        sampling=constrained(sampling, grammar),
        constraint=spec(json_schema=_text_format(body), json_path="text.format.schema",
                        tools=tools, tool_choice=choice, parallel=parallel is not False,
                        params_key="parameters", grammar=grammar),
        stream=bool(opt_bool(body, "stream")),
        store=True if store is None else store,
        user=opt_str(body, "user"),
        metadata=dict(obj(metadata, "metadata")) if metadata is not None else {},
        reasoning_effort=effort,
        thinking=from_effort(effort, "reasoning.effort"),
        max_tokens=max_tokens,
        marks=marks,
        session=session_key(body.get("prompt_cache_key"), "prompt_cache_key"),
        ignored_tools=tuple(ignored or ()),
    )


def chat_request(req: ResponsesRequest, history: tuple[ChatMessage, ...]) -> ChatRequest:
    """The whole conversation as a chat request: instructions, history, new input."""
    system = (ChatMessage(role="system", content=req.instructions),) \
        if req.instructions is not None else ()
    shift = len(system) + len(history)
    return ChatRequest(model=req.model, messages=system + history + req.messages,
                       tools=req.tools, tool_choice=req.tool_choice,
                       template_kwargs=req.template_kwargs, sampling=req.sampling,
                       stream=req.stream, include_usage=True, user=req.user,
                       max_tokens=req.max_tokens,
                       marks=tuple(Mark(m.message + shift, m.offset, m.ttl)
                                   for m in req.marks),
                       session=req.session, ignored_tools=req.ignored_tools,
                       constraint=req.constraint, thinking=req.thinking)
