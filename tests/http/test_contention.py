"""``python -m bench.contention``: one stream's rate alone and beside a busy process, for
each thread count asked, and the busy processes gone afterwards."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

from bench.contention import busy, measure, table


def test_the_contention_bench_measures_each_thread_count(hybrid_path: Path,
                                                          tmp_path: Path) -> None:
    res = measure(hybrid_path, tokens=24, busy_procs=1, threads=[2, 1], log_dir=tmp_path)
    assert [r["threads"] for r in res["runs"]] == [2, 1]
    for r in res["runs"]:
        assert math.isfinite(r["quiet_tps"]) and r["quiet_tps"] > 0, r
        assert math.isfinite(r["busy_tps"]) and r["busy_tps"] > 0, r
    rows = [line for line in table(res).splitlines() if line.startswith("| 2 |")
            or line.startswith("| 1 |")]
    assert len(rows) == 2


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _runnable_s(pid: int) -> float:
    """Seconds ``pid`` ran on a core or waited in the run queue for one (schedstat)."""
    on_cpu, waiting, _ = Path(f"/proc/{pid}/schedstat").read_text().split()
    return (int(on_cpu) + int(waiting)) / 1e9


def test_busy_processes_spin_and_are_gone_after() -> None:
    with busy(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        before = [(_cpu_s(p.pid), _runnable_s(p.pid)) for p in procs]
        t0 = time.perf_counter()
        time.sleep(0.5)
        took = time.perf_counter() - t0
        used = [(_cpu_s(p.pid) - c, _runnable_s(p.pid) - r)
                for p, (c, r) in zip(procs, before, strict=True)]
        # each spins: it ran or waited for a core all along, never slept (the share of
        # the cores it got is the machine's to say: 0.4 s of 2 cores' 1.0 when quiet)
        assert all(cpu > 0 and ready > 0.8 * took for cpu, ready in used), (used, took)
    assert all(p.poll() is not None for p in procs)
