"""The checkpoint tree of the live page (proxy/api/ui.py): conversations as branches of
the prefixes they share.

Page hashes are chained (docs/design.md, "Words"): two checkpoints whose hash of page
*k* is equal hold the same first *k* pages. So the hashes of every checkpoint form a trie
of pages, and the page draws it compressed: a node where a checkpoint ends, where a lane
joins, or where prefixes part; an edge for each run of pages between them.

Built again only when the set of checkpoints changes (a poll of an unchanged pool costs
a set comparison); lanes are placed on it at each poll, by a binary search of their own
chain against the trie. Also remembered, bounded, between polls: checkpoints that went
away (evicted or dropped; shown as gone for ``GONE_S``) and the session each lane held
at a node (a conversation keeps its name after its lane moves on).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

ROOT = b""
MAX_SHOWN = 200  # checkpoints drawn, the most recently used first
MAX_GONE = 48  # checkpoints remembered as gone...
GONE_S = 600.0  # ...for this long
MAX_LABELS = 256  # (node, session) pairs remembered
_ROW_KEYS = ("n", "role", "kind", "tiers", "nbytes", "hits", "kept_until", "lane", "tenant")


@dataclass(slots=True)
class _Gone:
    row: dict[str, Any]
    pages: tuple[bytes, ...]
    since: float


@dataclass(slots=True)
class _Trie:
    """Every page of the drawn checkpoints: its parent and its depth (pages)."""

    up: dict[bytes, bytes] = field(default_factory=dict)
    depth: dict[bytes, int] = field(default_factory=lambda: {ROOT: 0})
    ends: dict[bytes, list[str]] = field(default_factory=dict)  # checkpoint ids by node
    kept: dict[bytes, bytes] = field(default_factory=dict)  # node -> its parent node

    def insert(self, pages: Sequence[bytes]) -> bytes:
        """Add a chain of pages; its last page (ROOT for none)."""
        for i in range(len(pages) - 1, -1, -1):
            h = pages[i]
            if h in self.depth:
                break
            self.depth[h] = i + 1
            self.up[h] = pages[i - 1] if i else ROOT
        return pages[-1] if pages else ROOT

    def compress(self) -> None:
        """The nodes drawn (ends and the pages where chains part) and each one's parent."""
        children: collections.Counter[bytes] = collections.Counter(self.up.values())
        keep = {h for h, c in children.items() if c > 1} | set(self.ends) | {ROOT}
        for h in keep:
            if h == ROOT:
                continue
            p = self.up[h]
            while p not in keep:
                p = self.up[p]
            self.kept[h] = p

    def joins(self, pages: Sequence[bytes]) -> tuple[bytes, int]:
        """Where a chain leaves the trie: the deepest drawn node on its way, and how many of
        its pages the trie holds (the pages a trie holds of a chain are a prefix of it)."""
        lo, hi = 0, len(pages)  # pages[:lo] are in the trie; pages[hi:] are not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if pages[mid - 1] in self.depth:
                lo = mid
            else:
                hi = mid - 1
        h = pages[lo - 1] if lo else ROOT
        while h not in self.kept and h != ROOT:
            h = self.up[h]
        return h, lo


