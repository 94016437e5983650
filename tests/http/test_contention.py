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


def test_busy_processes_spin_and_are_gone_after() -> None:
    with busy(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)
        before = [_cpu_s(p.pid) for p in procs]
        time.sleep(0.5)
        used = [_cpu_s(p.pid) - b for p, b in zip(procs, before, strict=True)]
        assert sum(used) > 0.4, used  # two spinning processes on these 2 cores
    assert all(p.poll() is not None for p in procs)
