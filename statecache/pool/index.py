"""A trie of checkpoints keyed by page hash.

A record with ``n`` consumed tokens hangs on the node of its last whole page
(depth ``n // page_size``); the tokens after that page are checked on lookup.
Walking a request's chain visits one node per page. The hashes of a record's pages are
its path in the trie: the records keep none of their own once indexed (a record held on
disk alone is only its head, ``statecache.records.RecordHead``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from statecache.pages import PageChain, PageHash
from statecache.records import CheckpointRecord, Kind, Owner, Record


@dataclass(slots=True, eq=False)
class _Node:
    """One page of some indexed record's path. A node per page of every conversation
    held: kept small (no empty dicts; most nodes have one child, held as itself)."""

    parent: _Node | None
    key: PageHash
    depth: int
    kids: _Node | dict[PageHash, _Node] | None = None  # none, the only child, or by hash
    records: dict[str, Record] | None = None

    def child(self, h: PageHash) -> _Node | None:
        kids = self.kids
        if kids is None or isinstance(kids, _Node):
            return kids if kids is not None and kids.key == h else None
        return kids.get(h)

    def add_child(self, h: PageHash) -> _Node:
        node = _Node(self, h, self.depth + 1)
        kids = self.kids
        if kids is None:
            self.kids = node
        elif isinstance(kids, _Node):
            self.kids = {kids.key: kids, h: node}
        else:
            kids[h] = node
        return node

    def drop_child(self, h: PageHash) -> None:
        kids = self.kids
        if isinstance(kids, _Node):
            self.kids = None
        elif kids is not None:
            del kids[h]
            if len(kids) == 1:
                self.kids = next(iter(kids.values()))

    def children(self) -> list[_Node]:
        kids = self.kids
        if kids is None:
            return []
        return [kids] if isinstance(kids, _Node) else list(kids.values())

    def empty(self) -> bool:
        return self.records is None and self.kids is None

    def path(self) -> tuple[PageHash, ...]:
        """The page hashes from the root to this node."""
        keys: list[PageHash] = []
        node: _Node | None = self
        while node is not None and node.parent is not None:
            keys.append(node.key)
            node = node.parent
        return tuple(reversed(keys))


class Paths(Mapping[str, tuple[PageHash, ...]]):
    """Each record's page hashes, read from the trie when asked (a snapshot of which
    record hangs where: a node's key and parent never change, so it stays valid after
    the index moves on, without its lock)."""

    def __init__(self, nodes: dict[str, _Node]) -> None:
        self._nodes = nodes

    def __getitem__(self, record_id: str) -> tuple[PageHash, ...]:
        return self._nodes[record_id].path()

    def __contains__(self, record_id: object) -> bool:
        return record_id in self._nodes

    def __iter__(self) -> Iterator[str]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)


class Index:
    """Records by page-hash path, one root per namespace (h_0)."""

    def __init__(self) -> None:
        self._roots: dict[PageHash, _Node] = {}
        self._nodes: dict[str, _Node] = {}  # record id -> the node it hangs on

    def __len__(self) -> int:
        return len(self._nodes)

    def __contains__(self, record_id: object) -> bool:
        return record_id in self._nodes

    def add(self, rec: Record, namespace: PageHash,
            path: Sequence[PageHash] | None = None) -> None:
        """Index ``rec`` under ``path``, the hashes of its whole pages (by default a whole
        record's own)."""
        if rec.id in self._nodes:
            raise RuntimeError(f"record {rec.id} is already indexed")
        if path is None:
            if not isinstance(rec, CheckpointRecord):
                raise RuntimeError(f"record {rec.id}: a head is indexed with its path")
            path = rec.page_hashes
        if len(path) != rec.n_pages:
            raise RuntimeError(f"record {rec.id} has {rec.n_pages} pages, not {len(path)}")
        node = self._roots.get(namespace)
        if node is None:
            node = self._roots[namespace] = _Node(None, namespace, 0)
        for h in path:
            node = node.child(h) or node.add_child(h)
        if node.records is None:
            node.records = {}
        node.records[rec.id] = rec
        self._nodes[rec.id] = node

    def replace(self, rec: Record) -> None:
        """Swap in a new version of an indexed record (same id, same tokens): another
        role, or its head for the whole record, or back."""
        node = self._nodes[rec.id]
        assert node.records is not None
        node.records[rec.id] = rec

    def remove(self, record_id: str) -> Record | None:
        node = self._nodes.pop(record_id, None)
        if node is None:
            return None
        assert node.records is not None
        rec = node.records.pop(record_id)
        if not node.records:
            node.records = None
        # Prune nodes that hold nothing any more, bottom up.
        while node.empty():
            if node.parent is None:
                del self._roots[node.key]
                break
            node.parent.drop_child(node.key)
            node = node.parent
        return rec

    def depth(self, chain: PageChain) -> int:
        """How many leading pages of ``chain`` some indexed record also has (hashes only)."""
        node = self._roots.get(chain.namespace)
        depth = 0
        if node is None:
            return 0
        for h in chain.hashes:
            child = node.child(h)
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
    ) -> Iterator[Record]:
        """Records usable for ``chain``'s tokens, deepest first, tokens verified.

        Visits one node per page of the chain up to ``max_n``; a record matches when
        kind and owner agree, a partial one is in ``lane``, ``n <= max_n`` and its
        tokens equal ``chain.tokens[:n]`` (the hash path alone proves nothing; a head
        compares them by its id).
        """
        node = self._roots.get(chain.namespace)
        if node is None:
            return
        path = [node]
        limit = min(chain.n_pages, max_n // chain.page_size)
        for h in chain.hashes[:limit]:
            child = node.child(h)
            if child is None:
                break
            path.append(child)
            node = child
        tokens = chain.tokens
        for node in reversed(path):
            if node.records is None:
                continue
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

    def records(self) -> Iterator[Record]:
        for rid, node in self._nodes.items():
            assert node.records is not None
            yield node.records[rid]

    def paths(self) -> Paths:
        return Paths(dict(self._nodes))

    def sanity_check(self) -> None:
        count = 0
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            if node.records is not None and not node.records:
                raise RuntimeError("index: an empty record map left on a node")
            for rid, rec in (node.records or {}).items():
                count += 1
                if self._nodes.get(rid) is not node:
                    raise RuntimeError(f"index: record {rid} is on a node the map disagrees with")
                if rec.n_pages != node.depth:
                    raise RuntimeError(
                        f"index: record {rid} at depth {node.depth} has {rec.n_pages} pages"
                    )
                if isinstance(rec, CheckpointRecord) and rec.page_hashes \
                        and rec.page_hashes[-1] != node.key:
                    raise RuntimeError(f"index: record {rid} hangs under a foreign hash")
            if node.empty():
                raise RuntimeError("index: empty node left in the trie")
            if isinstance(node.kids, dict) and len(node.kids) < 2:
                raise RuntimeError("index: a map of fewer than two children")
            kids = node.kids.items() if isinstance(node.kids, dict) else [
                (c.key, c) for c in node.children()]
            for key, child in kids:
                if child.parent is not node or child.key != key or child.depth != node.depth + 1:
                    raise RuntimeError("index: broken parent/child link")
                stack.append(child)
        if count != len(self._nodes):
            raise RuntimeError(f"index: {count} records in the trie, {len(self._nodes)} in the map")
