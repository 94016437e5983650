"""The engine's pure parts at tiny sizes: where checkpoints go, what a lane may do,
splicing generated ids, text streaming, sampling, and the pool calls the planner uses."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from proxy.engine.binding import MemoryInfo, MemoryKind
from proxy.engine.detok import TextStream
from proxy.engine.lanes import Lane
from proxy.engine.layout import (
    free_cuts,
    last_step_start,
    onto_grid,
    periodic_points,
    step_ends,
    window_steps,
)
from proxy.engine.planner import can_truncate, choose_share_points, publish_points
from proxy.engine.splice import aligned_replies, tokenize_spliced
from statecache.records import Kind, Role
from tests.unit.conftest import PoolFactory, put


def _memory(kind: MemoryKind, n_swa: int = 0) -> MemoryInfo:
    return MemoryInfo(kind=kind, n_swa=n_swa, seq_rm_rollback=kind is MemoryKind.ATTENTION,
                      rs_rollback=False, n_rs_seq=0, bytes_per_token=1, bytes_per_lane=0,
                      partial_bytes_per_token=0, partial_bytes_per_lane=0)


# -- publish points -------------------------------------------------------------------


def test_publish_points_replay_and_branch() -> None:
    # A 300-token prompt (limit 299), nothing reused, the history ends at 290, a cached
    # prompt shared the first 100 tokens: replay at 288, branch at 96.
    got = publish_points(reuse=0, limit=299, replay_at=290, match_depth=100, page=32)
    assert got == [(96, Role.BRANCH), (288, Role.REPLAY)]


def test_publish_points_skip_what_is_already_reused() -> None:
    # Reusing 200 tokens: only points after it; the branch below is not saved again.
    got = publish_points(reuse=200, limit=299, replay_at=290, match_depth=100, page=32)
    assert got == [(288, Role.REPLAY)]
    # A prompt that fully matches what is cached has no branch point.
    got = publish_points(reuse=0, limit=299, replay_at=0, match_depth=299, page=32)
    assert got == []


def test_periodic_points_go_where_the_steps_end_anyway() -> None:
    # Steps of 512 from 0: every 2,048 tokens, as multiples would be.
    assert periodic_points([], reuse=0, limit=9999, every=2048, chunk=512) == \
        [2048, 4096, 6144, 8192]
    # A share point at 3,739 ends a step there: the steps before it go short step first
    # (155, then 3,739 - k * 512), those after it, to the prompt's end, end at
    # 3,739 + k * 512: the periodic points are on that grid (2,203 and 5,787), not at
    # 2,048, 4,096 or 6,144, each of which would have cut a step of its own
    got = periodic_points([3739], reuse=0, limit=9999, every=2048, chunk=512)
    assert got == [155 + 4 * 512, 3739 + 4 * 512, 3739 + 8 * 512, 3739 + 12 * 512]
    # ... and a follow-up that starts from 1,000 tokens counts from there
    assert periodic_points([], reuse=1000, limit=5000, every=2048, chunk=512) == [3048]
    # a cold prompt of 8,881 tokens cut at 3,739 and 4,245 (Codex's share points on
    # Gemma 3) takes 19 steps; multiples of 2,048 would have cut one more (4,096)
    fixed = [3739, 4245]
    steps_with = _steps(fixed + periodic_points(fixed, reuse=0, limit=8880, every=2048,
                                                chunk=512), 8881, 512)
    assert steps_with == _steps(fixed, 8881, 512)
    assert steps_with == 19
    assert _steps(fixed + [2048, 4096, 6144, 8192], 8881, 512) == steps_with + 1
    assert periodic_points([100], reuse=0, limit=99, every=0, chunk=512) == []
    # points asked for more often than steps end go where asked (cutting steps)
    assert periodic_points([200], reuse=100, limit=600, every=128, chunk=512) == \
        [128, 256, 384, 512]


def test_share_points_onto_the_step_grid() -> None:
    # a prefill of 2,060 tokens ends a step at each cut; a stretch between two cuts goes
    # in steps of 512, its short one first (at the shallow end, where its part-filled
    # tiles cost least: docs/design.md fact 26), the last stretch whole steps first: a
    # share point at 1,100 ends one early, a step more than without it
    assert step_ends([2048], reuse=0, end=2060, chunk=512) == [512, 1024, 1536, 2048, 2060]
    assert step_ends([1100, 2048], reuse=0, end=2060, chunk=512) == \
        [76, 588, 1100, 1536, 2048, 2060]
    assert step_ends([1100], reuse=0, end=2060, chunk=512) == [76, 588, 1100, 1612, 2060]
    assert len(step_ends([], reuse=1000, end=1000, chunk=512)) == 0
    for fixed in ([3739, 4245], [100, 7000, 8880]):  # as _steps counts them
        assert len(step_ends(fixed, reuse=0, end=8881, chunk=512)) == _steps(fixed, 8881, 512)
    # moved down to the end of the step it falls in, where it is at most ``within`` past
    assert onto_grid([1100], [2048, 2060], reuse=0, chunk=512, within=128) == {1100: 1024}
    assert onto_grid([1100], [2048, 2060], reuse=0, chunk=512, within=64) == {}
    # one that stays shifts the grid of the next; one that would reach the start or a
    # kept point is dropped
    assert onto_grid([700, 1300], [], reuse=0, chunk=512, within=100) == {1300: 1212}
    assert onto_grid([40, 2100], [2080], reuse=0, chunk=512, within=64) == {40: 0, 2100: 0}
    assert onto_grid([1600], [], reuse=1000, chunk=512, within=100) == {1600: 1512}
    # wherever they go, the points moved are a whole number of steps past the point
    # before them: as cuts they cost no step, however the stretches lay their steps
    rnd = random.Random(5)
    for _ in range(300):
        end = rnd.randrange(600, 5000)
        kept = rnd.sample(range(1, end), rnd.randrange(0, 3))
        pts = rnd.sample(range(1, end), rnd.randrange(1, 5))
        within = rnd.choice([64, 200, 511])
        moved = onto_grid(pts, kept, reuse=0, chunk=512, within=within)
        stay = [*kept, *(n for n in pts if n not in moved)]
        went = [g for g in moved.values() if g]
        assert all(n - g <= within for n, g in moved.items() if g)
        assert len(step_ends(stay + went, reuse=0, end=end, chunk=512)) == \
            len(step_ends(stay, reuse=0, end=end, chunk=512)), (end, kept, pts, moved)
    # the share points, largest gap first, each an anchor for the rest, none within a page
    assert choose_share_points([100, 200, 900], [0], k=2, page=32) == [900, 200]
    assert choose_share_points([100, 200, 900], [0, 880], k=4, page=32) == [200, 100]
    assert choose_share_points([10, 20], [0], k=4, page=32) == []


def test_the_last_step_of_a_prefill() -> None:
    # a cold prompt of 19,700 tokens in steps of 512: the last starts at 19,456; a point
    # inside it (a breakpoint at 19,648, the history's end) would cut it in two
    assert last_step_start([], reuse=0, end=19700, chunk=512) == 19456
    assert last_step_start([19648, 19696], reuse=0, end=19700, chunk=512) == 19456
    # a cut further back moves the grid after it, and so the last step
    assert last_step_start([18110, 19648], reuse=0, end=19700, chunk=512) == \
        18110 + 3 * 512
    # a step that ends exactly at the prompt's end starts a whole step back; a follow-up
    # of less than a step has one step, from where it starts
    assert last_step_start([], reuse=0, end=1024, chunk=512) == 512
    assert last_step_start([1100, 1290], reuse=1000, end=1300, chunk=512) == 1000
    # the points before the last step are where steps end, as step_ends has them
    for cuts, end in (([700, 1990], 2000), ([300, 600, 1400], 1500)):
        start = last_step_start(cuts, reuse=0, end=end, chunk=512)
        before = [c for c in cuts if c <= start]
        assert step_ends(before, reuse=0, end=end, chunk=512)[-2] == start


def _steps(cuts: list[int], n: int, chunk: int) -> int:
    """Steps of a prefill of ``n`` tokens that ends a step at each cut."""
    bounds = sorted({0, *cuts, n})
    return sum(-(-(b - a) // chunk) for a, b in zip(bounds, bounds[1:], strict=False))


# -- truncation rules -----------------------------------------------------------------


def test_can_truncate_by_memory_kind() -> None:
    lane = Lane(0)
    lane.set_tokens(np.arange(2000, dtype=np.int32), "")
    live = {0: 0}.__getitem__  # pos_min of a live lane with every SWA cell kept
    assert can_truncate(_memory(MemoryKind.ATTENTION), lane, 10, live)
    assert not can_truncate(_memory(MemoryKind.HYBRID), lane, 10, live)
    assert can_truncate(_memory(MemoryKind.HYBRID), lane, 2000, live)  # no cut at all
    swa = _memory(MemoryKind.SWA, n_swa=512)
    assert can_truncate(swa, lane, 700, live)
    # a restored full state at 1502 holds SWA cells from 990 on (docs/design.md fact 8)
    lane.floor = 1502
    restored = {0: 990}.__getitem__
    assert not can_truncate(swa, lane, 1400, restored)
    assert not can_truncate(swa, lane, 699, restored)
    assert can_truncate(swa, lane, 1600, restored)


def test_a_window_sized_swa_memory_rolls_back_like_a_hybrid() -> None:
    # docs/design.md fact 25: its PARTIAL state is the SWA cache; the base cache alone
    # is paged, and a live lane is cut back by seq_rm only under the window rule
    full = _memory(MemoryKind.SWA, n_swa=512)
    window = dataclasses.replace(full, swa_window=True)
    assert (full.kv_sections, full.partial_rollback, full.full_size_swa) == (2, False, True)
    assert (window.kv_sections, window.partial_rollback, window.full_size_swa) == (1, True, False)
    assert _memory(MemoryKind.HYBRID).partial_rollback
    assert not _memory(MemoryKind.ATTENTION).partial_rollback
    lane = Lane(0)
    lane.set_tokens(np.arange(2000, dtype=np.int32), "")
    overwritten = {0: 1000}.__getitem__  # the window-sized cache kept cells from 1000 on
    assert can_truncate(window, lane, 1512, overwritten)
    assert not can_truncate(window, lane, 1511, overwritten)


# -- splicing -------------------------------------------------------------------------


def test_aligned_replies_split_at_special_tokens_and_strip_where_aligned() -> None:
    ids = [1, 2, 3, 99, 4, 5, 6]
    pieces = [b"  ab", b"cdefgh", b"ij", b"", b"hello wor", b"ld!", b"\n"]
    special = [False, False, False, True, False, False, False]
    got = {r.text: r.ids for r in aligned_replies(ids, pieces, special)}
    # "  abcdefghij" cannot be stripped: the first token holds the spaces and "ab"
    assert got == {"  abcdefghij": (1, 2, 3), "hello world!\n": (4, 5, 6),
                   "hello world!": (4, 5)}


def test_a_reply_cut_inside_a_character_is_spliced_as_streamed() -> None:
    """max_tokens cut the reply after the first byte of "€": the client got (and sends
    back) U+FFFD in its place, which tokenizes otherwise; the generated ids stand in."""
    euro = "€".encode()
    ids = [1, 2, 3]
    pieces = [b"  price: ", b"10 ", euro[:1]]
    got = {r.text: r.ids for r in aligned_replies(ids, pieces, [False] * 3)}
    assert got["  price: 10 \ufffd"] == (1, 2, 3)
    assert "price: 10 \ufffd" not in got  # the first token holds the spaces
    spliced, n = tokenize_spliced("<a>  price: 10 \ufffd</a>", lambda t: [ord(c) for c in t],
                                  aligned_replies(ids, pieces, [False] * 3))
    assert n == 1 and spliced[3:6] == [1, 2, 3]


def test_tokenize_spliced_uses_generated_ids_only_where_the_text_appears() -> None:
    ids = [7, 8]
    pieces = [b"hello ", b"world"]
    replies = aligned_replies(ids, pieces, [False, False])

    def tok(t: str) -> list[int]:
        return [ord(c) for c in t]

    spliced, n = tokenize_spliced("<a>hello world</a>", tok, replies)
    assert n == 1 and spliced == tok("<a>") + [7, 8] + tok("</a>")
    plain, n = tokenize_spliced("<a>hello there</a>", tok, replies)
    assert n == 0 and plain == tok("<a>hello there</a>")


# -- text streaming and sampling --------------------------------------------------------


def test_text_stream_holds_split_characters_and_stop_strings() -> None:
    s = TextStream(stops=("STOP",))
    euro = "€".encode()
    assert s.feed(euro[:1]) == ""  # half a character is held back
    assert s.feed(euro[1:] + b"ab") == "€ab"
    assert s.feed(b"cST") == "c"  # "ST" could start the stop string
    assert s.feed(b"Ox") == "STOx"
    assert s.feed(b"yySTOPzz") == "yy" and s.stopped
    assert s.feed(b"more") == "" and s.finish() == ""


def test_text_stream_without_stops_decodes_as_the_whole_reply() -> None:
    # Pieces of tokens as a byte-level vocabulary cuts them: characters split over two
    # and three pieces, whole ones, invalid bytes (one alone, one inside a character)
    # and a character left unfinished at the end. Fed one piece at a time, the text is
    # the whole reply's bytes decoded at once, and no piece gives half a character.
    pieces = [b"ab", "€".encode()[:1], "€".encode()[1:2], "€".encode()[2:] + b"c",
              "é".encode(), b"\xff", b"d", "ü".encode()[:1], b"e", "😀".encode()[:2],
              "😀".encode()[2:], b" f", "€".encode()[:2]]
    s = TextStream()
    out = [s.feed(p) for p in pieces]
    out.append(s.finish())
    assert "".join(out) == b"".join(pieces).decode("utf-8", "replace")
    assert out[1] == out[2] == "" and out[3] == "€c"
    assert out[9] == "" and out[10] == "😀" and out[-2] == "" and out[-1] == "\ufffd"


# -- pool calls made by the planner and executor ---------------------------------------


def test_match_depth_counts_shared_whole_pages(make_pool: PoolFactory) -> None:
    pool = make_pool(disk=None)
    put(pool, list(range(1, 14)), b"x")  # 13 tokens: pages 1..3 hashed
    probe = list(range(1, 11)) + [99, 98, 97, 96]
    assert pool.match_depth(pool.chain(probe)) == 8  # two whole pages in common
    assert pool.match_depth(pool.chain([5, 5, 5, 5])) == 0


def test_drop_lane_above_keeps_partials_still_valid(make_pool: PoolFactory) -> None:
    pool = make_pool(disk=None)
    toks = list(range(1, 30))
    for n in (8, 16, 24):
        put(pool, toks[:n], b"p", kind=Kind.PARTIAL, lane=1)
    put(pool, toks[:12], b"q", kind=Kind.PARTIAL, lane=0)
    # lane 1 is cut back to 16 tokens: the partial at 24 no longer matches its KV
    assert pool.drop_lane(1, above=16) == 1
    left = sorted((d["lane"], d["n"]) for d in pool.describe())
    assert left == [(0, 12), (1, 8), (1, 16)]
    assert pool.drop_lane(1) == 2
    pool.sanity_check()


def test_lane_common_prefix_respects_tenant() -> None:
    lane = Lane(0)
    lane.set_tokens(np.array([1, 2, 3], dtype=np.int32), "a")
    prompt = np.array([1, 2, 9, 4], dtype=np.int32)
    assert lane.common(prompt, "a") == 2
    assert lane.common(prompt, "b") == 0  # another tenant never shares a lane's state


def test_lane_push_grows_and_marks_the_lane_changed() -> None:
    lane = Lane(0)
    lane.set_tokens(np.arange(256, dtype=np.int32), "")  # the buffer is exactly full
    lane.saved_full = lane.replay_saved = True
    lane.push(7)
    lane.push(8)
    assert lane.n == 258
    assert lane.tokens[-3:].tolist() == [255, 7, 8]
    assert not lane.saved_full and not lane.replay_saved
    lane.extend([9, 10])
    assert lane.tokens[-4:].tolist() == [7, 8, 9, 10]


# -- a prompt's page hashes -----------------------------------------------------------


def test_a_follow_up_hashes_only_its_new_pages(make_pool: PoolFactory,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import statecache.pages
    from proxy.engine.restore import Restorer

    pool = make_pool()  # pages of 4 tokens
    hashed: list[int] = []
    real = statecache.pages.xxhash.xxh3_128

    def counting(*a: object) -> object:
        hashed.append(1)
        return real(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(statecache.pages.xxhash, "xxh3_128", counting)
    restorer = Restorer.__new__(Restorer)
    restorer.p = types.SimpleNamespace(pool=pool, lanes=[Lane(0), Lane(1)])  # type: ignore[assignment]
    restorer._chains = []
    first = np.arange(400, dtype=np.int32)
    follow = np.concatenate([first, np.arange(1000, 1042, dtype=np.int32)])
    other = np.arange(5000, 5400, dtype=np.int32)
    assert restorer._chain(first, "").hashes == pool.chain(first).hashes
    hashed.clear()
    got = restorer._chain(follow, "")
    assert len(hashed) == 10  # 442 tokens: 110 pages, 100 of them the first prompt's
    assert got.hashes == pool.chain(follow).hashes
    hashed.clear()
    restorer._chain(other, "")  # another conversation: all its pages
    assert len(hashed) == 100
    hashed.clear()
    assert restorer._chain(follow, "t2").hashes == pool.chain(follow, "t2").hashes
    assert len(hashed) > 110  # another tenant hashes from its own namespace: all again


def test_free_cuts_leave_the_prefill_its_steps() -> None:
    # Claude Code's first turn on Gemma 3: 19,659 tokens, 39 steps of 512; of its share
    # points 18,110, 18,192 and 18,204, one may end a step where it is and leave 39
    # (36 steps to 18,192, 3 after); 18,110 would make 40, and 18,204 after 18,192 too
    assert window_steps([], reuse=0, end=19659, chunk=512) == 39
    assert free_cuts([18110, 18192, 18204], [19648], reuse=0, end=19659, chunk=512) == [18192]
    assert window_steps([18192, 19648], reuse=0, end=19659, chunk=512) == 39
    assert window_steps([18110], reuse=0, end=19659, chunk=512) == 40
    # a prompt of whole steps has no room: nothing stays
    assert free_cuts([700], [], reuse=0, end=1536, chunk=512) == []
    # points inside the last step are owed: they cost no step
    assert window_steps([1100, 1190], reuse=0, end=1200, chunk=512) == 3
