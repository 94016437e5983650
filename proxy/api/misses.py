"""Why a request missed the cache: what the server rendered before, and where a new
prompt leaves it.

After each reply the app remembers the conversation it rendered: its messages (as
``Turn``s), tools, template kwargs, the prompt's token ids and the reply's ids and text.
A new request is compared with its tenant's remembered conversation that shares the
longest token prefix (prompt and reply). That gives a ``Divergence``: how many of its
tokens an earlier request held (``known``), the first token that differs, the message
and role there, a short excerpt of each side, and a cause:

- "new conversation": nothing earlier shares more than a page with it, or only its
  system prompt and tools (its first user message differs: a subagent, a new task);
- "system prompt changed", "tools changed", "earlier message edited": the first
  message that differs (or the tools);
- "reasoning dropped": an assistant message that carried reasoning comes back without;
- "reply re-rendered differently": the same text (up to whitespace), other tokens; said
  with the syntax of the template that re-rendered it and an excerpt of each side where
  the tokens part (a template that writes a call's arguments otherwise than the model
  did, or drops the reasoning its generation prompt opened);
- "reply re-tokenized differently": the reply came back as the very text it was streamed
  as, and that text tokenizes to other ids than the model generated (a reply cut by
  ``max_tokens`` inside a UTF-8 character, a byte-fallback vocabulary): ``known`` then
  counts the whole reply, which could have been reused;
- "other tenant": another tenant's conversation shares more than this tenant's own;
  said without any of that tenant's text, which never leaves this module;
- "evicted": the text agreed all along (the engine says so too, when the state was gone);
- "page missing", "page refused": the engine's word where the text agreed and the
  checkpoint that held it was dropped because a KV page it needs went missing or failed
  its check (statecache/pool/lost.py; told for the next request that would have used it).

A client that names its conversations (``session``: Codex's ``prompt_cache_key``, Claude
Code's session and agent ids) is compared with the same conversation first: a prompt it
changed is never "new conversation"; one that another conversation shares only up to
its first user message is.

The engine reports it as a miss only when it reused less than ``known`` (less a page).
Bounded: ``max_entries`` conversations, ``max_bytes`` of ids and text, ``per_tenant`` of
one tenant, least recently used out first; a conversation a later one continues is
replaced by it, so an agent session is one entry, not one per turn. Thread-safe.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from proxy.api.chat import ChatMessage, ChatRequest
from proxy.api.reply import parse_reply, starts_in_reasoning
from proxy.api.syntax.calls import Syntax
from proxy.api.syntax.families import HERMES
from proxy.engine.types import Divergence
from statecache.pages import common_prefix

PAGE = 32  # tokens; the engine's cache.page_size
MAX_ENTRIES = 512
PER_TENANT = 64
MAX_BYTES = 64 << 20
BEFORE, AFTER = 16, 24  # characters of an excerpt before and after the first difference
_TURN_BYTES = 64  # rough overhead of one remembered message


@dataclass(slots=True, frozen=True)
class Turn:
    """One message as rendered: its role and text (tool-call arguments as canonical JSON)."""

    role: str
    content: str
    reasoning: str = ""
    calls: tuple[tuple[str, str], ...] = ()  # (name, arguments) per tool call

    @property
    def nbytes(self) -> int:
        return (_TURN_BYTES + len(self.content) + len(self.reasoning)
                + sum(len(n) + len(a) for n, a in self.calls))


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def _arguments(text: str) -> str:
    try:
        return _canonical(json.loads(text))
    except ValueError:
        return text


def turn_of(m: ChatMessage) -> Turn:
    return Turn(m.role, m.content or "", m.reasoning_content or "",
                tuple((c.name, _arguments(c.arguments)) for c in m.tool_calls))


@dataclass(slots=True, frozen=True, eq=False)
class Conversation:
    """What one request rendered (a raw completion prompt is one turn of role "prompt")."""

    tenant: str
    turns: tuple[Turn, ...]
    tools: str  # canonical JSON, "" without tools
    setup: str  # the template kwargs, canonical JSON
    tokens: np.ndarray  # the prompt's ids (int32)
    history: int  # tokens before the generation prompt
    opens_reasoning: bool = False  # the prompt ends inside <think>
    parse_tools: bool = False
    session: str | None = None  # the client's name for the conversation
    syntax: Syntax = HERMES  # the template's, to read the reply back into a message


def chat_conversation(tenant: str, req: ChatRequest, tokens: Sequence[int] | np.ndarray,
                      rendered: str, history: int | None, session: str | None = None,
                      syntax: Syntax = HERMES, tools_json: str | None = None) -> Conversation:
    """``tools_json``: the tools' canonical JSON where it is known already."""
    ids = np.asarray(tokens, dtype=np.int32)
    if tools_json is None:
        tools_json = _canonical(list(req.tools)) if req.tools else ""
    return Conversation(tenant, tuple(turn_of(m) for m in req.messages), tools_json,
                        _canonical(dict(req.template_kwargs)), ids,
                        len(ids) if history is None else history,
                        starts_in_reasoning(rendered, syntax), req.parse_tools, session,
                        syntax)


