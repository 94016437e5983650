"""Sequence states written the way llama.cpp's state writer lays them out (docs/design.md,
"The layout of a sequence state"), for the storage tests that need real pages without a
model: the state of one conversation after ``n`` tokens, whose KV rows depend on the
position only (a live lane's bytes), plus a recurrent tail of its own per ``n``."""

from __future__ import annotations

import hashlib
import struct

from statecache.kvpages import SEQ_MAGIC

LAYERS = 2
ROW = 24  # bytes of a K row and of a V row


def _row(conv: int, layer: int, pos: int) -> bytes:
    seed = struct.pack("<iii", conv, layer, pos)
    return hashlib.blake2b(seed, digest_size=ROW).digest()


def conversation_state(n: int, *, conv: int = 0, lane: int = 0, tail: int = 64,
                       shared: int = 0, base: int = 0) -> bytes:
    """The FULL state of conversation ``conv`` after ``n`` tokens, saved from ``lane``
    (one KV section: a plain attention cache with one stream, then a recurrent part);
    its first ``shared`` positions hold conversation ``base``'s rows (a conversation
    that began with the same tokens)."""
    out = [struct.pack("<Ii", SEQ_MAGIC, lane), struct.pack("<II", 1, n)]
    out += [struct.pack("<iIi", p, 1, lane) for p in range(n)]
    out.append(struct.pack("<II", 0, LAYERS))
    for kind in (0, 1):  # K rows, then V rows
        for layer in range(LAYERS):
            out.append(struct.pack("<iQ", 1, ROW))
            out += [_row(base if p < shared else conv, 2 * layer + kind, p)
                    for p in range(n)]
    out.append(hashlib.blake2b(struct.pack("<ii", conv, n), digest_size=tail).digest()
               if tail else b"")
    return b"".join(out)


def page_bytes(page_size: int) -> int:
    """What one page of KV holds: K and V rows of every layer for its tokens."""
    return 2 * LAYERS * ROW * page_size
