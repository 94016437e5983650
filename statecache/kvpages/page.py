"""A KV page: its name and its bytes.

A page is named by its content: ``page_key`` hashes the page's chained token hash, its
KV section and its bytes, so one page is stored once for every checkpoint that holds
it, and a page computed twice in another batch schedule (other bytes, docs/design.md
fact 10) is another page, never a wrong one.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NewType

import xxhash

from statecache.buffers import Buffer
from statecache.pages import HASH_BYTES, PageHash

PageKey = NewType("PageKey", bytes)
# A page as one buffer, or as its parts (one per block of its stream, in order: views
# into the state it was cut from, which they keep alive).
PageData = Buffer | tuple[memoryview, ...]


def page_key(chain_hash: PageHash, section: int, parts: Sequence[Buffer]) -> PageKey:
    """The name of one page of KV: its token hash (tokens, positions, prefix, model,
    tenant), its KV section and its bytes."""
    h = xxhash.xxh3_128(chain_hash)
    h.update(struct.pack("<I", section))
    for part in parts:
        h.update(part)
    return PageKey(h.digest())


def page_nbytes(page: PageData) -> int:
    if isinstance(page, tuple):
        return sum(p.nbytes for p in page)
    return memoryview(page).nbytes


def page_bytes(page: PageData) -> Buffer:
    """A page as one buffer (its parts joined: a copy)."""
    return b"".join(page) if isinstance(page, tuple) else page


def key_bytes(keys: Sequence[PageKey]) -> bytes:
    """Keys packed end to end (what a record keeps: one object, not one per page)."""
    return b"".join(keys)


def unpack_keys(raw: bytes) -> tuple[PageKey, ...]:
    if len(raw) % HASH_BYTES:
        raise ValueError("packed page keys of the wrong length")
    return tuple(PageKey(raw[i:i + HASH_BYTES]) for i in range(0, len(raw), HASH_BYTES))
