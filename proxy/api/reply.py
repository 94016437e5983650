"""Split generated text into reasoning, content and tool calls, in the syntax of the
model's family (proxy/api/syntax/: one parser per family, found by probing the chat
template when it loads).

``StreamParser`` is the one implementation; ``parse_reply`` feeds it the whole text,
so streaming and non-streaming agree for any split of the text. Without a syntax named,
both read Hermes JSON (``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` and
``<think>`` reasoning), which the templates written for statecache use.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from proxy.api.syntax.calls import Delta, ParsedToolCall, Syntax, Tools, new_call_id
from proxy.api.syntax.families import HERMES
from proxy.api.syntax.stream import BlockParser

__all__ = ["CALL_CLOSE", "CALL_OPEN", "THINK_CLOSE", "THINK_OPEN", "Delta", "ParsedToolCall",
           "ReplyParser", "StreamParser", "new_call_id", "parse_reply", "starts_in_reasoning"]

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


class ReplyParser(Protocol):
    """``feed`` text deltas, then ``finish`` once (``cut``: the token limit ended it)."""

    def feed(self, text: str) -> Delta: ...
    def finish(self, cut: bool = False) -> Delta: ...


def starts_in_reasoning(prompt: str, syntax: Syntax = HERMES) -> bool:
    """Whether the rendered prompt ends inside one of the family's reasoning blocks."""
    return any(prompt.rfind(o) > prompt.rfind(c) for o, c in syntax.reasoning)


def StreamParser(syntax: Syntax = HERMES, *, starts_in_reasoning: bool = False,  # noqa: N802
                 parse_tools: bool = True, tools: Tools | None = None,
                 make_id: Callable[[], str] = new_call_id) -> ReplyParser:
    """The incremental parser of ``syntax``."""
    kind = syntax.parser or BlockParser
    parser: ReplyParser = kind(syntax, starts_in_reasoning=starts_in_reasoning,
                               parse_tools=parse_tools, tools=tools, make_id=make_id)
    return parser


def parse_reply(text: str, *, syntax: Syntax = HERMES, starts_in_reasoning: bool = False,
                parse_tools: bool = True, tools: Tools | None = None,
                cut: bool = False) -> Delta:
    """The whole reply at once: reasoning, content and tool calls."""
    p = StreamParser(syntax, starts_in_reasoning=starts_in_reasoning,
                     parse_tools=parse_tools, tools=tools)
    out = p.feed(text)
    out.extend(p.finish(cut))
    return out
