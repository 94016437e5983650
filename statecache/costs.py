"""What reaching a prefix costs: measured read bandwidth per tier, measured prefill rate.

The planner restores a checkpoint from disk or from a store only when fetching it is
cheaper than prefilling the tokens it saves: a GPU prefills 2,000 tokens faster than
it reads 4 GB. Rates start from priors (each tier's ``prior_bandwidth``, told by the
pool as the tier opens: ``know``) and follow measurements (an exponentially weighted
mean, so a machine that gets busier is followed). A tier with neither (RAM, a live
lane) costs nothing to fetch. Thread-safe: the engine thread reads, the pool's
readers and the engine write.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

# Priors, used until something is measured: a prefill slower than most machines, so
# that a restore is tried and measured rather than never tried.
PRIOR_PREFILL_TPS = 1_000.0
RESTORE_BPS = 6e9  # set_data into the context (docs/design.md fact 4), for every tier
_WEIGHT = 0.3  # of a new measurement


@dataclass(slots=True, frozen=True)
class Estimate:
    """One option: start from ``n`` tokens of ``source``, fetched in ``fetch_s``."""

    source: str  # cold | lane | the name of a tier (ram, disk, remote ...)
    n: int
    fetch_s: float
    prefill_s: float  # the prompt's tokens after n

    @property
    def total_s(self) -> float:
        return self.fetch_s + self.prefill_s

    def describe(self, cold_s: float) -> str:
        ms = 1000.0
        return (f"est. {self.source} {self.fetch_s * ms:,.0f} ms + prefill "
                f"{self.prefill_s * ms:,.0f} ms vs cold {cold_s * ms:,.0f} ms")


class Costs:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._tps: float | None = None
        self._bw: dict[str, float] = {}  # measured, by tier
        self._prior: dict[str, float] = {}  # until measured, by tier

    def know(self, tier: str, prior: float | None) -> None:
        """``tier`` is read at ``prior`` bytes/s until measured (None: never fetched)."""
        if prior is not None:
            with self._lock:
                self._prior[tier] = prior

    def note_prefill(self, tokens: int, seconds: float) -> None:
        """A step that prefilled ``tokens`` (and decoded nothing) took ``seconds``."""
        if tokens < 1 or seconds <= 0:
            return
        rate = tokens / seconds
        with self._lock:
            self._tps = rate if self._tps is None else (1 - _WEIGHT) * self._tps + _WEIGHT * rate

    def note_read(self, tier: str, nbytes: int, seconds: float) -> None:
        """A checkpoint of ``nbytes`` came from ``tier`` in ``seconds`` (fetch and checks)."""
        if nbytes < 1 or seconds <= 0:
            return
        rate = nbytes / seconds
        with self._lock:
            old = self._bw.get(tier)
            self._bw[tier] = rate if old is None else (1 - _WEIGHT) * old + _WEIGHT * rate

    def prefill_tps(self) -> float:
        with self._lock:
            return self._tps if self._tps is not None else PRIOR_PREFILL_TPS

    def bandwidth(self, tier: str) -> float | None:
        """Bytes/s a state is read from ``tier`` at: measured, else its prior; None
        where reading from it costs nothing (RAM)."""
        with self._lock:
            return self._bw.get(tier, self._prior.get(tier))

    def measured_prefill(self) -> float:
        """The prefill rate measured so far (for /metrics): 0 while nothing is."""
        with self._lock:
            return self._tps or 0.0

    def measured_bandwidth(self, tier: str) -> float:
        """``tier``'s read bandwidth measured so far: 0 while nothing is."""
        with self._lock:
            return self._bw.get(tier, 0.0)

    def estimate(self, source: str, n: int, nbytes: int, prompt: int) -> Estimate:
        """Start from ``n`` of ``prompt`` tokens with a state of ``nbytes`` from ``source``."""
        fetch = 0.0
        bw = self.bandwidth(source)
        if bw is not None and nbytes > 0:  # RAM and live lanes: nothing to fetch
            fetch = nbytes / bw + nbytes / RESTORE_BPS
        return Estimate(source, n, fetch, max(prompt - n, 0) / self.prefill_tps())
