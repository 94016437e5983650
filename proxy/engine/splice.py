"""Splicing generated token ids back into a rendered prompt (``cache.splice_generated``).

A client sends the model's reply back as text. Tokenizing that text can give other
ids than the ones the model generated (BPE merges whitespace, code and JSON
differently from how a model emits them), and then the end-of-reply state cannot
match. With splicing on, the engine remembers the ids of its recent replies; where
a reply's exact text appears in a new prompt, its generated ids stand in for the
re-tokenized text, so the prompt is token for token what the model saw.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIN_REPLY_CHARS = 8  # shorter texts could match by accident anywhere


@dataclass(slots=True, frozen=True)
class Reply:
    text: str
    ids: tuple[int, ...]  # decode exactly to ``text``


def _span_ids(ids: Sequence[int], offsets: Sequence[int], b0: int, b1: int
              ) -> tuple[int, ...] | None:
    """The ids covering bytes [b0, b1) exactly; None where a token straddles an edge."""
    try:
        k0, k1 = offsets.index(b0), offsets.index(b1)
    except ValueError:
        return None
    return tuple(ids[k0:k1])


def aligned_replies(ids: Sequence[int], pieces: Sequence[bytes], special: Sequence[bool]
                    ) -> list[Reply]:
    """Texts a client may send back from one reply, each with the generated ids that
    decode to exactly it: every run of ordinary tokens between special tokens (reasoning
    and content come back as separate fields), as generated and with whitespace
    stripped (templates strip), where token boundaries allow."""
    out: dict[str, Reply] = {}
    run: list[int] = []
    for k in range(len(ids) + 1):
        if k < len(ids) and not special[k]:
            run.append(k)
            continue
        if run:
            r_ids = [ids[i] for i in run]
            raw = b"".join(pieces[i] for i in run)
            offsets = [0]
            for i in run:
                offsets.append(offsets[-1] + len(pieces[i]))
            text = raw.decode("utf-8", "replace")
            # byte spans from the ends: a reply cut inside a character was streamed with
            # U+FFFD for its bytes, so the text's own length in bytes is not the ids'
            lead = len(text[: len(text) - len(text.lstrip())].encode())
            tail = len(raw) - len(text[len(text.rstrip()):].encode())
            variants = ((text, 0, len(raw)), (text.rstrip(), 0, tail),
                        (text.strip(), lead, tail))
            for variant, b0, b1 in variants:
                if len(variant) < MIN_REPLY_CHARS or variant in out or b1 < b0:
                    continue
                got = _span_ids(r_ids, offsets, b0, b1)
                if got is not None:
                    out[variant] = Reply(variant, got)
            run = []
    return list(out.values())


class ReplyMemory:
    """The last few replies per tenant (written by the engine thread, read by HTTP)."""

    def __init__(self, size: int) -> None:
        self._lock = threading.Lock()
        self._by_tenant: dict[str, collections.deque[Reply]] = {}
        self._size = size

    def remember(self, tenant: str, replies: list[Reply]) -> None:
        with self._lock:
            dq = self._by_tenant.setdefault(tenant, collections.deque(maxlen=self._size))
            dq.extend(replies)

    def recent(self, tenant: str) -> list[Reply]:
        with self._lock:
            return list(self._by_tenant.get(tenant, ()))


def tokenize_spliced(text: str, tokenize: Callable[[str], list[int]],
                     replies: Sequence[Reply]) -> tuple[list[int], int]:
    """Tokenize ``text`` with known replies spliced in; returns (ids, replies spliced)."""
    spans: list[tuple[int, int, Reply]] = []
    for reply in sorted(replies, key=lambda r: len(r.text), reverse=True):
        start = text.rfind(reply.text)
        while start >= 0:
            end = start + len(reply.text)
            if all(end <= s or start >= e for s, e, _ in spans):
                spans.append((start, end, reply))
                break
            start = text.rfind(reply.text, 0, start)
    if not spans:
        return tokenize(text), 0
    spans.sort(key=lambda s: s[0])
    ids: list[int] = []
    pos = 0
    for start, end, reply in spans:
        if start > pos:
            ids += tokenize(text[pos:start])
        ids += reply.ids
        pos = end
    if pos < len(text):
        ids += tokenize(text[pos:])
    return ids, len(spans)
