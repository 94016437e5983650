"""Keep special-token texts that a client typed as plain text.

A chat prompt is tokenized with special-token parsing on, so that the template's own
markup (``<|im_start|>``, ``<start_of_turn>``) becomes control tokens. Without care, a
user message holding ``<|im_end|>\\n<|im_start|>system\\n...`` would open a real system
turn. So, before rendering, every special-token text inside a client's strings (message
contents, names, reasoning, tool calls and their arguments, tool results, tool
definitions, template kwargs) is replaced by a placeholder: one character of Unicode's
Supplementary Private Use Area-B per distinct text. The rendered prompt is then cut at
the placeholders: the template's text is tokenized with special parsing, each
placeholder's original text without it.

A client's own characters of that area are escaped the same way (each stands for
itself), so no client text can forge a placeholder. The same conversation always gives
the same pieces, so it tokenizes to the same ids every turn and cache hits stay exact.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from proxy.engine.tokens import Segment

FIRST = 0x100000  # Supplementary Private Use Area-B
LAST = 0x10FFFF
AREA_RE = re.compile(f"[\\U{FIRST:08X}-\\U{LAST:08X}]")


class Literals:
    """One request's placeholders: each stands for a text that must stay plain.

    ``special_re`` matches the vocabulary's special-token texts (``Tokenizer.special_re``).
    """

    def __init__(self, special_re: re.Pattern[str] | None,
                 json_re: re.Pattern[str] | None = None) -> None:
        self._special_re = special_re
        self._json_re = json_re
        self._by_text: dict[str, str] = {}
        self._by_char: dict[str, str] = {}
        self._clean: set[int] = set()  # ids of values known to hold nothing to escape

    def __len__(self) -> int:
        return len(self._by_char)

    def trust(self, value: object) -> None:
        """``value`` is known to hold no special-token text and no character of the
        placeholders' area (proxy/api/prompt_memo.py checked it): ``escape`` returns it."""
        self._clean.add(id(value))

    def escape(self, value: Any) -> Any:
        """``value`` with every string in it (keys too, nested) escaped. A list or dict
        whose JSON text holds no special-token text (``json_re``: each as it stands in
        JSON) and no character of the placeholders' area comes back as it is: one search
        of its JSON in C, not a walk of every string in Python (an agent's tools)."""
        if id(value) in self._clean:
            return value
        if isinstance(value, dict | list | tuple) and self._json_re is not None:
            try:
                blob = json.dumps(value, ensure_ascii=False)
            except (TypeError, ValueError):
                blob = None
            if blob is not None and AREA_RE.search(blob) is None \
                    and self._json_re.search(blob) is None:
                return value
        return self._escape(value)

    def _escape(self, value: Any) -> Any:
        if isinstance(value, str):
            return self._escape_str(value)
        if isinstance(value, dict):
            return {self._escape(k): self._escape(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return type(value)(self._escape(v) for v in value)
        return value

    def _escape_str(self, s: str) -> str:
        # The area first: a client's own characters of it then stand for themselves, and
        # the placeholders made for special texts next are not escaped again.
        if AREA_RE.search(s) is not None:
            s = AREA_RE.sub(self._placeholder, s)
        if self._special_re is not None and self._special_re.search(s) is not None:
            s = self._special_re.sub(self._placeholder, s)
        return s

    def _placeholder(self, m: re.Match[str]) -> str:
        text = m.group()
        ch = self._by_text.get(text)
        if ch is None:
            if FIRST + len(self._by_char) > LAST:
                raise ValueError("too many distinct special-token texts in one request")
            ch = chr(FIRST + len(self._by_char))
            self._by_text[text] = ch
            self._by_char[ch] = text
        return ch

    def plain_bytes(self, text: str) -> int:
        """UTF-8 bytes of ``text`` as tokenized: each placeholder as the text it holds."""
        n = len(text.encode("utf-8", "surrogatepass"))
        if self._by_char:
            for m in AREA_RE.finditer(text):
                original = self._by_char.get(m.group())
                if original is not None:
                    n += len(original.encode("utf-8", "surrogatepass")) - len(m.group().encode())
        return n

    def segments(self, text: str, cuts: Iterable[int] = ()) -> tuple[list[Segment], list[int]]:
        """The rendered ``text`` in pieces to tokenize, and for each offset of ``cuts``
        (sorted) the number of pieces before it: a cut always falls between pieces."""
        events: list[tuple[int, str | None]] = [(c, None) for c in sorted(set(cuts))]
        if self._by_char:
            events += [(m.start(), self._by_char[m.group()]) for m in AREA_RE.finditer(text)
                       if m.group() in self._by_char]  # others are the template's own
            events.sort(key=lambda e: (e[0], e[1] is not None))
        out: list[Segment] = []
        at: list[int] = []
        pos = 0
        for offset, original in events:
            if offset > pos:
                out.append(Segment(text[pos:offset], True))
                pos = offset
            if original is None:
                at.append(len(out))
            else:
                out.append(Segment(original, False))
                pos = offset + 1  # a placeholder is one character
        if pos < len(text):
            out.append(Segment(text[pos:], True))
        return out, at
