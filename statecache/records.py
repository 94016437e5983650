"""Checkpoint records: what a saved state is, where it sits in the token stream."""

from __future__ import annotations

import enum
import struct
import sys
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from statecache.kvpages import PageKey, unpack_keys
from statecache.pages import (
    HASH_BYTES,
    PageChain,
    PageHash,
    TokenArray,
    Tokens,
    as_tokens,
    namespace_hash,
)


class Kind(enum.Enum):
    FULL = "full"  # whole sequence state; restores into any lane
    PARTIAL = "partial"  # recurrent/SWA part only; valid in its own lane


class Owner(enum.Enum):
    TARGET = "target"
    DRAFT = "draft"


class Role(enum.Enum):
    END_OF_REPLY = "end-of-reply"
    PERIODIC = "periodic"
    BRANCH = "branch"
    REPLAY = "replay"


PREVIEW_MAX = 80


def _field(part: bytes) -> bytes:
    return struct.pack("<Q", len(part)) + part


def record_id(
    fingerprint: str,
    tenant: str,
    kind: Kind,
    owner: Owner,
    lane: int | None,
    state_format: int,
    tokens: bytes,
) -> str:
    """32 hex chars derived from everything that makes two checkpoints interchangeable."""
    raw = b"".join(
        _field(p)
        for p in (
            fingerprint.encode(),
            tenant.encode(),
            kind.value.encode(),
            owner.value.encode(),
            b"" if lane is None else str(lane).encode(),
            str(state_format).encode(),
            tokens,
        )
    )
    return xxhash.xxh3_128_hexdigest(raw)


@dataclass(slots=True, frozen=True)
class CheckpointRecord:
    """The immutable description of one checkpoint (the state bytes live in a tier)."""

    id: str
    kind: Kind
    owner: Owner
    lane: int | None  # a lane for PARTIAL, None for FULL
    n: int  # the state has consumed tokens[0:n]
    tokens: bytes  # tokens[0:n] as little-endian int32
    page_hashes: tuple[PageHash, ...]  # hashes of the whole pages within n
    fingerprint: str
    tenant: str
    state_format: int
    nbytes: int  # size of the whole state (what llama.cpp reads back)
    created: float
    role: Role
    preview: str = ""
    # The state as stored (statecache.kvpages): its rest, of ``rest_nbytes`` bytes, and
    # the keys of its KV pages, packed end to end (16 bytes each; none: no pages).
    keys: bytes = b""
    rest_nbytes: int = 0

    @property
    def page_keys(self) -> tuple[PageKey, ...]:
        return unpack_keys(self.keys)

    @property
    def n_keys(self) -> int:
        return len(self.keys) // HASH_BYTES

    def token_array(self) -> TokenArray:
        """Read-only int32 view of tokens[0:n] (no copy)."""
        return np.frombuffer(self.tokens, dtype="<i4")

    @property
    def token_bytes(self) -> int:
        return len(self.tokens)

    @property
    def n_pages(self) -> int:
        return len(self.page_hashes)

    def matches(self, tokens: TokenArray) -> bool:
        """True when ``tokens`` starts with exactly this record's tokens."""
        return len(tokens) >= self.n and bool(np.array_equal(tokens[: self.n], self.token_array()))

    def head(self) -> RecordHead:
        """This record without its tokens, page hashes and page keys."""
        return RecordHead(
            id=self.id, kind=self.kind, owner=self.owner, lane=self.lane, n=self.n,
            fingerprint=sys.intern(self.fingerprint), tenant=sys.intern(self.tenant),
            state_format=self.state_format, nbytes=self.nbytes, created=self.created,
            role=self.role, preview=self.preview, n_pages=self.n_pages, n_keys=self.n_keys,
            rest_nbytes=self.rest_nbytes,
        )

    def to_json(self) -> dict[str, Any]:
        return _json(self)


