"""What writing a state into a buffer costs, by where the buffer comes from:
``python -m bench.statebuf --mib 250``.

A new buffer pays a page fault per 4 KiB the first time it is written; the pool's spare
(statecache/buffers.py) is one already written, resized by the kernel. Median of
``--repeats`` copies of ``--mib`` MiB into: a new ``bytes`` (what a copy of a state
was), a new anonymous map faulted page by page, a new map made with MAP_POPULATE, and
a map already written (the spare).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time
from collections.abc import Callable

_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


def _median_ms(f: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--mib", type=int, default=250)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    n = args.mib << 20
    src = memoryview(bytearray(os.urandom(1 << 20)) * args.mib)

    def into_map(flags: int) -> Callable[[], object]:
        def f() -> object:
            m = mmap.mmap(-1, n, flags=flags)
            memoryview(m)[:] = src
            return m
        return f

    spare = mmap.mmap(-1, n, flags=_FLAGS)
    memoryview(spare)[:] = src

    def into_spare() -> None:
        memoryview(spare)[:] = src

    rows = [("a new bytes", lambda: bytes(src)),
            ("a new map, faulted page by page", into_map(_FLAGS))]
    if hasattr(mmap, "MAP_POPULATE"):
        rows.append(("a new map, MAP_POPULATE", into_map(_FLAGS | mmap.MAP_POPULATE)))
    rows.append(("the spare (a map already written)", into_spare))
    print(f"| copying {args.mib} MiB into | ms (median of {args.repeats}) |")
    print("|---|---|")
    for name, f in rows:
        print(f"| {name} | {_median_ms(f, args.repeats):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