def prompt_conversation(tenant: str, text: str, tokens: Sequence[int]) -> Conversation:
    ids = np.asarray(tokens, dtype=np.int32)
    return Conversation(tenant, (Turn("prompt", text),), "", "", ids, len(ids))


@dataclass(slots=True, frozen=True, eq=False)
class _Seen:
    conv: Conversation  # its turns end with the reply's, its tokens hold the reply's
    nbytes: int


def _excerpts(old: str, new: str) -> tuple[str, str]:
    """About 40 characters of each text around the first character where they differ."""
    c = 0
    limit = min(len(old), len(new))
    while c < limit and old[c] == new[c]:
        c += 1
    start = max(0, c - BEFORE)

    def cut(s: str) -> str:
        return ("…" if start else "") + s[start:c + AFTER] + ("…" if len(s) > c + AFTER else "")
    return cut(old), cut(new)


def _calls_text(t: Turn) -> str:
    return "; ".join(f"{n}({a})" for n, a in t.calls)


def _turn_excerpts(old: Turn, new: Turn) -> tuple[str, str]:
    for a, b in ((old.content, new.content), (old.reasoning, new.reasoning),
                 (_calls_text(old), _calls_text(new)), (old.role, new.role)):
        if a != b:
            return _excerpts(a, b)
    return "", ""


def _words(s: str) -> str:
    return " ".join(s.split())


def _same_text(old: Turn, new: Turn) -> bool:
    """The same message up to whitespace."""
    return (old.role == new.role and _words(old.content) == _words(new.content)
            and _words(old.reasoning) == _words(new.reasoning) and old.calls == new.calls)


def _differs(old: Turn, new: Turn) -> bool:
    if old.role == new.role == "prompt":  # a raw prompt may continue an earlier one
        return not (new.content.startswith(old.content) or old.content.startswith(new.content))
    return old != new


def _cause(old: Turn, new: Turn, k: int, tools_changed: bool, opening: bool) -> str:
    if tools_changed and not (k == 0 and "system" in (old.role, new.role)):
        return "tools changed"  # tools render with the system prompt, before the messages
    if "system" in (old.role, new.role):
        return "system prompt changed"
    if opening and new.role == "user":
        return "new conversation"  # it shares the system prompt and tools, as subagents do
    if old.role == new.role == "assistant":
        if (old.reasoning.strip() and not new.reasoning.strip()
                and _words(old.content) == _words(new.content) and old.calls == new.calls):
            return "reasoning dropped"
        if _same_text(old, new):
            return "reply re-rendered differently"
    return "earlier message edited"


Text = Callable[[np.ndarray], str]  # token ids -> the text they decode to


def _retokenized(seen: Conversation, conv: Conversation, common: int, text: Text | None
                 ) -> bool:
    """Whether the two part at ``common``, inside the reply, with the same text there."""
    if text is None or not seen.history <= common < len(seen.tokens):
        return False
    old = text(seen.tokens[common:])
    new = text(conv.tokens[common:common + len(seen.tokens) - common + 8])
    return bool(old) and new.startswith(old)


def _family(conv: Conversation, cause: str) -> str:
    """The syntax whose template re-rendered a reply (its calls, its reasoning)."""
    return conv.syntax.name if cause in ("reply re-rendered differently",
                                         "reasoning dropped") else ""


def explain(seen: Conversation, conv: Conversation, common: int,
            text: Text | None = None) -> Divergence:
    """Why ``conv`` leaves the remembered ``seen`` (prompt and reply) at token ``common``;
    ``text`` decodes ids (to tell a reply re-tokenized from one re-rendered)."""
    n = len(conv.tokens)
    known = min(common, n - 1)
    if common >= min(len(seen.tokens), n):  # one holds the other: the text agreed
        return Divergence(known, "evicted", replayed=n > common == len(seen.tokens))
    if _retokenized(seen, conv, common, text):
        k = len(seen.turns) - 1
        role = conv.turns[k].role if 0 <= k < len(conv.turns) else ""
        return Divergence(min(len(seen.tokens), n - 1), "reply re-tokenized differently",
                          common, k if role else -1, role)
    tools_changed = seen.tools != conv.tools
    for k, (old, new) in enumerate(zip(seen.turns, conv.turns, strict=False)):
        if _differs(old, new):
            opening = k == len(conv.turns) - 1 and all(t.role == "system"
                                                       for t in conv.turns[:k])
            cause = _cause(old, new, k, tools_changed, opening)
            o, w = (_excerpts(seen.tools, conv.tools) if cause == "tools changed"
                    else _turn_excerpts(old, new))
            return Divergence(known, cause, common, k, new.role, o, w,
                              family=_family(conv, cause))
    if tools_changed:
        return Divergence(known, "tools changed", common, -1, "",
                          *_excerpts(seen.tools, conv.tools))
    if seen.setup != conv.setup:  # template kwargs render into the system prompt
        return Divergence(known, "system prompt changed", common, -1, "",
                          *_excerpts(seen.setup, conv.setup))
    if common >= seen.history:  # the same messages; the reply's tokens came back otherwise
        k = len(seen.turns) - 1
        role = conv.turns[k].role if 0 <= k < len(conv.turns) else ""
        at = max(common - 8, seen.history)  # a few tokens before, in the reply
        o, w = ("", "") if text is None else _excerpts(text(seen.tokens[at:common + 12]),
                                                       text(conv.tokens[at:common + 12]))
        return Divergence(known, "reply re-rendered differently", common,
                          k if role else -1, role, o, w,
                          family=_family(conv, "reply re-rendered differently"))
    # the same messages rendered otherwise before the reply (a date in the template)
    return Divergence(known, "system prompt changed", common)


