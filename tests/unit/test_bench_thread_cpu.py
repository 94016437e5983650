"""bench.batching's CPU per thread: the figure that splits a token's cost between the
threads that decode and all the others."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

from bench.batching import _thread_cpu

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="reads Linux's /proc/PID/task/*/schedstat")


def test_a_busy_thread_is_charged_and_an_idle_one_is_not() -> None:
    started = threading.Event()
    stop = threading.Event()
    tids: dict[str, int] = {}

    def busy() -> None:
        tids["busy"] = threading.get_native_id()
        started.set()
        x = 0
        while not stop.is_set():
            x += 1

    def idle() -> None:
        tids["idle"] = threading.get_native_id()
        stop.wait()

    threads = [threading.Thread(target=busy), threading.Thread(target=idle)]
    for t in threads:
        t.start()
    started.wait()
    time.sleep(0.05)
    before = _thread_cpu(os.getpid())
    # until the spinning thread was charged 50 ms: how soon is a busy machine's to say
    # (it held a core for much of 0.3 s on a quiet one), and the idle one stays idle
    deadline = time.monotonic() + 60
    try:
        while True:
            after = _thread_cpu(os.getpid())
            busy_ns = after[tids["busy"]] - before[tids["busy"]]
            if busy_ns > 50_000_000 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join()
    idle_ns = after[tids["idle"]] - before[tids["idle"]]
    assert busy_ns > 50_000_000
    assert idle_ns < 5_000_000
    assert threading.get_native_id() in after


def test_a_process_that_is_gone_reads_as_nothing() -> None:
    assert _thread_cpu(2**22 + 12345) == {}
