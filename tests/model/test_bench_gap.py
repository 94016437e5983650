"""``python -m bench.gap``: every ``llama_decode`` of the run is timed, for the engine with
lone runs on and off and for the binding's loop, and the clock comes off afterwards."""

from __future__ import annotations

import math
from pathlib import Path

import proxy.engine.binding as binding
from bench.gap import SYSTEMS, DecodeClock, measure, table
from tests.busy import THREADS


def test_the_gap_bench_times_every_decode_of_each_system(hybrid_path: Path) -> None:
    before = binding._ll.llama_decode
    res = measure(hybrid_path, n_out=40, repeats=1)
    assert binding._ll.llama_decode is before  # the clock is off again
    for name in SYSTEMS:
        (run,) = res["runs"][name]
        rate, gap, gap50, decode = run
        assert rate > 0 and 0 < gap < 5000 and 0 < gap50 < 5000 and decode > 0, (name, run)
        assert all(math.isfinite(x) for x in res["median"][name])
    rows = [line for line in table(res).splitlines() if line.startswith("| ") and
            line.split("|")[1].strip() in SYSTEMS]
    assert len(rows) == len(SYSTEMS)


def test_the_decode_clock_sees_each_call_once(hybrid_path: Path) -> None:
    with binding.Model(hybrid_path) as model:
        ctx = binding.Context(model, binding.ContextParams(n_ctx=256, n_batch=64,
                                                           n_ubatch=64, threads=THREADS))
        with ctx:
            with DecodeClock() as clock:
                ctx.prefill(0, [10, 11, 12], 0)
                for pos in range(3, 8):
                    ctx.prefill(0, [13], pos)
            ctx.prefill(0, [14], 8)  # after the clock came off
        assert len(clock.calls) == 6
        assert all(b >= a for a, b in clock.calls)
        gap, gap50, decode = clock.summary(skip=1)
        assert gap >= 0 and gap50 >= 0 and decode > 0
