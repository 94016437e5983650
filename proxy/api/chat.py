"""The chat request every API parses into, and the completion request.

OpenAI chat completions (openai.py), Anthropic Messages (anthropic.py) and OpenAI
Responses (responses.py) each parse their body into one ``ChatRequest``, so rendering,
tokenizing, planning and the cache are shared: a conversation started on one API
continues from the same checkpoints on another.

``Sampling`` holds the sampling fields as sent; ``to_params`` makes the engine's
record of them once the prompt's length is known.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.engine.types import SamplingParams

MIN_TEMPERATURE = 1e-6


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
