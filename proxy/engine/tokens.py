"""Prompt tokenization for the HTTP side: thread-safe, independent of the engine thread.

The app calls ``Tokenizer.tokenize_segments`` (chat: the template's markup apart from
what the client typed) or ``tokenize_prompt`` (a raw completion prompt) off the event
loop; with ``cache.splice_generated`` the ids of recent replies stand in for their
re-tokenized text (see proxy/engine/splice.py).

A chat prompt's template text is tokenized in pieces, cut where each special token
starts, and a piece tokenized before keeps its ids (``Pieces``), so a follow-up
tokenizes only what is new. The ids are those of the whole text: llama.cpp splits a
text at its special tokens before it tokenizes the runs between them, each on its own,
so no token spans such a cut (the tokenizer's first piece after one is the special
token itself, which is checked). Not where a special token strips the whitespace
before it (llama.cpp's LSTRIP: that whitespace belongs to the piece before), nor with
splicing (a piece's ids then depend on the replies remembered).
"""

from __future__ import annotations

import collections
import json
import logging
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from proxy.engine.binding import Model
from proxy.engine.binding.vocab import alternation
from proxy.engine.splice import ReplyMemory, aligned_replies, tokenize_spliced
from proxy.meters import EngineMeter

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Segment:
    text: str
    special: bool  # parse special-token texts in it (template markup) or not (client text)


PIECE_CHARS = 16 << 20  # characters of template text whose ids are kept


NONE = np.empty(0, dtype=np.int32)
NONE.flags.writeable = False


def _ids(ids: list[int]) -> np.ndarray:
    out = np.asarray(ids, dtype=np.int32)
    out.flags.writeable = False  # shared: pieces are handed to every prompt that has them
    return out


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    if len(parts) == 1:
        return parts[0]
    out = np.concatenate(parts) if parts else NONE
    out.flags.writeable = False
    return out


class Pieces:
    """Ids of pieces of template text already tokenized, by their text; the least
    recently used go first past ``max_chars`` characters. Thread-safe."""

    def __init__(self, max_chars: int = PIECE_CHARS) -> None:
        self.max_chars = max_chars
        self.chars = 0
        self._ids: collections.OrderedDict[str, np.ndarray] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._ids)

    def get(self, text: str) -> np.ndarray | None:
        with self._lock:
            ids = self._ids.get(text)
            if ids is not None:
                self._ids.move_to_end(text)
            return ids

    def put(self, text: str, ids: np.ndarray) -> None:
        if len(text) > self.max_chars:
            return
        with self._lock:
            if text not in self._ids:
                self.chars += len(text)
            self._ids[text] = ids
            while self.chars > self.max_chars:
                old, _ = self._ids.popitem(last=False)
                self.chars -= len(old)


class Tokenizer:
    def __init__(self, model: Model, meter: EngineMeter,
                 replies: ReplyMemory | None, piece_chars: int = PIECE_CHARS) -> None:
        self.model = model
        self.meter = meter
        self.replies = replies
        facts = model.vocab_facts()  # read once now (Gemma: 0.7 s), not in the first request
        self.pieces = Pieces(piece_chars) if piece_chars and not facts.lstrip else None
        # any of ``special_texts`` as it stands inside JSON text (``json.dumps`` without
        # ``ensure_ascii``): a value whose JSON does not match holds none
        texts = {json.dumps(t, ensure_ascii=False)[1:-1] for t in facts.special_texts}
        self.special_json_re = re.compile(alternation(sorted(texts))) if texts else None

    @property
    def special_texts(self) -> tuple[str, ...]:
        """Texts that tokenize to control tokens when special parsing is on."""
        return self.model.vocab_facts().special_texts

    @property
    def special_re(self) -> re.Pattern[str] | None:
        """Matches any of ``special_texts`` (None when the vocabulary has none)."""
        return self.model.vocab_facts().special_re


    @property
    def max_token_bytes(self) -> int | None:
        """Most bytes of text one token covers (None: no bound for this vocabulary)."""
        return self.model.vocab_facts().max_token_bytes

    def tokenize(self, text: str) -> list[int]:
        return self.model.tokenize(text, add_special=False, parse_special=True)

    def tokenize_segments(self, segments: Sequence[Segment], tenant: str = ""
                          ) -> tuple[np.ndarray, list[int]]:
        """Tokenize a prompt given in pieces: (ids, ids so far at the end of each piece);
        the ids are a read-only int32 array (the engine's own form: no copy on the way).

        A piece with ``special`` parses special-token texts (the template's markup); one
        without stays plain text (what a client typed), so it never yields a control token.
        """
        parts: list[np.ndarray] = []
        ends: list[int] = []
        n = 0
        for seg in segments:
            if seg.special:
                got = self.tokenize_template(seg.text, tenant)
            elif seg.text:
                got = _ids(self.model.tokenize(seg.text, add_special=False,
                                               parse_special=False))
            else:
                got = NONE
            parts.append(got)
            n += len(got)
            ends.append(n)
        return _joined(parts), ends

    def tokenize_template(self, text: str, tenant: str = "") -> np.ndarray:
        """Template text (special tokens parsed), in pieces cut where each special token
        starts: a piece tokenized before keeps its ids; the ids are the whole text's."""
        pieces, regex = self.pieces, self.special_re
        if pieces is None or self.replies is not None:
            return _ids(self.tokenize_prompt(text, tenant))
        cuts = [0]
        if regex is not None:
            cuts += [m.start() for m in regex.finditer(text) if m.start()]
        cuts.append(len(text))
        parts: list[np.ndarray] = []
        for a, b in zip(cuts, cuts[1:], strict=False):
            piece = text[a:b] if len(cuts) > 2 else text
            got = pieces.get(piece)
            if got is None:
                got = _ids(self.tokenize(piece))
                if a and not (len(got) and self.model.is_control(int(got[0]))):
                    # llama.cpp did not take the text there as a special token: whole
                    log.debug("template text not cut at %r: tokenized whole", piece[:16])
                    return _ids(self.tokenize(text))
                pieces.put(piece, got)
            parts.append(got)
        return _joined(parts)

    def tokenize_prompt(self, text: str, tenant: str = "") -> list[int]:
        if self.replies is None:
            return self.tokenize(text)
        ids, n = tokenize_spliced(text, self.tokenize, self.replies.recent(tenant))
        if n:
            self.meter.replies_spliced.inc(by=n)
        return ids

    def remember_reply(self, tenant: str, generated: list[int]) -> None:
        """Keep a finished reply's ids for splicing (engine thread)."""
        if self.replies is None:
            return
        m = self.model
        ids = [t for t in generated if not m.is_eog(t)]
        pieces = [m.token_bytes(t) for t in ids]
        special = [not m.token_bytes(t, special=False) and bool(p)
                   for t, p in zip(ids, pieces, strict=True)]
        self.replies.remember(tenant, aligned_replies(ids, pieces, special))
