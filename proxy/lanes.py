"""Lanes: the llama.cpp sequences of the shared context, and what each one holds."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from statecache.pages import common_prefix


@dataclass(slots=True)
class Lane:
    """One sequence id. ``tokens`` are exactly the tokens its live state has consumed."""

    id: int
    tokens: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int32))
    tenant: str = ""
    busy: bool = False
    last_used: float = 0.0
    # A full state restored at position r on an SWA model dropped the SWA cells masked
    # relative to r, so the lane must never be truncated below r (DESIGN.md fact 8).
    floor: int = 0
    # Whether the lane's current tokens are already saved as a FULL checkpoint.
    saved_full: bool = False

    @property
    def n(self) -> int:
        return int(self.tokens.size)

    def common(self, prompt: np.ndarray, tenant: str) -> int:
        """Length of the prefix the lane shares with ``prompt`` (0 for another tenant)."""
        if tenant != self.tenant or self.n == 0:
            return 0
        return common_prefix(self.tokens, prompt)

    def set_tokens(self, tokens: np.ndarray, tenant: str) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int32).copy()
        self.tenant = tenant
        self.saved_full = False

    def truncate(self, n: int) -> None:
        assert 0 <= n <= self.n
        if n < self.n:
            self.tokens = self.tokens[:n].copy()
            self.saved_full = False

    def clear(self) -> None:
        self.tokens = np.zeros(0, dtype=np.int32)
        self.floor = 0
        self.saved_full = False


class LaneSet:
    """All lanes; hands out free ones."""

    def __init__(self, n: int) -> None:
        self.lanes = [Lane(i) for i in range(n)]

    def free(self) -> list[Lane]:
        return [lane for lane in self.lanes if not lane.busy]

    def __iter__(self) -> Iterator[Lane]:
        return iter(self.lanes)

    def __len__(self) -> int:
        return len(self.lanes)
