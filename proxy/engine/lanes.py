"""Lanes: the llama.cpp sequences of the shared context, and what each one holds."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from statecache.pages import common_prefix
from statecache.records import Role


@dataclass(slots=True)
class Lane:
    """One sequence id. ``tokens`` are exactly the tokens its live state has consumed.

    The tokens live in a growable buffer so a decode step appends in O(1); ``tokens``
    is a view that is valid until the lane changes (copy it to keep it).
    """

    id: int
    _buf: np.ndarray = field(default_factory=lambda: np.zeros(256, dtype=np.int32))
    _n: int = 0
    tenant: str = ""
    busy: bool = False
    last_used: float = 0.0
    # A full state restored at position r on an SWA model dropped the SWA cells masked
    # relative to r, so the lane must never be truncated below r (docs/design.md fact 8).
    floor: int = 0
    # Whether the lane's current tokens are already saved as a FULL checkpoint.
    saved_full: bool = False
    # Whether the lane's replay points (partial checkpoints) are saved as FULL ones too.
    replay_saved: bool = False
    # Tokens of the last request served here before its own turn: its history (the
    # prompt before the generation prompt), else its whole prompt; beyond them the lane
    # holds that turn's generation prompt and reply (0: unknown, as after a restore).
    history_n: int = 0
    # The client's name for the conversation served here last (GenerationRequest.session):
    # a request of that conversation comes back to this lane
    session: str | None = None
    # The last row's logits after the lane's first ``logits_n`` tokens (its last prefill's
    # end), kept while the lane holds those tokens: a prompt that ends there samples its
    # first token from them, with nothing decoded again
    logits: np.ndarray | None = None
    logits_n: int = 0
    # FULL checkpoints the live state owes the pool: (position, role, seconds a client
    # asked to keep it), sorted, each within what the lane holds. Where a live lane can
    # be cut back anywhere (attention, SWA), a prefill does not stop at its checkpoints:
    # they are taken from the lane when it is cut back or replaced (publishing.py)
    owed: list[tuple[int, Role, float]] = field(default_factory=list)
    # The first ``grid_n`` tokens' state was written as a cold prefill writes it: steps of
    # this lane alone on the grid of n_ubatch from token 0 (or restored from such a
    # state); a decoded token never counts (docs/exact.md)
    grid_n: int = 0

    @property
    def n(self) -> int:
        return self._n

    @property
    def tokens(self) -> np.ndarray:
        return self._buf[: self._n]

    def logits_at(self, n: int) -> np.ndarray | None:
        """The logits after the lane's first ``n`` tokens, if it kept them."""
        return self.logits if self.logits is not None and self.logits_n == n <= self._n \
            else None

    def keep_logits(self, logits: np.ndarray | None) -> None:
        """``logits`` (owned by the lane from now on) are those after all it holds now."""
        self.logits, self.logits_n = logits, self._n

    def _drop_logits(self) -> None:
        self.logits, self.logits_n = None, 0

    def common(self, prompt: np.ndarray, tenant: str) -> int:
        """Length of the prefix the lane shares with ``prompt`` (0 for another tenant)."""
        if tenant != self.tenant or self._n == 0:
            return 0
        return common_prefix(self.tokens, prompt)

    def _changed(self) -> None:
        self.saved_full = False
        self.replay_saved = False

    def _reserve(self, n: int) -> None:
        if n > self._buf.size:
            buf = np.zeros(max(n, 2 * self._buf.size), dtype=np.int32)
            buf[: self._n] = self._buf[: self._n]
            self._buf = buf

    def set_tokens(self, tokens: np.ndarray, tenant: str) -> None:
        arr = np.asarray(tokens, dtype=np.int32)
        self._reserve(arr.size)
        self._buf[: arr.size] = arr
        self._n = int(arr.size)
        self.tenant = tenant
        self.history_n = 0
        self.owed = []
        self.grid_n = 0
        self._drop_logits()
        self._changed()

    def extend(self, tokens: np.ndarray | list[int]) -> None:
        """The live state consumed ``tokens`` after the ones it holds."""
        k = len(tokens)
        self._reserve(self._n + k)
        self._buf[self._n: self._n + k] = tokens
        self._n += k
        self._changed()

    def push(self, token: int) -> None:
        """The live state consumed one more token: a decode step's (``extend`` converts
        a sequence, which costs several times as much for a single token)."""
        n = self._n
        if n == self._buf.size:
            self._reserve(n + 1)
        self._buf[n] = token
        self._n = n + 1
        self.saved_full = self.replay_saved = False

    def truncate(self, n: int) -> None:
        assert 0 <= n <= self._n
        if n < self._n:
            self._n = n
            self.history_n = min(self.history_n, n)
            self.grid_n = min(self.grid_n, n)
            if n < self.logits_n:
                self._drop_logits()
            self.owed = [o for o in self.owed if o[0] <= n]
            self._changed()

    def clear(self) -> None:
        self._n = 0
        self.grid_n = 0
        self.floor = 0
        self.history_n = 0
        self.owed = []
        self._drop_logits()
        self._changed()

    def vacant_for(self, prompt: np.ndarray, tenant: str, idle_since: float) -> bool:
        """Whether a pre-warm may take this lane without evicting a live conversation: the
        lane is empty, ``prompt`` goes on from what it holds, or its conversation has been
        idle since before ``idle_since`` (monotonic) and is saved in full."""
        return (self._n == 0 or self.common(prompt, tenant) == self._n
                or (self.saved_full and self.last_used <= idle_since))

    def replaced_by(self, prompt: np.ndarray, tenant: str) -> bool:
        """Whether ``prompt`` holds the whole history of the last request served here:
        what the lane holds beyond it is that request's own turn, which this prompt
        replaces or renders anew (a retry, a regenerate, a client that strips the
        reasoning from replies, a template that drops it from earlier turns)."""
        return 0 < self.history_n <= self.common(prompt, tenant)


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
