"""Prompt lookup (no model): which n-gram it matches and what it proposes."""

from __future__ import annotations

import numpy as np

from proxy.engine.drafting import History, lookup, lookup_draft
from proxy.engine.draftlength import best_length, expected_tokens


def _a(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


def test_proposes_what_followed_the_latest_match_of_the_longest_ngram() -> None:
    # the history ends "0 2 3": no earlier "0 2 3", but "2 3" occurs twice before the
    # end; the later one was followed by 7 8 0 2
    toks = _a(1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 0, 2, 3)
    assert lookup_draft(toks, 4, n_max=3, n_min=2).tolist() == [7, 8, 0, 2]
    # the longest n-gram wins over a later, shorter one
    toks = _a(5, 1, 2, 3, 40, 41, 2, 3, 50, 51, 1, 2, 3)
    assert lookup_draft(toks, 2, n_max=3, n_min=2).tolist() == [40, 41]


def test_draft_is_cut_at_k_and_repeats_past_the_end() -> None:
    toks = _a(1, 2, 3, 4, 1, 2)
    assert lookup_draft(toks, 1, n_max=2, n_min=2).tolist() == [3]
    # "1 2" four tokens back: the text repeats with period 4, and the drafts go on so
    assert lookup_draft(toks, 8, n_max=2, n_min=2).tolist() == [3, 4, 1, 2, 3, 4, 1, 2]
    # a loop of two tokens (a small model's degenerate reply: '"""' and a newline)
    loop = _a(9, 8, 7, 5, 6, 5, 6, 5)
    assert lookup_draft(loop, 6, n_max=4, n_min=2).tolist() == [6, 5, 6, 5, 6, 5]
    # and the copy a cursor follows repeats too
    drafts, start, matched = lookup(loop, 5, n_max=4, n_min=2, cursor=6)
    assert (drafts.tolist(), start, matched) == ([6, 5, 6, 5, 6], 6, 2)


def test_no_match_no_draft() -> None:
    assert lookup_draft(_a(1, 2, 3, 4, 5), 4).size == 0
    assert lookup_draft(_a(7), 4).size == 0
    assert lookup_draft(_a(), 4).size == 0
    # a 1-gram match counts only when n_min allows it
    toks = _a(3, 9, 5, 3)
    assert lookup_draft(toks, 2, n_max=2, n_min=2).size == 0
    assert lookup_draft(toks, 2, n_max=2, n_min=1).tolist() == [9, 5]


def test_the_tail_does_not_match_itself() -> None:
    # a run of one token: the match must start before the tail and be followed by a
    # token; the run goes on
    toks = _a(4, 4, 4)
    assert lookup_draft(toks, 3, n_max=2, n_min=2).tolist() == [4, 4, 4]
    assert lookup_draft(_a(4, 4), 3, n_max=2, n_min=2).size == 0


def _brute(toks: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """The definition, slowly: the longest n-gram ending the history that occurred
    earlier (followed by a token), its latest occurrence, what followed it; copied one
    token at a time onto the end, so a copy that reaches the end copies its own drafts."""
    n_tok = len(toks)
    for n in range(min(n_max, n_tok - 1), n_min - 1, -1):
        tail = toks[n_tok - n:].tolist()
        for i in range(n_tok - n - 1, -1, -1):
            if toks[i:i + n].tolist() == tail:
                ext = toks.tolist()
                for j in range(k):
                    ext.append(ext[i + n + j])
                return ext[n_tok:]
    return []


def test_agrees_with_the_definition_on_random_histories() -> None:
    rng = np.random.default_rng(7)
    for trial in range(400):
        vocab = int(rng.integers(2, 6))  # small vocabularies: many repeats
        toks = rng.integers(0, vocab, size=int(rng.integers(0, 40))).astype(np.int32)
        n_max = int(rng.integers(1, 5))
        n_min = int(rng.integers(1, n_max + 1))
        k = int(rng.integers(1, 6))
        assert lookup_draft(toks, k, n_max, n_min).tolist() == _brute(toks, k, n_max, n_min), \
            (trial, toks.tolist(), k, n_max, n_min)


def test_history_drafts_where_the_lane_has_no_match() -> None:
    # the lane's tokens end "4 5"; no earlier "4 5" in them, but an earlier reply of the
    # conversation has one, followed by 6 7 (and then that reply's end)
    lane = _a(1, 2, 3, 4, 5)
    hist = History(sessions=4, tokens=100)
    hist.add("t", "s", [9, 4, 5, 6, 7])
    hist.add("t", "s", [8, 8, 8])
    held = hist.get("t", "s")
    assert held is not None
    assert lookup_draft(lane, 8, n_max=3, n_min=2, history=held).tolist() == [6, 7]
    # a match in the lane itself comes first
    lane2 = _a(4, 5, 30, 31, 4, 5)
    assert lookup_draft(lane2, 2, n_max=3, n_min=2, history=held).tolist() == [30, 31]
    # another tenant or session sees nothing of it
    assert hist.get("u", "s") is None and hist.get("t", None) is None


def test_history_is_bounded_per_conversation_and_in_conversations() -> None:
    hist = History(sessions=2, tokens=10)
    hist.add("t", "a", list(range(100, 108)))
    hist.add("t", "a", list(range(200, 208)))
    held = hist.get("t", "a")
    assert held is not None and len(held) == 10
    assert held.tolist()[-8:] == list(range(200, 208))  # the newest kept, whole
    hist.add("t", "b", [1, 2, 3])
    hist.get("t", "a")  # used: "b" is now the least recently used
    hist.add("t", "c", [4, 5, 6])
    assert hist.get("t", "b") is None and hist.get("t", "a") is not None
    # off
    none = History(sessions=4, tokens=0)
    none.add("t", "a", [1, 2, 3])
    assert none.get("t", "a") is None


def test_a_draft_never_runs_across_two_replies() -> None:
    hist = History(sessions=1, tokens=100)
    hist.add("t", "", [1, 2, 3])
    hist.add("t", "", [40, 41])
    held = hist.get("t", "")
    assert held is not None
    assert lookup_draft(_a(7, 1, 2), 8, n_max=2, n_min=2, history=held).tolist() == [3]


def test_the_cursor_follows_the_copy_past_a_later_match() -> None:
    # "1 2" occurs at 0 (followed by 3 4 5) and at 5 (followed by 9): the latest match
    # proposes 9, but a copy that was going on at position 2 goes on there
    toks = _a(1, 2, 3, 4, 5, 1, 2, 9, 0, 1, 2)
    assert lookup(toks, 3, n_max=2, n_min=2)[0].tolist() == [9, 0, 1]
    drafts, start, _ = lookup(toks, 3, n_max=2, n_min=2, cursor=2)
    assert drafts.tolist() == [3, 4, 5] and start == 2
    # a cursor where the copy does not hold any more is ignored
    assert lookup(toks, 3, n_max=2, n_min=2, cursor=4)[0].tolist() == [9, 0, 1]


def test_lookup_says_how_long_its_match_is() -> None:
    # "3 4 5" ends the tokens and occurred before (followed by 6): a match of three
    # tokens where n_max allows four, and of two where n_max is two
    toks = _a(1, 3, 4, 5, 6, 2, 3, 4, 5)
    drafts, start, matched = lookup(toks, 2, n_max=4, n_min=2)
    assert (drafts.tolist(), start, matched) == ([6, 2], 4, 3)
    assert lookup(toks, 2, n_max=2, n_min=2)[2] == 2
    assert lookup(_a(1, 2, 3), 2)[2] == 0  # no match


def test_expected_tokens_and_best_length() -> None:
    assert expected_tokens(0.5, 0) == 1.0
    assert expected_tokens(0.5, 2) == 1.75
    assert expected_tokens(1.0, 4) == 5.0
    step = 0.010
    # drafts that cost nothing and are always accepted: draft all
    assert best_length(1.0, 8, 1, step, lambda k: 0.0)[0] == 8
    # drafts that cost a whole step each: never worth it below certainty
    assert best_length(0.9, 8, 1, step, lambda k: step * k)[0] == 0
    # half a step each at 95%: a few pay, not all 8 (the last ones are seldom reached)
    k, rate = best_length(0.95, 8, 1, step, lambda k: step * k / 2)
    assert 1 <= k < 8 and rate > 1 / step
    # four lanes: the same drafts must beat four tokens a step, not one
    assert best_length(0.8, 8, 4, step, lambda k: step * k / 8)[0] < \
        best_length(0.8, 8, 1, step, lambda k: step * k / 8)[0]
    # not measured yet: the longest, to measure it
    assert best_length(0.1, 5, 1, step, lambda k: None) == (5, float("inf"))
