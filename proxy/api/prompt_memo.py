"""What the prompts of a conversation share from one request to the next, kept so that a
follow-up renders, tokenizes and places only what is new (``PromptMemo``, one per app;
proxy/api/prompt.py asks it; tokens are kept by the tokenizer, proxy/engine/tokens.py).

- The history (the prompt without its generation prompt): a template renders the
  generation prompt at the end, the same text for the same template variables, tools or
  not, and last role. The first request of each such kind renders both and learns that
  text; later ones whose prompt ends with it take the history as the prompt less it,
  without a second render. A template whose two renders do not differ by an ending is
  rendered twice, as before.
- The marks of the first turn (its message and part starts, the breakpoints in it and in
  the tools): each conversation of an agent sends the same first turn, so where they
  fall is found once (a render with sentinels, proxy/api/hints.py) and kept with the
  prompt's text up to the last of them, to the next special token: a prompt that starts
  with that text and names the same marks has them at the same characters.
- A breakpoint further on (Claude Code marks the last block of its last message) is
  found where the message's content stands in the prompt as sent, when it stands there
  once, or once after the contents of the messages before it (an agent sends the same
  "go on" note again and again); else by a render with sentinels.

Bounded (``max_entries`` first turns, least recently used out first); thread-safe.
"""

from __future__ import annotations

import collections
import json
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.api.chat import TOOLS_END, ChatRequest, Mark
from proxy.api.hints import first_turn, place
from proxy.api.literals import AREA_RE

MAX_ENTRIES = 256  # first turns kept
Render = Callable[[ChatRequest], str]
# token positions of character offsets, counted on from (a character, the tokens before)
Positions = Callable[..., list[int]]


@dataclass(slots=True, frozen=True)
class _FirstTurn:
    marks: tuple[Mark, ...]
    prefix: str  # the prompt's text up to past the last of them
    positions: tuple[int, ...]  # each mark's token position
    tokens: int  # tokens of ``prefix``


class PromptMemo:
    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._endings: dict[tuple[str, bool, str], str | None] = {}
        self._tools: list[tuple[Sequence[Mapping[str, Any]], str, bool]] = []
        self._turns: collections.OrderedDict[tuple[Mark, ...], list[_FirstTurn]] = \
            collections.OrderedDict()
        self._lock = threading.Lock()

    # -- the history --------------------------------------------------------------------

    def history(self, req: ChatRequest, text: str, render_history: Callable[[], str],
                kwargs_key: str) -> str:
        """The prompt ``text`` without its generation prompt: the text less the ending
        learned for this kind of request, else ``render_history()`` (and learn it)."""
        last = req.messages[-1].role if req.messages else ""
        key = (kwargs_key, bool(req.tools), last)
        with self._lock:
            known = key in self._endings
            ending = self._endings.get(key)
        if ending and text.endswith(ending):
            return text[: len(text) - len(ending)]
        history = render_history()
        if not known:
            learned = text[len(history):] if text.startswith(history) and \
                len(text) > len(history) else None
            with self._lock:
                if len(self._endings) < self.max_entries:
                    self._endings[key] = learned
        return history

    # -- tools ------------------------------------------------------------------------

    def tools(self, tools: Sequence[Mapping[str, Any]], json_re: re.Pattern[str] | None
              ) -> tuple[Sequence[Mapping[str, Any]], str, bool]:
        """The tools as an earlier request sent them where they are equal (the same
        objects, so nothing of them is checked or written anew), their JSON (sorted keys,
        proxy/api/misses.py's form) and whether it holds no special-token text and no
        character of the placeholders' area (``json_re``: special texts as JSON writes
        them; None: unknown, so not clean)."""
        with self._lock:
            for i, (known, text, clean) in enumerate(self._tools):
                if known == tools:  # dicts and lists compare in C
                    self._tools.insert(0, self._tools.pop(i))
                    return known, text, clean
        text = json.dumps(list(tools), sort_keys=True, ensure_ascii=False,
                          separators=(",", ":"))
        clean = json_re is not None and json_re.search(text) is None \
            and AREA_RE.search(text) is None
        with self._lock:
            self._tools.insert(0, (tools, text, clean))
            del self._tools[8:]  # the tool sets of a few agents
        return tools, text, clean

    # -- marks ------------------------------------------------------------------------

    def points(self, render: Render, req: ChatRequest, text: str, marks: Sequence[Mark],
               escape: Callable[[Any], Any], special_re: re.Pattern[str] | None,
               positions: Positions) -> list[tuple[Mark, int]]:
        """Each mark's token position (``hints.place``, then ``positions``): the first
        turn's from a conversation seen before where it matches, a later breakpoint's
        from where its message stands in the text, counted on from the first turn."""
        turn = first_turn(req.messages)
        early = tuple(m for m in marks if m.message == TOOLS_END or m.message < turn)
        late = [m for m in marks if not (m.message == TOOLS_END or m.message < turn)]
        entry = self._known(early, text)
        if entry is None:
            placed = place(render, req, text, early)
            found = list(zip((m for m, _ in placed), positions([c for _, c in placed]),
                             strict=True))
            entry = self._learn(early, placed, found, text, special_re, positions)
        else:
            found = list(zip(entry.marks, entry.positions, strict=True))
        start = len(entry.prefix) if entry is not None else 0
        anchor = (start, entry.tokens) if entry is not None else (0, 0)
        chars: list[tuple[Mark, int]] = []
        slow: list[Mark] = []
        for m in late:
            c = _where_it_stands(req, m, text, start, escape)
            if c is None:
                slow.append(m)
            else:
                chars.append((m, c))
        if slow:
            chars += place(render, req, text, slow)
        after = [(m, c) for m, c in chars if c >= start]
        before = [(m, c) for m, c in chars if c < start]
        found += zip((m for m, _ in after), positions([c for _, c in after], anchor),
                     strict=True)
        found += zip((m for m, _ in before), positions([c for _, c in before]), strict=True)
        return found

    def _known(self, marks: tuple[Mark, ...], text: str) -> _FirstTurn | None:
        if not marks:
            return None
        with self._lock:
            entries = self._turns.get(marks)
            if entries is not None:
                self._turns.move_to_end(marks)
                entries = list(entries)
        for e in entries or ():
            if text.startswith(e.prefix):
                return e
        return None

    def _learn(self, marks: tuple[Mark, ...], placed: list[tuple[Mark, int]],
               found: list[tuple[Mark, int]], text: str,
               special_re: re.Pattern[str] | None, positions: Positions) -> _FirstTurn | None:
        if not marks or len(placed) != len(marks):
            return None  # a mark the template did not render: placed anew each time
        last = max(c for _, c in placed)
        # the text to the next special token past the last mark: the tokens before it
        # are then the same in any prompt that starts with it
        nxt = special_re.search(text, last + 1) if special_re is not None else None
        if nxt is None:
            return None
        at = dict(found)
        entry = _FirstTurn(marks, text[: nxt.start()], tuple(at[m] for m in marks),
                           positions([nxt.start()])[0])
        with self._lock:
            entries = self._turns.setdefault(marks, [])
            entries.insert(0, entry)
            del entries[4:]  # a few conversations of each shape
            self._turns.move_to_end(marks)
            while len(self._turns) > self.max_entries:
                self._turns.popitem(last=False)
        return entry


