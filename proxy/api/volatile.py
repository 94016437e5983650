"""Volatile fragments: configured rewrites of message text before it is rendered.

Some clients put a per-conversation or per-process fragment early in the prompt: Claude
Code's first system block is ``x-anthropic-billing-header: cc_version=2.1.37.a1b; ...``
with a suffix that changes with every conversation, so each new conversation leaves the
cached system prompt within its first few tokens and prefills all of it again. A rule
(``[[server.volatile]]`` with ``pattern`` and ``replace``) rewrites such a fragment to a
constant, so the prompts agree again. Off by default: it changes what the model reads.

Rules apply in order to the ``content`` of every message (system, user, assistant,
tool), never to tool definitions, tool-call arguments or reasoning; how often each one
replaced something is counted for /metrics.
"""

from __future__ import annotations

import dataclasses
import re
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.api.chat import ChatMessage, ChatRequest
from statecache.config import VolatileRule


@dataclass(slots=True, frozen=True)
class _Compiled:
    label: str  # the rule's name, else its index
    regex: re.Pattern[str]
    replace: str


class Volatile:
    """The configured rules, compiled; thread-safe (its counter has a lock)."""

    def __init__(self, rules: Sequence[VolatileRule] = ()) -> None:
        # config.load_config compiled each rule already, with an error naming it
        self._rules = tuple(_Compiled(r.name or str(i), re.compile(r.pattern), r.replace)
                            for i, r in enumerate(rules))
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def __bool__(self) -> bool:
        return bool(self._rules)

    def apply(self, req: ChatRequest) -> ChatRequest:
        """``req`` with every rule applied to its messages' text (the same object when
        nothing matched)."""
        if not self._rules:
            return req
        counts: Counter[str] = Counter()
        messages = tuple(self._message(m, counts) for m in req.messages)
        if not counts:
            return req
        with self._lock:
            self._counts.update(counts)
        return dataclasses.replace(req, messages=messages)

    def _message(self, m: ChatMessage, counts: Counter[str]) -> ChatMessage:
        text = m.content
        if not text:
            return m
        for rule in self._rules:
            text, n = rule.regex.subn(rule.replace, text)
            if n:
                counts[rule.label] += n
        return m if text == m.content else dataclasses.replace(m, content=text)

    def counts(self) -> dict[str, int]:
        """Replacements made so far, per rule (every rule listed, 0 when unused)."""
        with self._lock:
            return {r.label: self._counts[r.label] for r in self._rules}
