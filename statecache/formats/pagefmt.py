"""One KV page as stored on disk and in the shared store, as free functions.

Layout: header | stored bytes | tag. Header: magic b"SCPG", version u16, codec u16,
raw length u32, stored length u32, key id (8 bytes), the page key (16 bytes). The tag
is HMAC-SHA256 under the secret key over header and stored bytes, so a page proves its
own name: a page renamed, edited, truncated or signed with another key is refused
before a byte of it is decoded. The record that names a page is authenticated on its
own (its MAC covers the list of its page keys).
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Callable

from statecache.buffers import Buffer
from statecache.formats import codec
from statecache.formats.diskfmt import KEY_BYTES, key_id
from statecache.formats.header import Refused, check_header
from statecache.kvpages import PageKey
from statecache.pages import HASH_BYTES

MAGIC = b"SCPG"
VERSION = 1
HEAD = struct.Struct("<4sHHII8s16s")
TAG_BYTES = 32
MAX_PAGE = 1 << 30


class BadPage(Refused):
    """A stored page that must never be used; ``reason`` is a metric label."""


def _mac(key: bytes) -> hmac.HMAC:
    if len(key) != KEY_BYTES:
        raise ValueError(f"a checkpoint key has {KEY_BYTES} bytes, got {len(key)}")
    return hmac.new(key, digestmod=hashlib.sha256)


def encode_page(secret: bytes, page: PageKey, raw: Buffer,
                encode: Callable[[Buffer], tuple[int, Buffer]] | None = None) -> list[Buffer]:
    """The stored form of ``raw`` in pieces to write one after the other (``encode``:
    how; by default zstd over 2-byte planes where it pays)."""
    kind, stored = encode(raw) if encode is not None else codec.compress(raw, width=2)
    head = HEAD.pack(MAGIC, VERSION, kind, memoryview(raw).nbytes, memoryview(stored).nbytes,
                     key_id(secret), page)
    mac = _mac(secret)
    mac.update(head)
    mac.update(stored)
    return [head, stored, mac.digest()]


def stored_size(parts: list[Buffer]) -> int:
    return sum(memoryview(p).nbytes for p in parts)


def max_size(raw: int) -> int:
    """The most bytes a page of ``raw`` bytes takes stored (raw, when it does not shrink)."""
    return HEAD.size + raw + TAG_BYTES


def decode_page(secret: bytes, page: PageKey, blob: Buffer) -> Buffer:
    """The raw bytes of ``page`` from its stored form; raises BadPage."""
    view = memoryview(blob).cast("B")
    if view.nbytes < HEAD.size + TAG_BYTES:
        raise BadPage("missing" if view.nbytes == 0 else "corrupt", "page truncated")
    magic, version, kind, raw_len, stored_len, kid, name = HEAD.unpack_from(view)
    check_header(BadPage, "page", (magic, version, kid), (MAGIC, VERSION), secret)
    if len(name) != HASH_BYTES or name != page:
        raise BadPage("corrupt", "a page of another name")
    if raw_len > MAX_PAGE or HEAD.size + stored_len + TAG_BYTES != view.nbytes:
        raise BadPage("corrupt", "page lengths disagree with its size")
    mac = _mac(secret)
    mac.update(view[:HEAD.size + stored_len])
    if not hmac.compare_digest(mac.digest(), view[HEAD.size + stored_len:]):
        raise BadPage("forged", "page MAC mismatch")
    try:
        return codec.decode(kind, view[HEAD.size:HEAD.size + stored_len], raw_len)
    except codec.BadCodec as e:
        raise BadPage("corrupt", str(e)) from None