class SeenConversations:
    """The conversations the server rendered lately, per tenant, bounded."""

    def __init__(self, *, page: int = PAGE, max_entries: int = MAX_ENTRIES,
                 per_tenant: int = PER_TENANT, max_bytes: int = MAX_BYTES,
                 text: Text | None = None) -> None:
        self.page = page
        self.text = text
        self.max_entries, self.per_tenant, self.max_bytes = max_entries, per_tenant, max_bytes
        self._entries: collections.OrderedDict[int, _Seen] = collections.OrderedDict()
        self._tenants: collections.Counter[str] = collections.Counter()
        self._bytes = 0
        self._next_key = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def nbytes(self) -> int:
        return self._bytes

    def divergence(self, conv: Conversation) -> Divergence:
        """Where ``conv`` leaves what this tenant (or, if more, another tenant) sent before."""
        with self._lock:
            entries = list(self._entries.items())
        own: tuple[int, _Seen] | None = None
        same: tuple[int, _Seen] | None = None  # the same conversation, as the client names it
        own_common = other_common = same_common = 0
        for key, e in entries:
            c = common_prefix(e.conv.tokens, conv.tokens)
            if e.conv.tenant == conv.tenant:
                if own is None or c > own_common:
                    own, own_common = (key, e), c
                if conv.session is not None and e.conv.session == conv.session and \
                        (same is None or c > same_common):
                    same, same_common = (key, e), c
            else:
                other_common = max(other_common, c)
        n = len(conv.tokens)
        if other_common > max(own_common, self.page):
            # tenants never share states; their text stays theirs
            return Divergence(min(other_common, n - 1), "other tenant", own_common)
        if same is not None:
            own, own_common = same, same_common
        elif own is None or own_common <= self.page or (
                conv.session is not None and own[1].conv.session is not None):
            # nothing shared, or only another named conversation shares it
            return Divergence(min(own_common, max(n - 1, 0)), "new conversation",
                              own_common if own is not None else -1)
        with self._lock:
            if own[0] in self._entries:
                self._entries.move_to_end(own[0])
        d = explain(own[1].conv, conv, own_common, self.text)
        if same is not None and d.cause == "new conversation":
            d = dataclasses.replace(d, cause="earlier message edited")  # the client says
        return d

    def remember(self, conv: Conversation, reply_text: str, reply_ids: Sequence[int]) -> None:
        """Keep ``conv`` with its reply; drop what it continues, then the oldest over bounds."""
        seen = _with_reply(conv, reply_text, reply_ids)
        if seen.nbytes > self.max_bytes:
            return
        tokens = seen.conv.tokens
        with self._lock:
            for key, e in list(self._entries.items()):
                old = e.conv.tokens
                if (e.conv.tenant == conv.tenant and len(old) <= len(tokens)
                        and common_prefix(old, tokens) == len(old)):
                    self._drop(key)
            self._entries[self._next_key] = seen
            self._next_key += 1
            self._tenants[conv.tenant] += 1
            self._bytes += seen.nbytes
            while self._tenants[conv.tenant] > self.per_tenant:
                self._drop(next(k for k, e in self._entries.items()
                                if e.conv.tenant == conv.tenant))
            while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
                self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        e = self._entries.pop(key)
        self._bytes -= e.nbytes
        self._tenants[e.conv.tenant] -= 1
        if not self._tenants[e.conv.tenant]:
            del self._tenants[e.conv.tenant]


def _with_reply(conv: Conversation, text: str, ids: Sequence[int]) -> _Seen:
    if conv.turns and conv.turns[-1].role == "prompt":
        turns = (*conv.turns[:-1], Turn("prompt", conv.turns[-1].content + text))
    else:
        r = parse_reply(text, syntax=conv.syntax, starts_in_reasoning=conv.opens_reasoning,
                        parse_tools=conv.parse_tools,
                        tools=json.loads(conv.tools) if conv.tools else None)
        turns = (*conv.turns, Turn("assistant", r.content, r.reasoning,
                                   tuple((c.name, _arguments(c.arguments))
                                         for c in r.tool_calls)))
    tokens = np.concatenate([conv.tokens, np.asarray(ids, dtype=np.int32)])
    seen = Conversation(conv.tenant, turns, conv.tools, conv.setup, tokens, conv.history,
                        conv.opens_reasoning, conv.parse_tools, conv.session, conv.syntax)
    nbytes = tokens.nbytes + sum(t.nbytes for t in turns) + len(conv.tools) + len(conv.setup)
    return _Seen(seen, nbytes)
