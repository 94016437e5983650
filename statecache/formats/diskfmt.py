"""The checkpoint file format, as free functions (no model, no pool needed).

Layout: header | msgpack metadata | meta tag | stored rest | tag.
Header: magic b"SCKP", format version u16, codec u16 (``statecache.formats.codec``: how the rest
is stored), header/meta/data lengths, key id. The data is the state's rest
(``statecache.kvpages``); its KV pages are files of their own (``statecache.formats.pagefmt``),
named by the page keys the metadata lists.
Both tags are HMAC-SHA256 under the pool's secret key: the meta tag covers header and
metadata (checked at scan, without reading the state), the tag covers everything before
it. The metadata names the tokens, fingerprint, tenant and state format, so a file
proves which conversation its state belongs to; an unkeyed digest proved nothing, as
anyone who can write the directory can recompute it. Version 1 files (xxh3 digest, no
key) are never served, nor are version 2 files (a whole state per file: read as a miss
and quarantined like any file this version cannot trust).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import os
import re
import stat
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from statecache.buffers import Buffer
from statecache.formats import codec
from statecache.pages import HASH_BYTES
from statecache.records import CheckpointRecord, Kind, Owner, Record, Role, new_record

MAGIC = b"SCKP"
FORMAT_VERSION = 4
SUFFIX = ".ckpt"
TMP_PREFIX = ".tmp-"
# magic, version, flags, header_len, meta_len, data_len, key id
HEADER = struct.Struct("<4sHHIIQ8s")
_V1_HEADER_BYTES = struct.calcsize("<4sHHIIQ")  # enough to read any version's number
TAG_BYTES = 32  # HMAC-SHA256
KEY_BYTES = 32
MAX_META_BYTES = 16 << 20  # 4M tokens of context at most
MAX_DATA_BYTES = 1 << 40
_ID_RE = re.compile(r"^[0-9a-f]{32}$")
_CHUNK = 8 << 20
Encoder = Callable[[Buffer], tuple[int, Buffer]]  # (codec, stored bytes): codec.Packer.encode
_META_TYPES: dict[str, tuple[type, ...]] = {
    "id": (str,),
    "kind": (str,),
    "owner": (str,),
    "lane": (int, type(None)),
    "n": (int,),
    "tokens": (bytes,),
    "fingerprint": (str,),
    "tenant": (str,),
    "state_format": (int,),
    "nbytes": (int,),
    "created": (float, int),
    "role": (str,),
    "preview": (str,),
    "keys": (bytes,),
    "rest": (int,),
    "sizes": (bytes,),
}
SIZE = struct.Struct("<I")  # a page file's size, as the record that names it says


class BadFile(Exception):
    """A checkpoint file that must never be served; the message says why."""


@dataclass(slots=True, frozen=True)
class FileMeta:
    """What a file's header and metadata say, before its digest is checked."""

    path: Path
    meta: dict[str, Any]
    file_size: int
    data_len: int  # the rest as stored
    mtime: float
    key_id: bytes
    codec: int = codec.RAW

    @property
    def id(self) -> str:
        return str(self.meta["id"])


def valid_id(entry_id: str) -> bool:
    return _ID_RE.match(entry_id) is not None


def file_name(entry_id: str) -> str:
    if not valid_id(entry_id):
        raise ValueError(f"not a checkpoint id: {entry_id!r}")
    return entry_id + SUFFIX


def encode_meta(rec: CheckpointRecord, sizes: bytes = b"") -> bytes:
    """``rec``'s metadata; ``sizes``: the size of each of its page files, packed (SIZE),
    as the disk tier writes them (a remote entry's pages carry none)."""
    meta = {
        "id": rec.id,
        "kind": rec.kind.value,
        "owner": rec.owner.value,
        "lane": rec.lane,
        "n": rec.n,
        "tokens": rec.tokens,
        "fingerprint": rec.fingerprint,
        "tenant": rec.tenant,
        "state_format": rec.state_format,
        "nbytes": rec.nbytes,
        "created": float(rec.created),
        "role": rec.role.value,
        "preview": rec.preview,
        "keys": rec.keys,
        "rest": rec.rest_nbytes,
        "sizes": sizes,
    }
    return bytes(msgpack.packb(meta, use_bin_type=True))


