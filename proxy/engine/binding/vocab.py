"""Facts about a vocabulary, read once from the model: what it can encode, how long its
tokens are, which texts parse as control tokens.

llama.cpp's SentencePiece tokenizer looks a character up in the vocabulary and, when it
is missing, falls back to byte tokens with ``unordered_map::at``: on a vocabulary without
byte fallback that throws a C++ exception through ctypes and aborts the process. So the
characters are checked here first (``first_unencodable``). The check is conservative: a
character that would only be reached through a merge is refused too.

``max_token_bytes`` bounds the text one token covers, so a text of ``B`` bytes has at
least ``B / max_token_bytes`` tokens: a prompt far past the context is refused before
it is tokenized.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

SPM_SPACE = "\u2581"  # SentencePiece's escaped space: ' ' is looked up as this


def alternation(texts: Iterable[str]) -> str:
    """A regex matching any of ``texts``, longest first, as a trie (fast on large sets)."""
    trie: dict[str, dict] = {}
    for t in texts:
        if not t:
            continue
        node = trie
        for ch in t:
            node = node.setdefault(ch, {})
        node[""] = {}  # end of a text
    return _trie_regex(trie)


def _trie_regex(node: dict[str, dict]) -> str:
    ends = "" in node
    branches = [re.escape(ch) + _trie_regex(sub) for ch, sub in sorted(node.items()) if ch]
    if not branches:
        return ""
    body = branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")"
    if ends:  # this prefix is a text itself: the longer ones are tried first
        return f"(?:{body})?" if len(branches) == 1 else body + "?"
    return body


@dataclass(slots=True, frozen=True)
class VocabFacts:
    special_texts: tuple[str, ...]  # texts that parse as control (or unknown) tokens
    max_token_bytes: int | None  # most bytes of text one token covers; None: no bound known
    byte_fallback: bool  # every byte has a token (or the tokenizer never throws): any text
    chars: frozenset[str] = frozenset()  # single-character tokens, as stored
    fallback_bytes: frozenset[int] = frozenset()  # bytes that do have a token
    # matches any special text, leftmost-longest
    special_re: re.Pattern[str] | None = field(default=None, compare=False)
    # a token split out of the text strips the whitespace before it (llama.cpp's LSTRIP):
    # then a text cut where a special token starts tokenizes otherwise than whole
    lstrip: bool = False

    def first_unencodable(self, text: str, *, parse_special: bool) -> int | None:
        """The index of the first character the tokenizer cannot encode, or None."""
        if self.byte_fallback:
            return None
        bad = {c for c in set(text) if not self._encodable(c)}
        if not bad:
            return None
        # With parse_special, characters inside special-token texts are never looked up.
        spans = [(m.start(), m.end()) for m in self.special_re.finditer(text)] \
            if parse_special and self.special_re is not None else []
        pos = 0
        for start, end in [*spans, (len(text), len(text))]:
            for i in range(pos, start):
                if text[i] in bad:
                    return i
            pos = end
        return None

    def _encodable(self, c: str) -> bool:
        if (SPM_SPACE if c == " " else c) in self.chars:
            return True
        return all(b in self.fallback_bytes for b in c.encode())


def _specials(texts: list[bytes], special: list[bool]) -> tuple[str, ...]:
    return tuple(t.decode("utf-8", "replace") for t, s in zip(texts, special, strict=True)
                 if s and t)


def _compiled(specials: tuple[str, ...]) -> re.Pattern[str] | None:
    return re.compile(alternation(specials)) if specials else None


def spm_facts(texts: list[bytes], special: list[bool]) -> VocabFacts:
    """Facts of a SentencePiece vocabulary from its raw token texts and which are special."""
    specials = _specials(texts, special)
    present = set(texts)
    # llama.cpp's byte_to_token: the token "<0xXX>", else the byte itself as a text
    fallback = frozenset(b for b in range(1, 256)
                         if f"<0x{b:02X}>".encode() in present or bytes([b]) in present)
    full = len(fallback) == 255 and b"<0x00>" in present
    chars: set[str] = set()
    if not full:
        for t in texts:
            s = t.decode("utf-8", "replace")
            if len(s) == 1 and s != "\ufffd":
                chars.add(s)
    return VocabFacts(
        special_texts=specials,
        max_token_bytes=max((len(t) for t in texts), default=1) or 1,
        byte_fallback=full,
        chars=frozenset(chars),
        fallback_bytes=frozenset() if full else fallback,
        special_re=_compiled(specials),
    )


def other_facts(texts: list[bytes], special: list[bool], *, bounded: bool) -> VocabFacts:
    """Facts of a vocabulary whose tokenizer does not throw on unknown text (BPE, ...)."""
    longest = max((len(t) for t in texts), default=1) or 1
    specials = _specials(texts, special)
    return VocabFacts(special_texts=specials, max_token_bytes=longest if bounded else None,
                      byte_fallback=True, special_re=_compiled(specials))
