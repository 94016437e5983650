"""The live page's checkpoint tree (proxy/api/ui_tree.py), from real page chains."""

from __future__ import annotations

from typing import Any

from proxy.api import ui_tree
from proxy.api.ui_tree import TreeView
from statecache.pages import PageChain, namespace_hash

PAGE = 32
NS = namespace_hash("model", "")
SYSTEM = list(range(1, 71))  # 70 tokens: two whole pages and some
MAIN = SYSTEM + list(range(100, 180))  # parts from SUB after the system prompt
SUB = SYSTEM + list(range(500, 590))


def _ck(tokens: list[int], role: str, cid: str) -> tuple[dict[str, Any], tuple[bytes, ...]]:
    row = {"id": cid, "n": len(tokens), "role": role, "kind": "full", "tiers": ["ram"],
           "nbytes": 1000, "hits": 0, "preview": f"…{tokens[-1]}", "tenant": ""}
    return row, PageChain(NS, PAGE, tokens).hashes


def _lane(lane: int, tokens: list[int], session: str | None) -> dict[str, Any]:
    return {"lane": lane, "tokens": len(tokens), "state": "idle", "session": session,
            "pages": PageChain(NS, PAGE, tokens).hashes}


def _build(view: TreeView, cks: list[tuple[dict[str, Any], tuple[bytes, ...]]],
           lanes: list[dict[str, Any]], now: float = 100.0) -> dict[str, Any]:
    return view.build([r for r, _ in cks], {r["id"]: p for r, p in cks}, lanes, now)


def _by_key(tree: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {n["key"]: n for n in tree["nodes"]}


def _holding(tree: dict[str, Any], cid: str) -> dict[str, Any]:
    return next(n for n in tree["nodes"] if any(c["id"] == cid for c in n["checkpoints"]))


CKS = [_ck(SYSTEM, "branch", "s"), _ck(MAIN[:120], "replay", "m1"),
       _ck(MAIN, "end-of-reply", "m2"), _ck(SUB, "end-of-reply", "b1")]


def test_two_conversations_part_where_their_shared_prefix_ends() -> None:
    view = TreeView(PAGE)
    tree = _build(view, CKS, [_lane(0, MAIN + [7] * 40, "main"), _lane(1, SUB, "sub")])
    nodes = _by_key(tree)
    shared = _holding(tree, "s")
    assert shared["tokens"] == 64  # the system prompt's whole pages
    children = [n for n in tree["nodes"] if n["parent"] == shared["key"]]
    assert len(children) == 2  # main and sub part there
    m1, m2, b1 = _holding(tree, "m1"), _holding(tree, "m2"), _holding(tree, "b1")
    assert m1["parent"] == shared["key"] and m2["parent"] == m1["key"]
    assert b1["parent"] == shared["key"]
    assert nodes[shared["parent"]]["key"] == "root"
    # each lane sits where its conversation's last checkpoint is, beyond it what it holds more
    assert [ln["lane"] for ln in m2["lanes"]] == [0] and m2["lanes"][0]["shared"] == 128
    assert [ln["lane"] for ln in b1["lanes"]] == [1] and b1["lanes"][0]["shared"] == 160
    assert m2["sessions"] == ["main"] and b1["sessions"] == ["sub"]
    assert tree["held"] == tree["shown"] == 4 and tree["gone"] == 0


def test_gone_points_stay_in_place_for_a_while_and_names_outlive_lanes() -> None:
    view = TreeView(PAGE)
    _build(view, CKS, [_lane(0, MAIN, "main")], now=100.0)
    left = [c for c in CKS if c[0]["id"] != "m1"]
    tree = _build(view, left, [], now=101.0)  # m1 went away; no lane holds main now
    m1 = _holding(tree, "m1")
    chip = next(c for c in m1["checkpoints"] if c["id"] == "m1")
    assert chip["gone"] and chip["gone_at"] == 101.0 and chip["tiers"] == []
    assert _holding(tree, "m2")["parent"] == m1["key"]  # still drawn where it was
    assert _holding(tree, "m2")["sessions"] == ["main"]  # the conversation keeps its name
    assert tree["gone"] == 1
    later = _build(view, left, [], now=101.0 + ui_tree.GONE_S + 1)
    assert not any(c["id"] == "m1" for n in later["nodes"] for c in n["checkpoints"])
    back = _build(view, left, [], now=102.0 + ui_tree.GONE_S)
    assert back["gone"] == 0


def test_a_checkpoint_that_comes_back_is_not_gone() -> None:
    view = TreeView(PAGE)
    _build(view, CKS, [])
    _build(view, CKS[:1], [], now=101.0)
    tree = _build(view, CKS, [], now=102.0)
    assert tree["gone"] == 0
    assert not any(c.get("gone") for n in tree["nodes"] for c in n["checkpoints"])


def test_the_trie_is_built_again_only_when_the_checkpoints_change() -> None:
    view = TreeView(PAGE)
    _build(view, CKS, [_lane(0, MAIN, "main")])
    trie = view._trie
    _build(view, CKS, [_lane(0, MAIN + [9] * 64, "main")])  # a lane moved on: same trie
    assert view._trie is trie
    _build(view, CKS[:3], [])
    assert view._trie is not trie


def test_a_lane_beyond_the_tree_and_an_empty_lane_sit_at_their_deepest_node() -> None:
    view = TreeView(PAGE)
    other = list(range(900, 1000))
    tree = _build(view, CKS, [_lane(0, other, None), _lane(1, [], None),
                              _lane(2, SYSTEM + [3] * 200, "new")])
    root = _by_key(tree)["root"]
    assert sorted(ln["lane"] for ln in root["lanes"]) == [0, 1]
    assert all(ln["shared"] == 0 for ln in root["lanes"])
    shared = _holding(tree, "s")
    assert [ln["lane"] for ln in shared["lanes"]] == [2] and shared["lanes"][0]["shared"] == 64


def test_only_the_most_recently_used_are_drawn() -> None:
    view = TreeView(PAGE)
    many = [_ck(list(range(i, i + 40)), "replay", f"c{i}") for i in range(ui_tree.MAX_SHOWN + 5)]
    tree = _build(view, many, [])
    drawn = {c["id"] for n in tree["nodes"] for c in n["checkpoints"]}
    assert len(drawn) == ui_tree.MAX_SHOWN and "c0" in drawn
    assert tree["held"] == ui_tree.MAX_SHOWN + 5
