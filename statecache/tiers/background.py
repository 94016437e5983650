"""Background threads yield to the engine: the disk writer, its page writers and the
shared store's writer run at a lower priority than the thread that decodes, and the two
writers hold their queues while the engine prefills (``PrefillHold``)."""

from __future__ import annotations

import logging
import os
import sys
import threading
import time

log = logging.getLogger(__name__)

# How much the background writers (the disk's, the shared store's) yield to the engine:
# their MAC, copies and writes of tens of MB otherwise take a core from the decode of
# the request that comes right after a turn, while that turn's checkpoints are written
# (docs/cache.md, "Writes behind the engine", has what it changed in the full bench).
BACKGROUND_NICE = 10

# the longest a writer holds its queue for one prefill: a process killed during a
# longer one still finds the checkpoints saved before that on disk (and in the store)
HOLD_MAX_S = 120.0


def run_in_background() -> None:
    """Lower the calling thread's scheduling priority by ``BACKGROUND_NICE`` (Linux,
    where a thread has its own nice value; elsewhere nothing changes)."""
    if not hasattr(os, "setpriority") or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid,
                       min(os.getpriority(os.PRIO_PROCESS, tid) + BACKGROUND_NICE, 19))
    except OSError:  # a sandbox may forbid it: the writer runs as before
        log.debug("could not lower the priority of thread %d", tid, exc_info=True)


class PrefillHold:
    """While the engine prefills, a writer's queue waits: a write's MAC, compression and
    copies would take a core from the prefill beside it, and a prefill's checkpoints
    would be written during the prefill that saves them. The hold ends when the engine
    says so, or by itself ``HOLD_MAX_S`` after it began. ``cond`` is the writer's: the
    hold changes under it, and its thread is woken when the hold ends."""

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self.since: float | None = None  # when the engine's prefill began

    def set(self, on: bool) -> None:
        """The engine prefills (``on``) or no longer does."""
        if on == (self.since is not None):  # every step says so: no lock taken then
            return
        with self._cond:
            self.since = time.monotonic() if on else None
            if not on:
                self._cond.notify_all()

    def left(self) -> float:
        """How much longer the queue waits (the writer's lock held): 0 to go now."""
        if self.since is None:
            return 0.0
        return max(self.since + HOLD_MAX_S - time.monotonic(), 0.0)
