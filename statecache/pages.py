"""Pages of tokens and their chained hashes.

Page ``i`` has hash ``h_i = H(h_{i-1} || tokens_i)`` with ``h_0`` the namespace hash
(model fingerprint + tenant). A hash only finds a candidate; tokens are compared later.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from typing import NewType, cast

import numpy as np
import numpy.typing as npt
import xxhash

PageHash = NewType("PageHash", bytes)
TokenArray = npt.NDArray[np.int32]
Tokens = Sequence[int] | npt.NDArray[np.integer]

HASH_BYTES = 16
_NS_TAG = b"statecache/namespace/v1"
_INT32_MAX = 2**31 - 1
_EMPTY = np.zeros(0, dtype="<i4")
_EMPTY.flags.writeable = False


def _prefixed(part: bytes) -> bytes:
    return struct.pack("<Q", len(part)) + part


def namespace_hash(fingerprint: str, tenant: str) -> PageHash:
    """h_0: length-prefixed so ("a:b", "") and ("a", "b:") differ."""
    raw = _prefixed(_NS_TAG) + _prefixed(fingerprint.encode()) + _prefixed(tenant.encode())
    return PageHash(xxhash.xxh3_128_digest(raw))


def as_tokens(tokens: Tokens) -> TokenArray:
    """Tokens as a 1-D little-endian int32 array (no copy when already one)."""
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {arr.shape}")
        if arr.dtype == np.dtype("<i4"):
            return cast(TokenArray, arr)
        if arr.size and not np.issubdtype(arr.dtype, np.integer):
            raise ValueError(f"tokens must be integers, got dtype {arr.dtype}")
    else:
        if len(tokens) == 0:
            return _EMPTY
        try:
            arr = np.asarray(tokens, dtype=np.int64)
        except (OverflowError, TypeError, ValueError) as e:
            raise ValueError(f"tokens must be a sequence of ints: {e}") from None
        if arr.ndim != 1:
            raise ValueError("tokens must be a flat sequence of ints")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > _INT32_MAX):
        raise ValueError("token ids must be in 0..2**31-1")
    return arr.astype("<i4")


def hash_page(parent: PageHash, tokens: Tokens) -> PageHash:
    """H(parent || tokens as little-endian int32 bytes)."""
    h = xxhash.xxh3_128(parent)
    h.update(as_tokens(tokens).tobytes())
    return PageHash(h.digest())


def common_prefix(a: TokenArray, b: TokenArray) -> int:
    """Length of the longest common prefix of two token arrays."""
    m = min(len(a), len(b))
    diff = np.flatnonzero(a[:m] != b[:m])
    return int(diff[0]) if diff.size else m


class PageChain:
    """Tokens of one request and the hashes of its whole pages."""

    __slots__ = ("namespace", "page_size", "_tokens", "_hashes")

    def __init__(self, namespace: PageHash, page_size: int = 32, tokens: Tokens = ()) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        if len(namespace) != HASH_BYTES:
            raise ValueError("namespace must be a 16-byte hash")
        self.namespace = namespace
        self.page_size = page_size
        self._tokens: TokenArray = _EMPTY
        self._hashes: list[PageHash] = []
        self.extend(tokens)

    @property
    def tokens(self) -> TokenArray:
        """Read-only view of the tokens."""
        view = self._tokens.view()
        view.flags.writeable = False
        return view

    @property
    def hashes(self) -> tuple[PageHash, ...]:
        """Hashes of the whole pages, page 1 first (h_0 is ``namespace``)."""
        return tuple(self._hashes)

    @property
    def n_pages(self) -> int:
        return len(self._hashes)

    def __len__(self) -> int:
        return len(self._tokens)

    def hash_at(self, depth: int) -> PageHash:
        """h_depth: the namespace for 0, else the hash of page ``depth``."""
        return self.namespace if depth == 0 else self._hashes[depth - 1]

    def extend(self, tokens: Tokens) -> None:
        """Append tokens, hashing only pages that become whole."""
        new = as_tokens(tokens)
        if new.size == 0:
            return
        self._tokens = np.concatenate([self._tokens, new]).astype("<i4", copy=False)
        self._hash_pages()

    def for_tokens(self, tokens: Tokens) -> PageChain:
        """A chain for ``tokens`` that reuses the hashes of pages shared with this one."""
        arr = as_tokens(tokens)
        shared = common_prefix(self._tokens, arr) // self.page_size
        out = PageChain(self.namespace, self.page_size)
        out._tokens = np.array(arr, dtype="<i4", copy=True)
        out._hashes = self._hashes[:shared]
        out._hash_pages()
        return out

    def _hash_pages(self) -> None:
        p = self.page_size
        whole = len(self._tokens) // p
        parent = self.hash_at(len(self._hashes))
        data = self._tokens
        for i in range(len(self._hashes), whole):
            h = xxhash.xxh3_128(parent)
            h.update(data[i * p : (i + 1) * p].tobytes())
            parent = PageHash(h.digest())
            self._hashes.append(parent)

    def __repr__(self) -> str:
        return f"PageChain(tokens={len(self)}, pages={self.n_pages}, page_size={self.page_size})"
