"""The shared tier for ``statecache inspect --remote`` and ``statecache purge --remote``.

Reads headers without the key (like ``inspect`` on disk: a listing, never a state) and
deletes whole entries: header, chunks and index field; then the KV pages no entry left
names (``sweep_pages``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from statecache.formats.remotefmt import (
    MAX_HEADER_BYTES,
    BadEntry,
    chunk_key,
    header_pattern,
    id_from_header_key,
    index_key,
    page_pattern,
    read_unchecked,
)
from statecache.pages import PageChain, namespace_hash
from statecache.tiers.remote import RemoteTier
from statecache.tiers.remotelink import connect


class RemoteAdmin:
    def __init__(self, url: str, *, prefix: str = "statecache", cluster: bool = False,
                 timeout: float = 5.0, page_size: int = 32) -> None:
        self.client = connect(url, cluster=cluster, timeout=timeout)
        self.prefix = prefix
        self.page_size = page_size

    def rows(self) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
        """One row per entry (the shape of ``inspect``'s disk rows) and the unreadable ones."""
        keys = list(self.client.scan_iter(match=header_pattern(self.prefix), count=1000))
        rows: list[dict[str, Any]] = []
        bad: list[dict[str, str]] = []
        for i in range(0, len(keys), 256):
            batch = keys[i:i + 256]
            pipe = self.client.pipeline(transaction=False)
            for k in batch:
                pipe.getrange(k, 0, MAX_HEADER_BYTES)
                pipe.pttl(k)
            replies = pipe.execute(raise_on_error=False)
            for j, k in enumerate(batch):
                raw, ttl = replies[2 * j], replies[2 * j + 1]
                name = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
                named = id_from_header_key(self.prefix, k)
                if named is None:
                    continue
                try:
                    u = read_unchecked(raw)
                except BadEntry as e:
                    bad.append({"key": name, "reason": str(e)})
                    continue
                m = u.meta
                rows.append({
                    "id": m["id"], "kind": m["kind"], "owner": m["owner"], "lane": m["lane"],
                    "role": m["role"], "n": m["n"], "nbytes": m["nbytes"],
                    "created": m["created"], "last_used": m["created"], "hits": None,
                    "tiers": [RemoteTier.name], "preview": m["preview"],
                    "fingerprint": m["fingerprint"], "tenant": m["tenant"],
                    "state_format": m["state_format"], "key": name,
                    "ttl_s": ttl / 1000 if isinstance(ttl, int) and ttl >= 0 else None,
                    "kv_pages": len(m["keys"]) // 16, "rest_nbytes": m["rest"],
                    "_nonce": u.nonce.hex(), "_chunks": u.chunks, "_tokens": m["tokens"],
                    "_keys": m["keys"], "_space": named[0],
                })
        return rows, bad

    def delete(self, row: dict[str, Any]) -> None:
        """Remove one entry of ``rows()``: its header, chunks and index field."""
        entry_id, nonce, space = row["id"], bytes.fromhex(row["_nonce"]), row["_space"]
        pipe = self.client.pipeline(transaction=False)
        pipe.delete(row["key"])
        for i in range(row["_chunks"]):
            pipe.delete(chunk_key(space, entry_id, nonce, i))
        tokens = np.frombuffer(row["_tokens"], dtype="<i4")
        whole = len(tokens) // self.page_size * self.page_size
        if whole:
            ns = namespace_hash(row["fingerprint"], row["tenant"])
            last = PageChain(ns, self.page_size, tokens[:whole]).hashes[-1]
            pipe.hdel(index_key(space, row["state_format"], last), entry_id)
        pipe.execute(raise_on_error=False)

    def delete_key(self, key: str) -> None:
        self.client.delete(key)

    def sweep_pages(self) -> int:
        """Delete the KV pages no entry names (after entries were deleted); how many.

        A page written for an entry whose header is not in yet (a write under way) goes
        too: that entry is then a miss, never a wrong state."""
        named: set[str] = set()
        for r in self.rows()[0]:
            keys = r["_keys"]
            named.update(keys[i:i + 16].hex() for i in range(0, len(keys), 16))
        gone = 0
        pipe = self.client.pipeline(transaction=False)
        for k in self.client.scan_iter(match=page_pattern(self.prefix), count=1000):
            name = k.decode(errors="replace") if isinstance(k, bytes) else str(k)
            if name.rsplit(":", 1)[-1] not in named:
                pipe.delete(k)
                gone += 1
        pipe.execute(raise_on_error=False)
        return gone


def public(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` without the fields only ``delete`` needs."""
    return {k: v for k, v in row.items() if not k.startswith("_")}
