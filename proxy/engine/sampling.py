"""Choosing the next token from logits: greedy, or temperature with top-k/top-p/min-p."""

from __future__ import annotations

import numpy as np

from proxy.engine.types import SamplingParams


class Sampler:
    """One per request; seeded so a request with ``seed`` is reproducible."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self._rng = np.random.default_rng(params.seed)

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        x = logits.astype(np.float64) / p.temperature
        if p.top_k > 0 and p.top_k < x.size:
            kth = np.partition(x, -p.top_k)[-p.top_k]
            x = np.where(x < kth, -np.inf, x)
        x -= x.max()
        probs = np.exp(x)
        probs /= probs.sum()
        if p.min_p > 0.0:
            probs = np.where(probs < p.min_p * probs.max(), 0.0, probs)
        if p.top_p < 1.0:
            order = np.argsort(-probs)
            cum = np.cumsum(probs[order])
            # keep the smallest set whose mass reaches top_p (always at least one token)
            cut = int(np.searchsorted(cum, p.top_p)) + 1
            keep = np.zeros_like(probs)
            keep[order[:cut]] = probs[order[:cut]]
            probs = keep
        probs /= probs.sum()
        return int(self._rng.choice(probs.size, p=probs))
