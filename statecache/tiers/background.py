"""Background threads yield to the engine: the disk writer, its page writers and the
shared store's writer run at a lower priority than the thread that decodes."""

from __future__ import annotations

import logging
import os
import sys
import threading

log = logging.getLogger(__name__)

# How much the background writers (the disk's, the shared store's) yield to the engine:
# their MAC, copies and writes of tens of MB otherwise take a core from the decode of
# the request that comes right after a turn, while that turn's checkpoints are written
# (docs/cache.md, "Writes behind the engine", has what it changed in the full bench).
BACKGROUND_NICE = 10


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
