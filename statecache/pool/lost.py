"""Checkpoints dropped because a page they need went missing or failed its check: one
warning naming the page and how many it took, a count by reason, and a bounded memory
of their heads, so that the next request that would have used one is told why it
missed (``/admin/misses``: "page missing", "page refused") rather than "evicted".
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence

from statecache.pages import TokenArray
from statecache.records import RecordHead

log = logging.getLogger(__name__)

MAX_LOST = 256  # heads remembered; a head is a few hundred bytes, a lookup hashes each
CAUSES = {"missing": "page missing", "refused": "page refused"}


class Lost:
    """The heads of dropped checkpoints, oldest out first (kept under the pool's lock)."""

    def __init__(self, limit: int = MAX_LOST) -> None:
        self.limit = limit
        self._heads: OrderedDict[str, tuple[RecordHead, str]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._heads)

    def note(self, where: str, page: str, reason: str, heads: Sequence[RecordHead],
             counts: dict[str, int], *, quiet: bool = False) -> None:
        """``heads`` were dropped because ``page`` (a name to log) went ``reason``
        ("missing", "refused"): one warning (``quiet``: at debug level), counted in
        ``counts`` by reason."""
        if not heads:
            return
        log.log(logging.DEBUG if quiet else logging.WARNING,
                "%s: page %s %s: %d checkpoint(s) dropped", where, page,
                "is missing" if reason == "missing" else "was refused", len(heads))
        counts[reason] = counts.get(reason, 0) + len(heads)
        for head in heads:
            self._heads[head.id] = (head, reason)
            self._heads.move_to_end(head.id)
        while len(self._heads) > self.limit:
            self._heads.popitem(last=False)

    def cause(self, tokens: TokenArray, tenant: str) -> str | None:
        """Why ``tokens`` (a prompt of ``tenant``) found no checkpoint where a dropped one
        would have served it, the deepest; that one is forgotten (told once)."""
        best: RecordHead | None = None
        why = ""
        for head, reason in self._heads.values():
            if head.tenant == tenant and (best is None or head.n > best.n) \
                    and head.matches(tokens):
                best, why = head, reason
        if best is None:
            return None
        del self._heads[best.id]
        return CAUSES.get(why, "page refused")
