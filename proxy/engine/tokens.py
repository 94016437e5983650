"""Prompt tokenization for the HTTP side: thread-safe, independent of the engine thread.

The app calls ``Tokenizer.tokenize_prompt`` off the event loop; with
``cache.splice_generated`` the ids of recent replies stand in for their re-tokenized
text (see proxy/engine/splice.py).
"""

from __future__ import annotations

import collections
import logging

from proxy.engine.binding import Model
from proxy.engine.splice import ReplyMemory, aligned_replies, tokenize_spliced

log = logging.getLogger(__name__)


class Tokenizer:
    def __init__(self, model: Model, counters: collections.Counter[str],
                 replies: ReplyMemory | None) -> None:
        self.model = model
        self.counters = counters
        self.replies = replies

    def tokenize(self, text: str) -> list[int]:
        return self.model.tokenize(text, add_special=False, parse_special=True)

    def tokenize_prompt(self, text: str, tenant: str = "") -> list[int]:
        if self.replies is None:
            return self.tokenize(text)
        ids, n = tokenize_spliced(text, self.tokenize, self.replies.recent(tenant))
        if n:
            self.counters["replies_spliced"] += n
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
