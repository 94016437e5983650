"""Exact mode's grid (``cache.exact``, docs/exact.md): where a state that grid prefills
wrote starts a prompt as a cold prefill would, and the pool's offers of such states."""

from __future__ import annotations

import numpy as np

from statecache.pages import PageChain
from statecache.pool import CheckpointPool, Offer


def exact_at(n: int, end: int, grid: int) -> bool:
    """cache.exact: whether a state written by grid prefills after ``n`` tokens starts a
    prompt of ``end`` tokens exactly: on the grid (its next step is the cold one's), or the
    whole prompt (its first token is sampled from the logits kept with it)."""
    return n == end or (n % grid == 0 and n < end)


def exact_offers(pool: CheckpointPool, prompt: np.ndarray, chain: PageChain, have: int,
                 grid: int, tenant: str) -> list[Offer]:
    """cache.exact: the pool's offers where ``exact_at`` holds. The pool offers the deepest
    state of each tier; one off the grid (a prompt's end) hides the grid points below it,
    so the search goes on below each such one."""
    end, max_n = len(prompt), len(prompt)
    for _ in range(64):
        found = [o for o in pool.full_offers(prompt, chain, max_n=max_n, tenant=tenant)
                 if o.n > have]
        good = [o for o in found if exact_at(o.n, end, grid)]
        if good or not found:
            return good
        max_n = (min(o.n for o in found) - 1) // grid * grid
        if max_n <= have:
            break
    return []
