"""A trie of checkpoints keyed by page hash.

A record with ``n`` consumed tokens hangs on the node of its last whole page
(depth ``n // page_size``); the tokens after that page are checked on lookup.
Walking a request's chain visits one node per page.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from statecache.pages import PageChain, PageHash
from statecache.records import CheckpointRecord, Kind, Owner


@dataclass(slots=True, eq=False)
class _Node:
    parent: _Node | None
    key: PageHash
    depth: int
    children: dict[PageHash, _Node] = field(default_factory=dict)
    records: dict[str, CheckpointRecord] = field(default_factory=dict)


class Index:
    """Records by page-hash path, one root per namespace (h_0)."""

    def __init__(self) -> None:
        self._roots: dict[PageHash, _Node] = {}
        self._nodes: dict[str, _Node] = {}  # record id -> the node it hangs on

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, record_id: object) -> bool:
        return record_id in self._nodes

    def add(self, rec: CheckpointRecord, namespace: PageHash) -> None:
        if rec.id in self._nodes:
            raise RuntimeError(f"record {rec.id} is already indexed")
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = _Node(None, namespace, 0)
        for h in rec.page_hashes:
            child = node.children.get(h)
            if child is None:
                child = node.children[h] = _Node(node, h, node.depth + 1)
            node = child
        node.records[rec.id] = rec
        self._nodes[rec.id] = node

    def replace(self, rec: CheckpointRecord) -> None:
        """Swap in a new version of an indexed record (same id, same tokens)."""
        node = self._nodes[rec.id]
        node.records[rec.id] = rec

    def remove(self, record_id: str) -> CheckpointRecord | None:
        node = self._nodes.pop(record_id, None)
        if node is None:
            return None
        rec = node.records.pop(record_id)
        # Prune nodes that hold nothing any more, bottom up.
        while not node.records and not node.children:
            if node.parent is None:
                del self._roots[node.key]
                break
            del node.parent.children[node.key]
            node = node.parent
        return rec

    def depth(self, chain: PageChain) -> int:
        """How many leading pages of ``chain`` some indexed record also has (hashes only)."""
        node = self._roots.get(chain.namespace)
        depth = 0
        if node is None:
            return 0
        for h in chain.hashes:
            child = node.children.get(h)
            if child is None:
                break
            node, depth = child, depth + 1
        return depth

    def candidates(
        self,
        chain: PageChain,
        *,
        kind: Kind,
        owner: Owner,
        lane: int | None,
        max_n: int,
    ) -> Iterator[CheckpointRecord]:
        """Records usable for ``chain``'s tokens, deepest first, tokens verified.

        Visits one node per page of the chain up to ``max_n``; a record matches when
        kind and owner agree, a partial one is in ``lane``, ``n <= max_n`` and its
        tokens equal ``chain.tokens[:n]`` (the hash path alone proves nothing).
        """
        node = self._roots.get(chain.namespace)
        if node is None:
            return
        path = [node]
        limit = min(chain.n_pages, max_n // chain.page_size)
        for h in chain.hashes[:limit]:
            child = node.children.get(h)
            if child is None:
                break
            path.append(child)
            node = child
        tokens = chain.tokens
        for node in reversed(path):
            found = [
                r
                for r in node.records.values()
                if r.kind is kind
                and r.owner is owner
                and (kind is Kind.FULL or r.lane == lane)
                and r.n <= max_n
            ]
            found.sort(key=lambda r: r.n, reverse=True)
            for r in found:
                if r.matches(tokens):
                    yield r

    def records(self) -> Iterator[CheckpointRecord]:
        for rid, node in self._nodes.items():
            yield node.records[rid]

    def sanity_check(self) -> None:
        count = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            for rid, rec in node.records.items():
                count += 1
                if self._nodes.get(rid) is not node:
                    raise RuntimeError(f"index: record {rid} is on a node the map disagrees with")
                if len(rec.page_hashes) != node.depth:
                    raise RuntimeError(
                        f"index: record {rid} at depth {node.depth} has "
                        f"{len(rec.page_hashes)} pages"
                    )
                if rec.page_hashes and rec.page_hashes[-1] != node.key:
                    raise RuntimeError(f"index: record {rid} hangs under a foreign hash")
            if not node.records and not node.children:
                raise RuntimeError("index: empty node left in the trie")
            for key, child in node.children.items():
                if child.parent is not node or child.key != key or child.depth != node.depth + 1:
                    raise RuntimeError("index: broken parent/child link")
                stack.append(child)
        if count != len(self._nodes):
            raise RuntimeError(f"index: {count} records in the trie, {len(self._nodes)} in the map")
