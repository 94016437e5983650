"""How a checkpoint is laid out in Redis/Valkey, as free functions (no client needed).

One entry ``id`` (the record id: fingerprint, tenant, kind, state format and tokens)
is a header value, its rest (``statecache.kvpages``) cut into chunks, and the KV pages
it names, each a key of its own that every entry naming it shares. Every key is in the
space of the secret key that signs it (``<space>`` is ``<prefix>:v3:<key id>``, the key
id 16 hex digits), so what another key signed is never even looked at, and cannot hold
a name ours needs::

    <space>:e:{<id>}                    header: magic, version, key id, metadata, meta tag
    <space>:e:{<id>}:<nonce>:<i>        chunk i of the stored rest (chunk_size bytes, the
                                        last less)
    <space>:p:<model>:<page key>        a KV page (statecache.formats.pagefmt), <model>
                                        derived from the fingerprint
    <space>:i:<state_format>:<hash>     index: a hash of entry id -> (n, nbytes, stored,
                                        nonce, chunking, tail) for each entry whose last
                                        whole page has this page hash; ``tail`` hashes
                                        its tokens past that page, so a probe passes over
                                        entries of other tokens without fetching them

``{<id>}`` is a cluster hash tag: an entry's header and chunks live on one node. The
metadata holds the disk tier's record metadata (tokens, fingerprint, tenant, state
format, page keys: checked like a disk file's), the codec and chunking of the rest, the
writer's nonce and ``data_tag``, an HMAC of the stored rest; the meta tag is an HMAC of
header and metadata; each page carries its own MAC, which names it. All under the
shared secret key, so an entry another key signed, an older format, a torn write
(chunks of another nonce), a missing or edited page or an edit is a miss, never a
state. The first writer of an id wins (``SET NX``); a second writer's chunks carry its
own nonce and are deleted. Entries of versions 1 and 2 (keys without ``v3``) are never
read.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import xxhash

from statecache.buffers import Buffer
from statecache.formats import codec
from statecache.formats.diskfmt import (
    KEY_BYTES,
    MAX_META_BYTES,
    BadFile,
    decode_meta,
    encode_meta,
    key_id,
    record_from_meta,
)
from statecache.formats.header import Refused, check_header
from statecache.kvpages import PageKey
from statecache.pages import PageHash
from statecache.records import CheckpointRecord

MAGIC = b"SCRM"
VERSION = 3
NS = "v3"  # in every key: entries of another layout are never even looked at
HEAD = struct.Struct("<4sH8sI")  # magic, version, key id, meta length
TAG_BYTES = 32
MAX_HEADER_BYTES = HEAD.size + MAX_META_BYTES + 4096 + TAG_BYTES
MAX_CHUNK = 64 << 20
NONCE_BYTES = 8
# n, nbytes, stored, nonce, chunk_size, chunks, tail (xxh3_64 of the tokens past the page)
INDEX_VALUE = struct.Struct("<QQQ8sIIQ")
_DATA_TAG = b"statecache remote data v3"
_META = {"record": bytes, "nonce": bytes, "chunk_size": int, "chunks": int,
         "data_tag": bytes, "codec": int, "stored": int}


class BadEntry(Refused):
    """A stored entry that must never be served; the message says why (a metric label)."""


@dataclass(slots=True, frozen=True)
class IndexValue:
    """What the index says of an entry: enough to fetch it in one round trip."""

    n: int
    nbytes: int  # the whole state
    stored: int  # its rest as stored
    nonce: bytes
    chunk_size: int
    chunks: int
    tail: int  # tail_hash of its tokens

    def pack(self) -> bytes:
        return INDEX_VALUE.pack(self.n, self.nbytes, self.stored, self.nonce, self.chunk_size,
                                self.chunks, self.tail)

    @staticmethod
    def unpack(raw: object, max_entry: int) -> IndexValue:
        if not isinstance(raw, bytes) or len(raw) != INDEX_VALUE.size:
            raise BadEntry("index", "malformed index value")
        v = IndexValue(*INDEX_VALUE.unpack(raw))
        if not (0 < v.chunk_size <= MAX_CHUNK) or v.chunks != n_chunks(v.stored, v.chunk_size):
            raise BadEntry("index", "chunking out of range")
        if not 0 < v.nbytes <= max_entry or v.n < 1:
            raise BadEntry("too_big" if v.nbytes > max_entry else "index", f"{v.nbytes} bytes")
        return v


def tail_hash(tokens: Buffer, n: int, page_size: int) -> int:
    """What tells apart the entries one index key holds: an xxh3_64 of ``tokens[w:n]``
    (int32, little-endian), ``w`` the end of the last whole page within ``n``. A filter,
    not a proof: the header's tokens are."""
    view = memoryview(tokens).cast("B")
    return xxhash.xxh3_64_intdigest(view[4 * (n // page_size * page_size):4 * n])


def n_chunks(nbytes: int, chunk_size: int) -> int:
    return max(1, -(-nbytes // chunk_size))


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def space(prefix: str, key: bytes) -> str:
    """The part of every key name this secret ``key`` signs: ``<prefix>:v3:<key id>``."""
    return f"{prefix}:{NS}:{key_id(key).hex()}"


def header_key(space: str, entry_id: str) -> str:
    return f"{space}:e:{{{entry_id}}}"


def chunk_key(space: str, entry_id: str, nonce: bytes, i: int) -> str:
    return f"{space}:e:{{{entry_id}}}:{nonce.hex()}:{i}"


def index_key(space: str, state_format: int, page_hash: PageHash) -> str:
    return f"{space}:i:{state_format}:{page_hash.hex()}"


def model_tag(fingerprint: str) -> str:
    """The short name of a model in page keys (as in the disk tier's page directory)."""
    return xxhash.xxh3_64_hexdigest(fingerprint.encode())


def page_prefix(space: str, fingerprint: str) -> str:
    return f"{space}:p:{model_tag(fingerprint)}:"


def page_name(space: str, fingerprint: str, key: PageKey) -> str:
    return page_prefix(space, fingerprint) + key.hex()


def header_pattern(prefix: str) -> str:
    """The headers of every key's space (a listing, ``statecache inspect --remote``)."""
    return f"{prefix}:{NS}:*:e:{{*}}"


def page_pattern(prefix: str) -> str:
    return f"{prefix}:{NS}:*:p:*"


def id_from_header_key(prefix: str, key: bytes | str) -> tuple[str, str] | None:
    """The space and entry id a header key names (None: not a header of ``prefix``)."""
    k = key.decode() if isinstance(key, bytes) else key
    head = f"{prefix}:{NS}:"
    kid, _, rest = k[len(head):].partition(":e:{")
    if k.startswith(head) and len(kid) == 16 and rest.endswith("}") and len(rest) == 33:
        return k[:len(head) + 16], rest[:-1]
    return None


def _data_mac(key: bytes, entry_id: str, nonce: bytes) -> hmac.HMAC:
    if len(key) != KEY_BYTES:
        raise ValueError(f"a checkpoint key has {KEY_BYTES} bytes, got {len(key)}")
    mac = hmac.new(key, digestmod=hashlib.sha256)
    mac.update(_DATA_TAG + entry_id.encode() + nonce)
    return mac


def encode_header(rec: CheckpointRecord, stored: memoryview, key: bytes, nonce: bytes,
                  chunk_size: int, kind: int) -> bytes:
    """The header value of ``rec``: its metadata, the codec and chunking of its stored
    rest and the HMAC of that."""
    mac = _data_mac(key, rec.id, nonce)
    mac.update(stored)
    meta = msgpack.packb({
        "record": encode_meta(rec), "nonce": nonce, "chunk_size": chunk_size,
        "chunks": n_chunks(stored.nbytes, chunk_size), "data_tag": mac.digest(),
        "codec": kind, "stored": stored.nbytes,
    }, use_bin_type=True)
    head = HEAD.pack(MAGIC, VERSION, key_id(key), len(meta))
    tag = hmac.new(key, head + meta, hashlib.sha256).digest()
    return head + meta + tag


@dataclass(slots=True, frozen=True)
class Header:
    record: CheckpointRecord
    nonce: bytes
    chunk_size: int
    chunks: int
    data_tag: bytes
    codec: int
    stored: int


def _head(raw: bytes, key: bytes | None) -> tuple[bytes, int]:
    """A header value's key id and metadata length, its magic, version, key id (with
    ``key``) and length checked; raises BadEntry."""
    if len(raw) < HEAD.size + TAG_BYTES:
        raise BadEntry("corrupt", "header truncated")
    magic, version, kid, meta_len = HEAD.unpack_from(raw)
    check_header(BadEntry, "entry", (magic, version, kid), (MAGIC, VERSION), key)
    if len(raw) != HEAD.size + meta_len + TAG_BYTES:
        raise BadEntry("corrupt", "header length disagrees with its value")
    return kid, meta_len


def _unpack_meta(raw: bytes) -> dict[str, Any]:
    try:
        meta = msgpack.unpackb(raw, raw=False, strict_map_key=True, max_bin_len=MAX_META_BYTES,
                               max_str_len=1 << 10, max_array_len=0, max_map_len=len(_META),
                               max_ext_len=0)
    except Exception as e:  # msgpack raises many types for malformed input
        raise BadEntry("corrupt", f"unparseable metadata ({type(e).__name__})") from None
    if not isinstance(meta, dict) or set(meta) != set(_META):
        raise BadEntry("corrupt", "metadata has the wrong set of keys")
    for k, t in _META.items():
        if isinstance(meta[k], bool) or not isinstance(meta[k], t):
            raise BadEntry("corrupt", f"metadata {k} has the wrong type")
    return meta


@dataclass(slots=True, frozen=True)
class Unchecked:
    """What a header says, its MAC unchecked (``statecache inspect`` and ``purge``)."""

    meta: dict[str, Any]  # the record metadata (diskfmt.decode_meta)
    key_id: bytes
    nonce: bytes
    chunks: int


def read_unchecked(raw: object) -> Unchecked:
    """A header's metadata without its key: never serve from it. Raises BadEntry."""
    if not isinstance(raw, bytes):
        raise BadEntry("corrupt", "header truncated")
    kid, meta_len = _head(raw, None)
    meta = _unpack_meta(raw[HEAD.size:HEAD.size + meta_len])
    try:
        rec_meta = decode_meta(meta["record"])
    except BadFile as e:
        raise BadEntry("corrupt", str(e)) from None
    return Unchecked(rec_meta, kid, meta["nonce"], meta["chunks"])


def decode_header(raw: object, key: bytes, page_size: int) -> Header:
    """Check a header value under ``key``; raises BadEntry with the reason."""
    if not isinstance(raw, bytes) or not raw:
        raise BadEntry("missing" if raw in (None, b"") else "corrupt", "header truncated")
    if len(raw) > MAX_HEADER_BYTES:
        raise BadEntry("corrupt", "header too long")
    _, meta_len = _head(raw, key)
    body, tag = raw[:HEAD.size + meta_len], raw[HEAD.size + meta_len:]
    if not hmac.compare_digest(hmac.new(key, body, hashlib.sha256).digest(), tag):
        raise BadEntry("forged", "metadata MAC mismatch")
    meta = _unpack_meta(body[HEAD.size:])
    try:
        rec = record_from_meta(decode_meta(meta["record"]), page_size)
    except BadFile as e:
        raise BadEntry("corrupt", str(e)) from None
    chunk_size, chunks, stored = meta["chunk_size"], meta["chunks"], meta["stored"]
    if not 0 < chunk_size <= MAX_CHUNK or chunks != n_chunks(stored, chunk_size):
        raise BadEntry("corrupt", "chunking out of range")
    if meta["codec"] not in codec.CODECS or not 0 < stored <= rec.rest_nbytes or (
            meta["codec"] == codec.RAW and stored != rec.rest_nbytes):
        raise BadEntry("corrupt", "codec or stored length out of range")
    if len(meta["nonce"]) != NONCE_BYTES or len(meta["data_tag"]) != TAG_BYTES:
        raise BadEntry("corrupt", "nonce or tag of the wrong size")
    return Header(rec, meta["nonce"], chunk_size, chunks, meta["data_tag"], meta["codec"],
                  stored)


def join_rest(header: Header, chunks: list[object], key: bytes) -> Buffer:
    """The rest from ``chunks``, each checked for its length, all for the MAC, then
    decoded."""
    rec = header.record
    if len(chunks) != header.chunks:
        raise BadEntry("corrupt", "chunk count")
    data = bytearray(header.stored)
    mac = _data_mac(key, rec.id, header.nonce)
    at = 0
    for i, part in enumerate(chunks):
        want = min(header.chunk_size, header.stored - at)
        if not isinstance(part, bytes) or len(part) != want:
            got = len(part) if isinstance(part, bytes) else 0
            raise BadEntry("missing" if not got else "corrupt",
                           f"chunk {i} has {got} bytes, expected {want}")
        data[at:at + want] = part
        mac.update(part)
        at += want
    if not hmac.compare_digest(mac.digest(), header.data_tag):
        raise BadEntry("corrupt", "state MAC mismatch")
    try:
        return codec.decode(header.codec, data, rec.rest_nbytes)
    except codec.BadCodec as e:
        raise BadEntry("corrupt", str(e)) from None


def chunk_views(data: memoryview, chunk_size: int) -> list[memoryview]:
    return [data[i:i + chunk_size] for i in range(0, max(len(data), 1), chunk_size)]
