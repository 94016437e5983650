"""Synthetic coding-agent sessions, deterministic from a seed.

A session is a system prompt with tool definitions and a list of turns, each a
user message or a tool result. What the assistant says is not part of the
workload: the harness (``bench.harness``) sends each turn, appends the server's
reply exactly as returned (content, ``reasoning_content``, ``tool_calls``) and
sends the next turn on top of it, as an agent harness does.

Sizes are in characters. On the synthetic models (a vocabulary of single
characters) a character is a token; on Gemma 3 a token is ~4 characters of this
English-like text. ``scale`` multiplies every size, for quick runs.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field, replace
from typing import Any

_WORDS = (  # noqa: SIM905 (a paragraph of words reads better)
    "the file function value return error test build module import class config "
    "request response buffer cache state token lane page hash checkpoint restore "
    "prefill decode model context server client thread queue lock index path read "
    "write open close parse render check update delete insert list map set key "
    "line column offset length size count total first last next prev start end "
    "should could would must will may not and or but if then else for while with "
    "from into over under after before because since until data type name field"
).split()
_TOOL_NAMES = ("read_file", "write_file", "edit_file", "run_shell", "grep", "list_dir",
               "run_tests", "git_diff", "git_log", "web_search", "open_url", "ask_user")


@dataclass(slots=True, frozen=True)
class Sizes:
    """Character ranges of one session, before scaling."""

    system: tuple[int, int] = (2000, 4000)  # system prompt plus tool definitions
    turn: tuple[int, int] = (100, 2000)  # one user message or tool result
    turns: tuple[int, int] = (10, 20)
    reply_tokens: int = 48  # max_tokens of each assistant reply

    def scaled(self, scale: float) -> Sizes:
        def s(r: tuple[int, int]) -> tuple[int, int]:
            return (max(8, round(r[0] * scale)), max(8, round(r[1] * scale)))

        return replace(self, system=s(self.system), turn=s(self.turn))


@dataclass(slots=True, frozen=True)
class Turn:
    kind: str  # "user" | "tool"
    text: str


@dataclass(slots=True, frozen=True)
class Session:
    name: str
    system: str
    tools: tuple[dict[str, Any], ...]
    turns: tuple[Turn, ...]
    max_tokens: int
    seed: int
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def system_chars(self) -> int:
        return len(self.system) + sum(len(json.dumps(t)) for t in self.tools)


def _text(rng: random.Random, n: int) -> str:
    """About ``n`` characters of sentences made of common words."""
    out: list[str] = []
    size = 0
    while size < n:
        words = [rng.choice(_WORDS) for _ in range(rng.randint(5, 14))]
        s = " ".join(words).capitalize() + rng.choice("...?:")
        out.append(s)
        size += len(s) + 1
    return " ".join(out)[:n]


def _tools(rng: random.Random, chars: int) -> tuple[dict[str, Any], ...]:
    """Tool definitions whose JSON adds up to about ``chars`` characters."""
    names = list(_TOOL_NAMES)
    rng.shuffle(names)
    n = min(len(names), max(2, chars // 300))
    per = max(40, chars // n - 160)  # the JSON skeleton is ~160 characters
    return tuple(
        {"type": "function",
         "function": {"name": name, "description": _text(rng, per),
                      "parameters": {"type": "object",
                                     "properties": {"path": {"type": "string"},
                                                    "arg": {"type": "string"}},
                                     "required": ["path"]}}}
        for name in names[:n])


def system_prompt(seed: int, sizes: Sizes) -> tuple[str, tuple[dict[str, Any], ...]]:
    rng = random.Random(f"system:{seed}")
    total = rng.randint(*sizes.system)
    tools = _tools(rng, total * 2 // 3)
    used = sum(len(json.dumps(t)) for t in tools)
    text = "You are a coding agent working in a repository. " + _text(rng, max(40, total - used))
    return text, tools


def make_session(seed: int, *, scale: float = 1.0, sizes: Sizes = Sizes(),
                 n_turns: int | None = None, name: str = "agent",
                 system_seed: int | None = None) -> Session:
    """One agent session. ``system_seed`` lets two sessions share a system prompt."""
    sz = sizes.scaled(scale)
    system, tools = system_prompt(seed if system_seed is None else system_seed, sz)
    rng = random.Random(f"turns:{name}:{seed}")
    n = n_turns if n_turns is not None else rng.randint(*sz.turns)
    turns = []
    for i in range(n):
        kind = "user" if i == 0 or rng.random() < 0.35 else "tool"
        turns.append(Turn(kind, _text(rng, rng.randint(*sz.turn))))
    return Session(name, system, tools, tuple(turns), sz.reply_tokens, seed)


def edit_middle(messages: list[dict[str, Any]], seed: int) -> list[dict[str, Any]]:
    """A copy of ``messages`` with one user/tool message near the middle rewritten.

    Like a harness that compacts or redacts an old tool result: the prefix before
    it stays, everything after it must be prefilled again.
    """
    idx = [i for i, m in enumerate(messages) if m["role"] in ("user", "tool")]
    if len(idx) < 3:
        raise ValueError("edit_middle needs at least three user/tool messages")
    i = idx[len(idx) // 2]
    out = [dict(m) for m in messages]
    old = out[i]["content"]
    rng = random.Random(f"edit:{seed}")
    out[i]["content"] = old[: len(old) // 3] + " [edited] " + _text(rng, len(old) // 3)
    return out
