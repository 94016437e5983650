"""Where a chat prompt may be shared with other conversations, and where a client asked
for it to be kept: character offsets of the rendered prompt, for the engine's
checkpoints (``GenerationRequest.share_points`` and ``breakpoints``).

- Share points: the start of each message of the prompt's first turn (every message
  before the first assistant message) and of each of their content parts after the
  first. A new conversation of the same agent (the same instructions, tools and
  environment messages, another first prompt) parts from this one at one of them; the
  engine checkpoints a few of them (``cache.share_points``).
- Breakpoints: the end of each block a client marked with ``cache_control``
  (``Mark.ttl`` > 0), kept for that long.

A mark is found by rendering: a character that the prompt does not hold (a sentinel)
is inserted at the mark, in the message's content or as a tool after the tools it
follows, and the conversation is rendered again; where the sentinel shows up is where
the mark lies. The sentinels of every content mark go in at once; a template that
changes text around them (one that trims a content the sentinel now starts) gets one
render per mark instead, each compared with the prompt: the first character that
differs is the mark.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Sequence

from proxy.api.chat import TOOLS_END, ChatMessage, ChatRequest, Mark

MAX_MARKS = 24  # marks placed per request (a render each in the worst case)
_SENTINELS = range(0xE000, 0xF900)  # the Basic Multilingual Plane's private use area

Render = Callable[[ChatRequest], str]


def first_turn(messages: Sequence[ChatMessage]) -> int:
    """How many messages come before the first assistant message."""
    for i, m in enumerate(messages):
        if m.role == "assistant":
            return i
    return len(messages)


def marks_to_place(req: ChatRequest) -> list[Mark]:
    """The request's breakpoints, then its first turn's message and part starts (at most
    ``MAX_MARKS`` in all)."""
    kept = [m for m in req.marks if m.ttl > 0]
    turn = first_turn(req.messages)
    starts = [Mark(i, 0) for i in range(turn)]
    parts = [m for m in req.marks if m.ttl == 0 and 0 <= m.message < turn]
    out = kept + sorted(starts + parts, key=lambda m: (m.message, m.offset))
    return out[:MAX_MARKS]


def _sentinels(text: str, n: int) -> list[str]:
    out: list[str] = []
    for cp in _SENTINELS:
        if len(out) == n:
            break
        ch = chr(cp)
        if ch not in text:
            out.append(ch)
    return out


def _with_sentinels(req: ChatRequest, placed: Sequence[tuple[Mark, str]]) -> ChatRequest:
    """``req`` with each sentinel inserted at its mark."""
    messages = list(req.messages)
    tools = list(req.tools or ())
    # from the end, so that earlier offsets stay valid
    for mark, ch in sorted(placed, key=lambda p: (p[0].message, p[0].offset), reverse=True):
        if mark.message == TOOLS_END:
            k = min(mark.offset, len(tools))
            tools.insert(k, {"type": "function", "function": {"name": ch}})
            continue
        m = messages[mark.message]
        content = m.content or ""
        at = min(max(mark.offset, 0), len(content))
        messages[mark.message] = dataclasses.replace(
            m, content=content[:at] + ch + content[at:])
    return dataclasses.replace(req, messages=tuple(messages), tools=tuple(tools) or None)


def _differs_at(a: str, b: str) -> int:
    """The index of the first character where ``a`` and ``b`` differ."""
    n = min(len(a), len(b))
    lo, hi = 0, n
    while lo < hi:  # the longest common prefix, by halves (strings compare in C)
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def place(render: Render, req: ChatRequest, text: str, marks: Sequence[Mark]
          ) -> list[tuple[Mark, int]]:
    """Each mark's character offset in ``text`` (``render(req)``); a mark the template
    does not render (a dropped message) is left out."""
    if not marks:
        return []
    sentinels = _sentinels(text, len(marks))
    if len(sentinels) < len(marks):
        return []
    pairs = list(zip(marks, sentinels, strict=False))
    content = [(m, ch) for m, ch in pairs if m.message != TOOLS_END
               and 0 <= m.message < len(req.messages)]
    found = _all_at_once(render, req, text, content)
    if found is None:
        found = [p for p in (_one(render, req, text, m, ch) for m, ch in content) if p]
    tools = [(m, ch) for m, ch in pairs if m.message == TOOLS_END and req.tools]
    found += [p for p in (_one(render, req, text, m, ch) for m, ch in tools) if p]
    return found


def _all_at_once(render: Render, req: ChatRequest, text: str,
                 placed: Sequence[tuple[Mark, str]]) -> list[tuple[Mark, int]] | None:
    if not placed:
        return []
    marked = render(_with_sentinels(req, placed))
    chars = {ch: m for m, ch in placed}
    out: list[tuple[Mark, int]] = []
    found = re.compile("[" + "".join(chars) + "]")  # private use characters: no escapes
    for k, hit in enumerate(found.finditer(marked)):
        mark = chars.pop(hit.group(), None)
        if mark is None:
            return None  # a sentinel rendered twice
        out.append((mark, hit.start() - k))  # its offset once the sentinels before it go
    if chars or found.sub("", marked) != text:
        return None  # the template changed text around a sentinel, or dropped one
    return out


def _one(render: Render, req: ChatRequest, text: str, mark: Mark, ch: str
         ) -> tuple[Mark, int] | None:
    marked = render(_with_sentinels(req, [(mark, ch)]))
    if ch not in marked:
        return None
    return mark, _differs_at(text, marked)
