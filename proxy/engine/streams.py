"""Handing the streams' new tokens to their outboxes, on one clock.

The streams are written together, at most once per ``server.stream_interval_ms``:
tokens that come sooner wait in their jobs for a later step, so a model decoding faster
than that costs the loop, the sockets and the clients one write for several tokens, and
the loop one wake-up for every stream (each stream on a clock of its own would drift
out of step with the others, and the loop would be woken for a few of them at a time).
A stream's first tokens and its last go at once; ``flush``: everything goes now (the
engine is about to do something that takes longer than a decode step).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from proxy.engine.job import Job
from proxy.engine.outbox import Outbox
from proxy.engine.types import TokenEvent


class Streams:
    def __init__(self, interval_s: float,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.interval_s = interval_s
        self.clock = clock  # (a test holds it still: when the interval is up is its call)
        self._last_write = -math.inf  # when the streams were last written together

    def write(self, active: Sequence[tuple[Job, Outbox]], *, flush: bool = False) -> None:
        """Hand each stream's new tokens to its outbox; wake the event loop once for all."""
        now = self.clock()
        due_all = flush or now - self._last_write >= self.interval_s
        due: list[Outbox] = []
        try:
            for job, box in active:
                out = job.out
                if not (out.deltas or out.logprobs):
                    continue
                if not (due_all or job.done or not out.written):
                    continue
                out.written = True
                if due_all:
                    self._last_write = now  # a loop that lags merges, not the clock
                if _deliver(job, box):
                    due.append(box)
        finally:
            if due:
                Outbox.wake_all(due)


def _deliver(job: Job, box: Outbox) -> bool:
    """Hand the tokens ``job`` holds to its outbox; True: the loop must be woken."""
    out = job.out
    ev = TokenEvent("".join(t for t, _ in out.deltas),
                    tuple(i for _, d in out.deltas for i in d), tuple(out.logprobs))
    out.deltas.clear()
    out.logprobs.clear()
    return box.put(ev, defer=True)
