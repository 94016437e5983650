"""Prompt tokenization for the HTTP side: thread-safe, independent of the engine thread.

The app calls ``Tokenizer.tokenize_segments`` (chat: the template's markup apart from
what the client typed) or ``tokenize_prompt`` (a raw completion prompt) off the event
loop; with ``cache.splice_generated`` the ids of recent replies stand in for their
re-tokenized text (see proxy/engine/splice.py).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from proxy.engine.binding import Model
from proxy.engine.splice import ReplyMemory, aligned_replies, tokenize_spliced
from proxy.meters import EngineMeter

log = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class Segment:
    text: str
    special: bool  # parse special-token texts in it (template markup) or not (client text)


class Tokenizer:
    def __init__(self, model: Model, meter: EngineMeter,
                 replies: ReplyMemory | None) -> None:
        self.model = model
        self.meter = meter
        self.replies = replies
        model.vocab_facts()  # read once now (Gemma: 0.7 s), not in the first request

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
                          ) -> tuple[list[int], list[int]]:
        """Tokenize a prompt given in pieces: (ids, ids so far at the end of each piece).

        A piece with ``special`` parses special-token texts (the template's markup); one
        without stays plain text (what a client typed), so it never yields a control token.
        """
        ids: list[int] = []
        ends: list[int] = []
        for seg in segments:
            if seg.special:
                ids += self.tokenize_prompt(seg.text, tenant)
            elif seg.text:
                ids += self.model.tokenize(seg.text, add_special=False, parse_special=False)
            ends.append(len(ids))
        return ids, ends

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
