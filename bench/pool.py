"""Micro-benchmarks of the pool: `python -m bench.pool` (its index and the MAC, in
process), and `python -m bench.pool --against REV`: the pool's insert, restore from RAM
and restore from disk (bench/pool_ops.py) in this checkout and in a worktree of REV,
run by run, each repeat's runs seconds apart and in alternating order, as the ratio
this / REV of the time an operation takes: its median over the repeats and its 95%
confidence interval (bench.paired.median_ci). An interval that holds 1.00 is no loss
that the repeats can tell; one below 1.00 is a gain.

    python -m bench.pool --against dc409ae --repeats 11 --json results/pool.json
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from bench.paired import median_ci
from bench.servers import ROOT, checkout
from statecache.config import CacheConfig
from statecache.formats.diskfmt import read_checkpoint, write_checkpoint
from statecache.kvpages import assemble, split
from statecache.pool import CheckpointPool
from statecache.records import Kind, Owner, Role, new_record

PAGE = 32
PAGES = 64
ENTRIES = 1000
STATE = 4096


def bench_pool() -> None:
    rng = np.random.default_rng(0)
    cfg = CacheConfig(page_size=PAGE, ram_budget=1 << 30, disk_enabled=False)
    pool = CheckpointPool(cfg, "bench-model")
    # 1,000 conversations sharing a 16-page system prompt, 64 pages each.
    system = rng.integers(0, 50_000, 16 * PAGE).tolist()
    convs = [system + rng.integers(0, 50_000, (PAGES - 16) * PAGE).tolist() for _ in range(ENTRIES)]
    blob = bytes(STATE)
    t0 = time.perf_counter()
    for toks in convs:
        pool.insert(
            kind=Kind.FULL,
            owner=Owner.TARGET,
            lane=None,
            tokens=toks,
            role=Role.END_OF_REPLY,
            data=blob,
        )
    t_insert = (time.perf_counter() - t0) / ENTRIES
    queries = [c + [1, 2, 3] for c in convs[:200]]
    t0 = time.perf_counter()
    chains = [pool.chain(q) for q in queries]
    t_chain = (time.perf_counter() - t0) / len(queries)
    t0 = time.perf_counter()
    for q, ch in zip(queries, chains, strict=True):
        lease = pool.lookup(q, ch, max_n=len(q) - 1)
        assert lease is not None and lease.record.n == len(q) - 3
        lease.close()
    t_lookup = (time.perf_counter() - t0) / len(queries)
    miss = system + [7] * (PAGES * PAGE - len(system))
    mch = pool.chain(miss)
    t0 = time.perf_counter()
    for _ in range(200):
        assert pool.lookup(miss, mch) is None
    t_miss = (time.perf_counter() - t0) / 200
    pool.sanity_check()
    print(f"pool: {ENTRIES} entries x {PAGES} pages of {PAGE} tokens, {STATE} B states")
    print(f"  insert          {t_insert * 1e6:9.1f} us/op  (hashes {PAGES} pages)")
    print(f"  chain (hash)    {t_chain * 1e6:9.1f} us/op  ({PAGES * PAGE + 3} tokens)")
    print(f"  lookup (hit)    {t_lookup * 1e6:9.1f} us/op")
    print(f"  lookup (miss)   {t_miss * 1e6:9.1f} us/op")


def bench_mac(size: int = 16 << 20, rounds: int = 8) -> None:
    """What authenticating a state costs: the file format's HMAC-SHA256 against the
    unkeyed xxh3 it replaced and a keyed BLAKE2b."""
    data = np.random.default_rng(2).integers(0, 256, size, dtype=np.uint8).tobytes()
    key = os.urandom(32)
    candidates = {
        "hmac-sha256": lambda: hmac.new(key, data, hashlib.sha256).digest(),
        "blake2b keyed": lambda: hashlib.blake2b(data, key=key).digest(),
        "xxh3-128 (no key)": lambda: xxhash.xxh3_128(data).digest(),
    }
    print(f"mac: {size >> 20} MiB state, best of {rounds}")
    for name, f in candidates.items():
        best = float("inf")
        for _ in range(rounds):
            t0 = time.perf_counter()
            f()
            best = min(best, time.perf_counter() - t0)
        print(f"  {name:18} {best * 1e3:7.1f} ms  ({size / best / 1e9:5.2f} GB/s)")


def bench_disk(size: int = 16 << 20, rounds: int = 4) -> None:
    data = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    whole = split(data, sections=0, page_size=PAGE, chain=()).rest  # a state kept whole
    key = os.urandom(32)
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        w = r = 0.0
        for i in range(rounds):
            rec = new_record(
                kind=Kind.FULL,
                owner=Owner.TARGET,
                lane=None,
                tokens=list(range(i, i + 2048)),
                fingerprint="bench",
                tenant="",
                state_format=1,
                nbytes=size,
                role=Role.BRANCH,
                created=0.0,
                page_size=PAGE,
                rest_nbytes=len(whole),
            )
            t0 = time.perf_counter()
            write_checkpoint(d, rec, whole, key)
            w += time.perf_counter() - t0
            t0 = time.perf_counter()
            _, back = read_checkpoint(d / f"{rec.id}.ckpt", key)
            r += time.perf_counter() - t0
            assert len(assemble(back, [])) == size
        mb = size * rounds / 1e6
        print(f"disk: {rounds} x {size >> 20} MiB states in {tmp}")
        print(f"  write (fsync)   {mb / w:9.0f} MB/s")
        print(f"  read (+MAC)     {mb / r:9.0f} MB/s  (page cache warm)")


OPS = ("insert_us", "restore_ram_us", "restore_disk_us")


def ops_run(root: Path, extra: list[str]) -> dict[str, float]:
    """One run of bench/pool_ops.py (this checkout's file) on ``root``'s statecache."""
    script = Path(__file__).with_name("pool_ops.py")
    code = ("import runpy, sys; sys.argv = [sys.argv[0], *sys.argv[1:]]; "
            f"runpy.run_path({str(script)!r}, run_name='__main__')")
    out = subprocess.run([sys.executable, "-c", code, *extra], cwd=root, check=True,
                         capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def against(rev: str, repeats: int, extra: list[str]) -> dict[str, object]:
    """This checkout against ``rev``, run by run: each operation's times and the ratios."""
    runs: dict[str, list[dict[str, float]]] = {"this": [], rev: []}
    with checkout(rev) as other:
        roots = {"this": ROOT, rev: other}
        for i in range(repeats):
            order = ["this", rev] if i % 2 == 0 else [rev, "this"]
            for name in order:
                runs[name].append(ops_run(roots[name], extra))
    result: dict[str, object] = {"against": rev, "repeats": repeats, "runs": runs}
    for op in OPS:
        ratios = sorted(a[op] / b[op] for a, b in zip(runs["this"], runs[rev], strict=True))
        row: dict[str, float] = {"median": statistics.median(ratios), "low": ratios[0],
                                 "high": ratios[-1],
                                 "this_us": statistics.median(r[op] for r in runs["this"]),
                                 "other_us": statistics.median(r[op] for r in runs[rev])}
        ci = median_ci(ratios)
        if ci is not None:
            row["ci_low"], row["ci_high"] = ci
        result[op] = row
    return result


def table(result: dict[str, Any]) -> str:
    rev = result["against"]
    lines = [f"pool operations, this checkout against {rev}: time per operation, the ratio "
             f"this / {rev} run by run ({result['repeats']} repeats), its median and 95% "
             "confidence interval (the lowest and highest where too few repeats)",
             f"{'operation':18} {'this us':>10} {rev + ' us':>14} {'ratio':>7}  interval"]
    for op in OPS:
        r = result[op]
        lo, hi = r.get("ci_low", r["low"]), r.get("ci_high", r["high"])
        lines.append(f"{op.removesuffix('_us'):18} {r['this_us']:10.1f} {r['other_us']:14.1f} "
                     f"{r['median']:7.3f}  {lo:.3f}-{hi:.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.pool")
    p.add_argument("--against", metavar="REV", default="",
                   help="the pool's operations here against git revision REV, run by run")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--json", default="", help="where to write the result (--against)")
    a = p.parse_args(argv)
    if not a.against:
        bench_pool()
        bench_mac()
        bench_disk()
        return 0
    extra = ["--conversations", str(a.conversations), "--tokens", str(a.tokens)]
    result = against(a.against, a.repeats, extra)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
