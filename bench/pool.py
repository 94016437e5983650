"""Micro-benchmark of the pool: `python -m bench.pool`."""

from __future__ import annotations

import hashlib
import hmac
import os
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

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


if __name__ == "__main__":
    bench_pool()
    bench_mac()
    bench_disk()
