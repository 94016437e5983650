"""Checkpoint records: what a saved state is, where it sits in the token stream."""

from __future__ import annotations

import enum
import struct
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


# Refreshing an entry keeps the role that is evicted last (see ram.EvictionClass).
ROLE_STRENGTH: dict[Role, int] = {
    Role.END_OF_REPLY: 0,
    Role.PERIODIC: 1,
    Role.REPLAY: 2,
    Role.BRANCH: 3,
}

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

    def matches(self, tokens: TokenArray) -> bool:
        """True when ``tokens`` starts with exactly this record's tokens."""
        return len(tokens) >= self.n and bool(np.array_equal(tokens[: self.n], self.token_array()))

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "kind": self.kind.value,
            "owner": self.owner.value,
            "lane": self.lane,
            "n": self.n,
            "pages": len(self.page_hashes),
            "fingerprint": self.fingerprint,
            "tenant": self.tenant,
            "state_format": self.state_format,
            "nbytes": self.nbytes,
            "kv_pages": self.n_keys,
            "rest_nbytes": self.rest_nbytes,
            "created": self.created,
            "role": self.role.value,
            "preview": self.preview,
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