class TreeView:
    """The tree the page draws, with what it remembers between polls."""

    def __init__(self, page: int) -> None:
        self.page = page
        self._key: frozenset[str] = frozenset()
        self._trie = _Trie()
        self._last: dict[str, tuple[dict[str, Any], tuple[bytes, ...]]] = {}
        self._gone: collections.OrderedDict[str, _Gone] = collections.OrderedDict()
        self._labels: collections.OrderedDict[tuple[bytes, str], None] = (
            collections.OrderedDict())

    def build(self, rows: Sequence[Mapping[str, Any]], pages: Mapping[str, tuple[bytes, ...]],
              lanes: Sequence[Mapping[str, Any]], now: float) -> dict[str, Any]:
        """The tree of the checkpoints ``rows`` (``describe_checkpoints``, newest first) with
        their ``pages``, and the ``lanes`` (``describe_lanes``) on it, as the page's JSON."""
        shown = {r["id"]: r for r in rows[:MAX_SHOWN] if r.get("id") in pages}
        self._remember_gone(shown, pages, now)
        key = frozenset(shown) | frozenset("gone:" + i for i in self._gone)
        if key != self._key:
            self._key, self._trie = key, self._new_trie(shown, pages)
        trie = self._trie
        nodes: dict[bytes, dict[str, Any]] = {}

        def node(h: bytes) -> dict[str, Any]:
            if h not in nodes:
                nodes[h] = {"key": h.hex()[:12] or "root", "tokens": trie.depth[h] * self.page,
                            "parent": (trie.kept.get(h, ROOT).hex()[:12] or "root")
                            if h != ROOT else None,
                            "checkpoints": [], "lanes": [], "sessions": []}
            return nodes[h]

        for h in sorted(trie.kept, key=trie.depth.__getitem__):
            node(h)
        node(ROOT)
        for h, ids in trie.ends.items():
            for entry_id in ids:
                if entry_id in shown:
                    node(h)["checkpoints"].append(_chip(shown[entry_id], gone=False))
                elif entry_id in self._gone:
                    g = self._gone[entry_id]
                    node(h)["checkpoints"].append(_chip(g.row, gone=True, since=g.since))
        for lane in lanes:
            chain = lane.get("pages") or ()
            h, held = trie.joins(chain)
            row = {k: lane.get(k) for k in ("lane", "state", "session", "tokens")}
            row["shared"] = min(held * self.page, int(lane.get("tokens") or 0))
            node(h)["lanes"].append(row)
            if lane.get("session") and chain:
                self._label(h, str(lane["session"]))
        for h, session in self._labels:
            if h in nodes:
                nodes[h]["sessions"].append(session)
        for n in nodes.values():
            n["checkpoints"].sort(key=lambda c: (c["n"], c["role"]))
            n["preview"] = _preview(n["checkpoints"])
        return {"page": self.page, "nodes": sorted(nodes.values(), key=lambda n: n["tokens"]),
                "shown": len(shown), "held": len(rows), "gone": len(self._gone)}

    def _new_trie(self, shown: Mapping[str, Any], pages: Mapping[str, tuple[bytes, ...]]
                  ) -> _Trie:
        trie = _Trie()
        for entry_id in shown:
            trie.ends.setdefault(trie.insert(pages[entry_id]), []).append(entry_id)
        for entry_id, g in self._gone.items():
            trie.ends.setdefault(trie.insert(g.pages), []).append(entry_id)
        trie.compress()
        return trie

    def _remember_gone(self, shown: Mapping[str, Mapping[str, Any]],
                       pages: Mapping[str, tuple[bytes, ...]], now: float) -> None:
        for entry_id, (row, chain) in self._last.items():
            if entry_id not in pages and entry_id not in self._gone:
                self._gone[entry_id] = _Gone(row, chain, now)
        for entry_id in [i for i in self._gone if i in pages]:  # it came back
            del self._gone[entry_id]
        while self._gone and (len(self._gone) > MAX_GONE
                              or next(iter(self._gone.values())).since < now - GONE_S):
            self._gone.popitem(last=False)
        self._last = {i: (dict(r), pages[i]) for i, r in shown.items()}

    def _label(self, h: bytes, session: str) -> None:
        key = (h, session[:64])
        self._labels[key] = None
        self._labels.move_to_end(key)
        while len(self._labels) > MAX_LABELS:
            self._labels.popitem(last=False)


def _chip(row: Mapping[str, Any], *, gone: bool, since: float = 0.0) -> dict[str, Any]:
    """A checkpoint as the page draws it (fields that are unset left out: the page asks
    for this once a second)."""
    out = {k: row[k] for k in _ROW_KEYS if row.get(k) not in (None, "")}
    out["id"] = str(row.get("id", ""))[:12]
    out["preview"] = row.get("preview", "")
    if gone:
        out.update(gone=True, gone_at=since, tiers=[])
    return out


def _preview(chips: list[dict[str, Any]]) -> str:
    """The text before a node's deepest checkpoint still held (else its deepest): the one
    preview the page shows for a node; the chips' own are dropped."""
    previews = [c.pop("preview") for c in chips]
    held = [p for c, p in zip(chips, previews, strict=True) if not c.get("gone")]
    return (held or previews or [""])[-1]