@dataclass(slots=True, frozen=True)
class RecordHead:
    """What the pool keeps in memory of a checkpoint held on disk alone: its record less
    the parts that grow with its length (tokens, page hashes, page keys), which its
    record file holds (``statecache.tiers.disk`` reads them back, authenticated, on a hit).

    Its tokens are still known exactly enough to find it: the id hashes them with
    everything else that makes two checkpoints interchangeable (``record_id``, the
    identity the pool already merges equal inserts by), so a candidate is checked by
    hashing the request's tokens; the record file's own tokens are then compared with
    the request's before its state is used."""

    id: str
    kind: Kind
    owner: Owner
    lane: int | None
    n: int
    fingerprint: str
    tenant: str
    state_format: int
    nbytes: int
    created: float
    role: Role
    preview: str
    n_pages: int
    n_keys: int
    rest_nbytes: int

    def matches(self, tokens: TokenArray) -> bool:
        """True when ``tokens`` starts with tokens whose record id is this one's."""
        if len(tokens) < self.n:
            return False
        raw = as_tokens(tokens[: self.n]).tobytes()
        return record_id(self.fingerprint, self.tenant, self.kind, self.owner, self.lane,
                         self.state_format, raw) == self.id

    def to_json(self) -> dict[str, Any]:
        return _json(self)


# A record as the pool's index holds it: whole while its state is in memory, its head
# while the state is on disk alone.
Record = CheckpointRecord | RecordHead


def _json(rec: Record) -> dict[str, Any]:
    return {
        "id": rec.id,
        "kind": rec.kind.value,
        "owner": rec.owner.value,
        "lane": rec.lane,
        "n": rec.n,
        "pages": rec.n_pages,
        "fingerprint": rec.fingerprint,
        "tenant": rec.tenant,
        "state_format": rec.state_format,
        "nbytes": rec.nbytes,
        "kv_pages": rec.n_keys,
        "rest_nbytes": rec.rest_nbytes,
        "created": rec.created,
        "role": rec.role.value,
        "preview": rec.preview,
    }


def new_record(
    *,
    kind: Kind,
    owner: Owner,
    lane: int | None,
    tokens: Tokens,
    fingerprint: str,
    tenant: str,
    state_format: int,
    nbytes: int,
    role: Role,
    created: float,
    page_size: int,
    preview: str = "",
    keys: bytes = b"",
    rest_nbytes: int = 0,
) -> CheckpointRecord:
    """Build a record, checking the caller's arguments."""
    if kind is Kind.PARTIAL and (lane is None or lane < 0):
        raise ValueError(f"a partial checkpoint needs a lane >= 0, got {lane!r}")
    if kind is Kind.FULL and lane is not None:
        raise ValueError("a full checkpoint belongs to no lane: pass lane=None")
    arr = as_tokens(tokens)
    n = len(arr)
    if n < 1:
        raise ValueError("a checkpoint needs at least one consumed token")
    if nbytes < 1:
        raise ValueError("a checkpoint needs state bytes")
    if len(keys) % HASH_BYTES or rest_nbytes < 0:
        raise ValueError("page keys must be 16 bytes each and the rest not negative")
    raw = arr.tobytes()
    whole = n // page_size
    ns = namespace_hash(fingerprint, tenant)
    hashes = PageChain(ns, page_size, arr[: whole * page_size]).hashes
    return CheckpointRecord(
        id=record_id(fingerprint, tenant, kind, owner, lane, state_format, raw),
        kind=kind,
        owner=owner,
        lane=lane,
        n=n,
        tokens=raw,
        page_hashes=hashes,
        fingerprint=fingerprint,
        tenant=tenant,
        state_format=state_format,
        nbytes=nbytes,
        created=created,
        role=role,
        preview=preview[-PREVIEW_MAX:],
        keys=keys,
        rest_nbytes=rest_nbytes,
    )


@dataclass(slots=True)
class EntryStats:
    """The mutable part of an entry, kept apart from its frozen record."""

    last_used: float
    hits: int = 0
    keep_until: float = 0.0  # a client asked to keep it until then (a cache breakpoint)
