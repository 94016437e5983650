"""Prompt lookup (no model): which n-gram it matches and what it proposes."""

from __future__ import annotations

import numpy as np

from proxy.engine.drafting import lookup_draft


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


def test_draft_is_cut_at_k_and_at_the_end_of_the_history() -> None:
    toks = _a(1, 2, 3, 4, 1, 2)
    assert lookup_draft(toks, 1, n_max=2, n_min=2).tolist() == [3]
    assert lookup_draft(toks, 8, n_max=2, n_min=2).tolist() == [3, 4, 1, 2]


def test_no_match_no_draft() -> None:
    assert lookup_draft(_a(1, 2, 3, 4, 5), 4).size == 0
    assert lookup_draft(_a(7), 4).size == 0
    assert lookup_draft(_a(), 4).size == 0
    # a 1-gram match counts only when n_min allows it
    toks = _a(3, 9, 5, 3)
    assert lookup_draft(toks, 2, n_max=2, n_min=2).size == 0
    assert lookup_draft(toks, 2, n_max=2, n_min=1).tolist() == [9, 5]


def test_the_tail_does_not_match_itself() -> None:
    # a run of one token: the match must start before the tail and be followed by a token
    toks = _a(4, 4, 4)
    assert lookup_draft(toks, 3, n_max=2, n_min=2).tolist() == [4]


def _brute(toks: np.ndarray, k: int, n_max: int, n_min: int) -> list[int]:
    """The definition, slowly: the longest n-gram ending the history that occurred
    earlier (followed by a token), its latest occurrence, what followed it."""
    n_tok = len(toks)
    for n in range(min(n_max, n_tok - 1), n_min - 1, -1):
        tail = toks[n_tok - n:].tolist()
        for i in range(n_tok - n - 1, -1, -1):
            if toks[i:i + n].tolist() == tail:
                return toks[i + n: i + n + k].tolist()
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
