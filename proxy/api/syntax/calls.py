"""The records a reply is split into, and the shape of a tool-call syntax.

A ``Syntax`` is data: the reasoning blocks a family writes, and its ``Block``s: the text
that opens a block of tool calls, the text that closes it (None: the reply's end), and
the ``Body`` that reads the calls written between them. proxy/api/syntax/stream.py runs
any of them, streaming or not.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

Tools = Sequence[Mapping[str, Any]]


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


@dataclass(slots=True, frozen=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # JSON text of an object

    def to_json(self) -> dict[str, object]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class Delta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ParsedToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def extend(self, other: Delta) -> None:
        self.reasoning += other.reasoning
        self.content += other.content
        self.tool_calls.extend(other.tool_calls)


@dataclass(slots=True, frozen=True)
class RawCall:
    """A call as a body reads it: the name and its arguments (an object), and the id the
    model wrote for it where the family writes one (Kimi's functions.NAME:0, Mistral's
    [CALL_ID], Solar's): given back as the call's id, the template renders the call as
    written."""

    name: str
    arguments: Mapping[str, Any]
    id: str = ""

    def json(self) -> str:
        return json.dumps(dict(self.arguments), ensure_ascii=False)


class Body(Protocol):
    """Reads the calls written inside one block; None where they do not parse."""

    def __call__(self, text: str, tools: Tools | None) -> list[RawCall] | None: ...


@dataclass(slots=True, frozen=True)
class Block:
    """Where a family's calls are written: ``open`` ... ``close`` (None: to the reply's
    end); ``keep_open``: the opener is the start of the body too (Qwen's bare
    ``<function=``); ``at_start``: only as the reply's first text (Llama 3's bare JSON);
    ``loose``: a lenient reader, for a block that ``body`` never reads by the reply's end
    (a closer the model left out)."""

    open: str
    close: str | None
    body: Body
    keep_open: bool = False
    at_start: bool = False
    loose: Body | None = None


def leading_calls(body: Body, text: str, tools: Tools | None) -> list[RawCall]:
    """The calls written whole at the start of a block the token limit cut (a body
    without a ``leading`` reader keeps none)."""
    read = getattr(body, "leading", None)
    return list(read(text, tools)) if read is not None else []


@dataclass(slots=True, frozen=True)
class Syntax:
    """One family's tool-call and reasoning syntax."""

    name: str
    blocks: tuple[Block, ...]
    reasoning: tuple[tuple[str, str], ...] = (("<think>", "</think>"),)
    drop: tuple[str, ...] = ()  # markers that are never text (strays the family writes)
    # a parser of its own where the syntax is not blocks in text (Harmony); it takes the
    # same arguments as stream.BlockParser
    parser: Callable[..., Any] | None = None
    models: str = ""  # the families of models that write it, for people to read
    # text a template of the family writes around the tools it offers: names the family
    # where the template renders no calls of past turns (LFM2's <|tool_list_start|>)
    hints: tuple[str, ...] = ()
    # the reasoning a grammar lets the model write before a forced call, where it is not
    # the first reasoning pair (Harmony's analysis message)
    lazy: tuple[str, str] | None = None

    @property
    def grammar_reasoning(self) -> tuple[str, str] | None:
        return self.lazy or (self.reasoning[0] if self.reasoning else None)


def to_parsed(calls: Sequence[RawCall], make_id: Callable[[], str]) -> list[ParsedToolCall]:
    out, seen = [], set()
    for c in calls:
        cid = c.id if c.id and c.id not in seen else make_id()  # ids unique in a reply
        seen.add(cid)
        out.append(ParsedToolCall(cid, c.name, c.json()))
    return out