def _where_it_stands(req: ChatRequest, mark: Mark, text: str, start: int,
                     escape: Callable[[Any], Any]) -> int | None:
    """A mark's character in ``text`` where its message's content stands there as sent,
    once after ``start``, or once after the messages before it (``_after_the_earlier``);
    None otherwise (the template changed it, or it is ambiguous)."""
    content = req.messages[mark.message].content or ""
    if not content or not 0 < mark.offset <= len(content):
        return None
    whole, head = escape(content), escape(content[: mark.offset])
    if not (isinstance(whole, str) and isinstance(head, str) and whole.startswith(head)):
        return None
    at = text.find(whole, start)
    if at < 0:
        return None
    if text.find(whole, at + 1) >= 0:  # a message sent again (an agent's "go on" note)
        again = _after_the_earlier(req, mark.message, text, start, escape, whole)
        if again is None:
            return None
        at = again
    return at + len(head)


def _after_the_earlier(req: ChatRequest, message: int, text: str, start: int,
                       escape: Callable[[Any], Any], whole: str) -> int | None:
    """Where ``whole`` (message ``message``'s content) stands once after the contents of
    the messages before it, each found at its first occurrence after the one before.

    Where the template writes each content as sent, the walk never passes a message's
    own place: each content found is at or before where the template wrote it, so the
    place reached is at or before the end of the message before ``message``, and a
    ``whole`` that stands once after it stands there as that message. A content not
    found (the template changed it) is passed over, which keeps that true; one the
    template left out but which stands further on can carry the walk past the message,
    and then its breakpoint's checkpoint lands at another place of the same prompt (a
    state of the prompt all the same, never a wrong one). Asked only where a message's
    content repeats: one search per message, in C."""
    at = start
    for m in req.messages[first_turn(req.messages):message]:
        if not m.content:
            continue
        part = escape(m.content)
        if not isinstance(part, str):
            return None
        found = text.find(part, at)
        if found >= 0:
            at = found + len(part)
    found = text.find(whole, at)
    if found < 0 or text.find(whole, found + 1) >= 0:
        return None
    return found
