"""System and developer messages after the first: in place where the template takes
them there, else folded into the conversation.

Clients put system text inside a conversation: Claude Code sends its environment as a
``system`` message after the first user turn, Codex sends ``developer`` items after its
instructions, and chat clients add reminders late in a session. Many templates refuse
such a message (Gemma 3: "System messages are only supported at the start of the
conversation."; Qwen3.5's guard "System message must be at the beginning."), and some
render it elsewhere (collected into the first system turn) or drop it.

What a template does is learned by rendering, once, when it is loaded
(``probe_inner_system``): a conversation with a system message after a reply and one
with a system message after the first user turn. ``IN_PLACE`` when each renders between
its neighbours; else ``REFUSED``, ``MOVED`` or ``DROPPED``.

``server.inner_system`` chooses: "auto" (the default) keeps such messages in place where
the template does so and folds them elsewhere; "fold" always folds; "keep" hands them to
the template as sent (a template that refuses them makes the request a 400).

Folding (``fold_inner_system``), one rule:
- a system message that follows only system messages (Codex's instructions, then
  developer items) joins the first one, after a blank line: it is still the start of the
  conversation;
- any other becomes user text wrapped as ``<system>\\n…\\n</system>``: appended (after a
  blank line) to the user message right before it, else put before the user message
  right after it, else a user message of its own.
Every message before it renders as it would without it, so the tokens before it are the
same from one turn to the next and the cache keeps working; its text stays where the
client put it, marked as the system's.

Messages of one role in a row: Codex sends its environment and its prompt as two user
messages; Claude Code, resuming a session whose replies were cut by ``max_tokens``,
sends the cut replies as assistant messages in a row. Anthropic's API merges such runs;
Gemma 3's template refuses them ("Conversation roles must alternate"). Where the probe
finds that a template refuses (or drops) them, a run is merged into one message before
rendering (``merge_runs``): user texts joined by a blank line, an assistant's pieces
joined as one reply (texts one after the other, reasoning by a line, tool calls in
order).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence
from typing import Any

from proxy.api.chat import ChatMessage

INNER_SYSTEM_MODES = ("auto", "fold", "keep")
OPEN, CLOSE = "<system>\n", "\n</system>"


class InnerSystem(enum.Enum):
    """What a template does with a system message after the first."""

    IN_PLACE = "in place"
    REFUSED = "refused"
    MOVED = "moved"
    DROPPED = "dropped"


# Probe conversations: (messages, the marker of the inner system message, the markers of
# the texts it must sit between).
_PROBES: tuple[tuple[tuple[tuple[str, str], ...], str, str, str | None], ...] = (
    ((("system", "zqa0"), ("user", "zqu1"), ("assistant", "zqa1"), ("system", "zqs2"),
      ("user", "zqu2")), "zqs2", "zqa1", "zqu2"),
    ((("system", "zqa0"), ("user", "zqu1"), ("system", "zqs2")), "zqs2", "zqu1", None),
)


def takes_runs(render: Callable[[list[dict[str, Any]]], str]) -> bool:
    """Whether ``render`` renders messages of one role in a row, each text in order."""
    for roles in (("user", "user"), ("user", "assistant", "assistant", "user")):
        texts = [f"zqr{k}" for k in range(len(roles))]
        try:
            out = render([{"role": r, "content": t} for r, t in zip(roles, texts, strict=True)])
        except ValueError:
            return False
        at = [out.find(t) for t in texts]
        if min(at) < 0 or at != sorted(at):
            return False
    return True


def _joined_reply(a: ChatMessage, b: ChatMessage) -> ChatMessage:
    reasoning = [r for r in (a.reasoning_content, b.reasoning_content) if r]
    return dataclasses.replace(a, content=(a.content or "") + (b.content or ""),
                               reasoning_content="\n".join(reasoning) or None,
                               tool_calls=a.tool_calls + b.tool_calls)


def merge_runs(messages: Sequence[ChatMessage]) -> tuple[ChatMessage, ...]:
    """User and assistant messages in a row merged into one (module docstring)."""
    out: list[ChatMessage] = []
    for m in messages:
        prev = out[-1] if out else None
        if prev is not None and prev.role == m.role == "user":
            out[-1] = dataclasses.replace(prev, content=_joined(prev.content, m.content or ""))
        elif prev is not None and prev.role == m.role == "assistant":
            out[-1] = _joined_reply(prev, m)
        else:
            out.append(m)
    return tuple(out)


def probe_inner_system(render: Callable[[list[dict[str, Any]]], str]) -> InnerSystem:
    """What ``render`` (messages -> prompt) does with a system message after the first."""
    for messages, inner, before, after in _PROBES:
        try:
            text = render([{"role": r, "content": c} for r, c in messages])
        except ValueError:
            return InnerSystem.REFUSED
        at = text.find(inner)
        if at < 0:
            return InnerSystem.DROPPED
        lo = text.find(before)
        hi = text.find(after) if after is not None else len(text)
        if not (0 <= lo < at and at < hi):
            return InnerSystem.MOVED
    return InnerSystem.IN_PLACE


def should_fold(mode: str, found: InnerSystem) -> bool:
    """Whether inner system messages are folded, for ``server.inner_system`` = ``mode``."""
    if mode not in INNER_SYSTEM_MODES:
        raise ValueError(f"inner_system must be one of {', '.join(INNER_SYSTEM_MODES)}, "
                         f"got {mode!r}")
    return mode == "fold" or (mode == "auto" and found is not InnerSystem.IN_PLACE)


def _marked(text: str) -> str:
    return OPEN + text + CLOSE


def _joined(a: str | None, b: str) -> str:
    return f"{a}\n\n{b}" if a else b


def fold_inner_system(messages: Sequence[ChatMessage]) -> tuple[ChatMessage, ...]:
    """``messages`` with every system message after the first folded (module docstring)."""
    if not any(m.role == "system" for m in messages[1:]):
        return tuple(messages)
    out: list[ChatMessage] = []
    carry: str | None = None  # marked system text waiting for the next user message
    for i, m in enumerate(messages):
        if m.role == "system" and i > 0:
            text = m.content or ""
            if all(p.role == "system" for p in out):
                out[0] = dataclasses.replace(out[0], content=_joined(out[0].content, text))
            elif out and out[-1].role == "user" and carry is None:
                out[-1] = dataclasses.replace(out[-1], content=_joined(out[-1].content,
                                                                        _marked(text)))
            else:
                carry = _joined(carry, _marked(text))
            continue
        if carry is not None:
            if m.role == "user":
                m = dataclasses.replace(m, content=_joined(carry, m.content or ""))
            else:
                out.append(ChatMessage(role="user", content=carry))
            carry = None
        out.append(m)
    if carry is not None:
        out.append(ChatMessage(role="user", content=carry))
    return tuple(out)