def decode_meta(raw: bytes) -> dict[str, Any]:
    try:
        meta = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_bin_len=MAX_META_BYTES,
            max_str_len=1 << 16,
            max_array_len=0,
            max_map_len=len(_META_TYPES),
            max_ext_len=0,
        )
    except Exception as e:  # msgpack raises many types for malformed input
        raise BadFile(f"unparseable metadata ({type(e).__name__})") from None
    if not isinstance(meta, dict) or set(meta) != set(_META_TYPES):
        raise BadFile("metadata has the wrong set of keys")
    for key, types in _META_TYPES.items():
        value = meta[key]
        if isinstance(value, bool) or not isinstance(value, types):
            raise BadFile(f"metadata {key}: wrong type {type(value).__name__}")
    if len(meta["tokens"]) != 4 * meta["n"]:
        raise BadFile("metadata n disagrees with its tokens")
    if len(meta["keys"]) % HASH_BYTES or not 0 < meta["rest"] <= MAX_DATA_BYTES:
        raise BadFile("metadata page keys or rest length out of range")
    if len(meta["sizes"]) not in (0, len(meta["keys"]) // HASH_BYTES * SIZE.size):
        raise BadFile("metadata page sizes disagree with its page keys")
    return meta


def pack_sizes(sizes: Sequence[int]) -> bytes:
    return b"".join(SIZE.pack(n) for n in sizes)


def page_sizes(meta: dict[str, Any]) -> tuple[int, ...]:
    """The size of each page file a record's metadata names (none: it says none)."""
    return tuple(n for (n,) in SIZE.iter_unpack(meta["sizes"]))


def record_from_meta(meta: dict[str, Any], page_size: int) -> CheckpointRecord:
    """Rebuild the record; its id is recomputed, so a renamed or edited file is rejected."""
    try:
        rec = new_record(
            kind=Kind(meta["kind"]),
            owner=Owner(meta["owner"]),
            lane=meta["lane"],
            tokens=np.frombuffer(meta["tokens"], dtype="<i4"),
            fingerprint=meta["fingerprint"],
            tenant=meta["tenant"],
            state_format=meta["state_format"],
            nbytes=meta["nbytes"],
            role=Role(meta["role"]),
            created=float(meta["created"]),
            page_size=page_size,
            preview=meta["preview"],
            keys=meta["keys"],
            rest_nbytes=meta["rest"],
        )
    except ValueError as e:
        raise BadFile(f"metadata does not describe a checkpoint: {e}") from None
    if rec.id != meta["id"]:
        raise BadFile("metadata id does not match its content")
    return rec


def same_claims(found: CheckpointRecord, rec: Record, keys: bytes) -> bool:
    """The record rebuilt from a file's authenticated metadata (its id recomputed from its
    content) says exactly what the indexed one says, and names the pages ``keys``."""
    return (
        found.id == rec.id
        and found.n == rec.n
        and (not isinstance(rec, CheckpointRecord) or found.tokens == rec.tokens)
        and found.fingerprint == rec.fingerprint
        and found.tenant == rec.tenant
        and found.state_format == rec.state_format
        and found.kind is rec.kind
        and found.owner is rec.owner
        and found.lane == rec.lane
        and found.nbytes == rec.nbytes
        and found.keys == keys
        and found.rest_nbytes == rec.rest_nbytes
    )


@functools.lru_cache(maxsize=8)
def key_id(key: bytes) -> bytes:
    """8 bytes naming ``key`` (a MAC of a constant): tells "another key" from "forged".
    Remembered for the few keys a process holds: a restore checks it for every page."""
    return hmac.new(key, b"statecache key id", hashlib.sha256).digest()[:8]


def _mac(key: bytes) -> hmac.HMAC:
    if len(key) != KEY_BYTES:
        raise ValueError(f"a checkpoint key has {KEY_BYTES} bytes, got {len(key)}")
    return hmac.new(key, digestmod=hashlib.sha256)


def file_size(rec: CheckpointRecord) -> int:
    """The most bytes the file of ``rec`` takes on disk (what the disk tier reserves; a
    compressed rest takes less)."""
    meta = encode_meta(rec, bytes(SIZE.size * rec.n_keys))
    return HEADER.size + len(meta) + TAG_BYTES + rec.rest_nbytes + TAG_BYTES


def _read_exact(fd: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.read(fd, min(n - len(out), _CHUNK))
        if not chunk:
            raise BadFile("truncated")
        out += chunk
    return bytes(out)


def open_regular(path: Path | str) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        if e.errno in (getattr(os, "ELOOP", -1), 40):
            raise BadFile("symlink") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise BadFile("not a regular file")
    return fd, st


def _read_head(
    fd: int, st: os.stat_result, path: Path, key: bytes | None
) -> tuple[FileMeta, hmac.HMAC | None]:
    """Header and metadata; with ``key``, the key id and the meta tag are checked and the
    running MAC (over everything up to the state bytes) is returned."""
    if st.st_size < _V1_HEADER_BYTES:
        raise BadFile("truncated" if st.st_size else "zero length")
    head = _read_exact(fd, _V1_HEADER_BYTES)
    magic, version = struct.unpack_from("<4sH", head)
    if magic != MAGIC:
        raise BadFile("wrong magic")
    if version != FORMAT_VERSION:
        old = " (unauthenticated, from an older statecache)" if version == 1 else ""
        raise BadFile(f"format version {version}, expected {FORMAT_VERSION}{old}")
    if st.st_size < HEADER.size + 2 * TAG_BYTES:
        raise BadFile("truncated")
    head += _read_exact(fd, HEADER.size - _V1_HEADER_BYTES)
    _, _, kind, header_len, meta_len, data_len, kid = HEADER.unpack(head)
    if kind not in codec.CODECS:
        raise BadFile(f"unknown codec {kind}")
    if header_len != HEADER.size or meta_len > MAX_META_BYTES or data_len > MAX_DATA_BYTES:
        raise BadFile("length field out of range")
    if header_len + meta_len + data_len + 2 * TAG_BYTES != st.st_size:
        raise BadFile(f"lengths disagree with the file size {st.st_size}")
    raw_meta = _read_exact(fd, meta_len)
    meta_tag = _read_exact(fd, TAG_BYTES)
    mac: hmac.HMAC | None = None
    if key is not None:
        if kid != key_id(key):
            raise BadFile("written with another key")
        mac = _mac(key)
        mac.update(head)
        mac.update(raw_meta)
        if not hmac.compare_digest(mac.copy().digest(), meta_tag):
            raise BadFile("metadata MAC mismatch (forged or edited)")
        mac.update(meta_tag)
    meta = decode_meta(raw_meta)
    if data_len > meta["rest"] or (kind == codec.RAW and data_len != meta["rest"]):
        raise BadFile("metadata rest length disagrees with the data length")
    return FileMeta(path, meta, st.st_size, data_len, st.st_mtime, kid, kind), mac


def read_meta(path: Path, key: bytes | None = None) -> FileMeta:
    """Header and metadata, no state bytes read; with ``key`` their MAC is checked too.

    Without a key (``statecache inspect``) nothing is authenticated: never serve from it.
    Raises BadFile.
    """
    fd, st = open_regular(path)
    try:
        return _read_head(fd, st, path, key)[0]
    finally:
        os.close(fd)


def read_checkpoint(path: Path, key: bytes) -> tuple[FileMeta, Buffer]:
    """Header, metadata and the rest (decoded), every byte authenticated before it is
    decoded; raises BadFile."""
    fd, st = open_regular(path)
    try:
        fm, mac = _read_head(fd, st, path, key)
        assert mac is not None
        data = bytearray(fm.data_len)
        view = memoryview(data)
        got = 0
        while got < fm.data_len:
            k = os.readv(fd, [view[got : got + _CHUNK]])
            if k == 0:
                raise BadFile("truncated")
            mac.update(view[got : got + k])
            got += k
        if not hmac.compare_digest(_read_exact(fd, TAG_BYTES), mac.digest()):
            raise BadFile("MAC mismatch (forged or corrupt)")
    finally:
        os.close(fd)
    try:
        return fm, codec.decode(fm.codec, data, fm.meta["rest"])
    except codec.BadCodec as e:
        raise BadFile(f"the rest does not decode: {e}") from None


def _write_all(fd: int, buf: Buffer) -> None:
    view = memoryview(buf).cast("B")
    while view:
        k = os.write(fd, view[:_CHUNK])
        view = view[k:]


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(directory: Path, name: str, parts: list[Buffer], *,
                 sync_dir: bool = True) -> int:
    """Write ``parts`` as ``directory/name`` atomically (temp file, fdatasync, rename,
    fsync of the directory unless the caller does it once for many); returns the size."""
    final = directory / name
    tmp = directory / f"{TMP_PREFIX}{name}-{os.getpid()}-{os.urandom(4).hex()}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(tmp, flags, 0o600)
    size = 0
    try:
        for part in parts:
            _write_all(fd, part)
            size += memoryview(part).nbytes
        (os.fdatasync if hasattr(os, "fdatasync") else os.fsync)(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.close(fd)
    os.replace(tmp, final)
    if sync_dir:
        fsync_dir(directory)
    return size


def write_checkpoint(directory: Path, rec: CheckpointRecord, rest: Buffer, key: bytes,
                     encode: Encoder | None = None, sizes: Sequence[int] | None = None) -> int:
    """Write the record and its rest atomically (``encode``: how the rest is stored;
    by default zstd over 4-byte planes where it pays; ``sizes``: its page files', which
    the disk tier's scan holds them to: none, a record it refuses); returns the file size."""
    rest = memoryview(rest).cast("B")
    if rest.nbytes != rec.rest_nbytes:
        raise ValueError(f"{rec.id}: a rest of {rest.nbytes} bytes, record says "
                         f"{rec.rest_nbytes}")
    kind, stored = encode(rest) if encode is not None else codec.compress(rest, width=4)
    stored_len = memoryview(stored).nbytes
    raw_meta = encode_meta(rec, pack_sizes(sizes or ()))
    head = HEADER.pack(
        MAGIC, FORMAT_VERSION, kind, HEADER.size, len(raw_meta), stored_len, key_id(key)
    )
    mac = _mac(key)
    mac.update(head)
    mac.update(raw_meta)
    meta_tag = mac.copy().digest()
    mac.update(meta_tag)
    mac.update(stored)
    return write_atomic(directory, file_name(rec.id),
                        [head, raw_meta, meta_tag, stored, mac.digest()])
