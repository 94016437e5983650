"""The chat request every API parses into, and the completion request.

OpenAI chat completions (openai.py), Anthropic Messages (anthropic.py) and OpenAI
Responses (responses.py) each parse their body into one ``ChatRequest``, so rendering,
tokenizing, planning and the cache are shared: a conversation started on one API
continues from the same checkpoints on another.

Sampling is the engine's own record (``proxy.engine.types.SamplingParams``); its
``max_tokens`` is set only once the prompt's length is known (``to_params`` in
proxy/api/sampling.py): until then the request's ``max_tokens`` holds what was asked.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.api.fields import ApiError, obj
from proxy.engine.types import SamplingParams


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
class Thinking:
    """What a request asks of the model's reasoning (proxy/api/thinking.py sets it as the
    template's variables)."""

    on: bool | None = None  # None: the template's default
    effort: str | None = None  # low, medium, high ... as asked
    budget: int | None = None  # reasoning tokens at most


@dataclass(slots=True, frozen=True)
class Constraint:
    """What constrains a reply (structured output, forced tool calls), as the request
    says it: the grammar is built once the template's syntax is known (routes.py)."""

    json_schema: Mapping[str, Any] | None
    json_path: str
    tools: tuple[Mapping[str, Any], ...] | None
    tool_choice: object
    parallel: bool
    params_key: str


@dataclass(slots=True, frozen=True)
class ChatRequest:
    model: str
    messages: tuple[ChatMessage, ...]
    tools: tuple[Mapping[str, Any], ...] | None
    tool_choice: str | Mapping[str, Any] | None
    template_kwargs: Mapping[str, Any]
    sampling: SamplingParams  # its max_tokens is not the request's (see ``max_tokens``)
    stream: bool
    include_usage: bool
    user: str | None
    # as asked (0: a pre-warm); None: as the context and server.max_tokens_default allow
    max_tokens: int | None = None
    marks: tuple[Mark, ...] = ()
    # the conversation this request belongs to, as the client names it (Codex's
    # prompt_cache_key, Claude Code's session and agent ids): lane affinity, miss reasons
    session: str | None = None
    ignored_tools: tuple[str, ...] = ()  # types of hosted tools left out of the prompt
    constraint: Constraint | None = None  # a grammar to build in the family's syntax
    thinking: Thinking | None = None  # reasoning on or off, its effort and budget

    @property
    def parse_tools(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


@dataclass(slots=True, frozen=True)
class CompletionRequest:
    model: str
    prompt: str
    sampling: SamplingParams  # its max_tokens is not the request's (see ``max_tokens``)
    stream: bool
    include_usage: bool
    user: str | None
    max_tokens: int | None = None  # as asked, as ChatRequest's


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


def content_text(v: object, param: str, fields: Mapping[str, str]
                 ) -> tuple[str, tuple[int, ...]]:
    """A message's content as one text, and where its parts after the first start: a
    string, or a list of parts whose types ``fields`` maps to the key that holds each
    one's text, joined with "\\n" (as vLLM does). A part of another type (an image,
    audio, a file) is refused: the models served here read text only."""
    if isinstance(v, str):
        return v, ()
    if not isinstance(v, list):
        raise ApiError(f"'{param}' must be a string or a list of content parts", param)
    texts: list[str] = []
    for j, part in enumerate(v):
        p = f"{param}[{j}]"
        kind = obj(part, p).get("type")
        field = fields.get(kind) if isinstance(kind, str) else None
        if field is None:
            raise ApiError(f"content parts of type {kind!r} are not supported: this server "
                           "serves text-only models", p)
        text = part.get(field)
        if not isinstance(text, str):
            raise ApiError(f"'{p}' must be {{\"type\": \"{kind}\", \"{field}\": <string>}}", p)
        texts.append(text)
    return joined_parts(texts)
