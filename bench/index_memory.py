"""What the disk tier's index keeps in memory per checkpoint: ``python -m bench.index_memory``.

Writes ``--conversations`` conversations of ``--checkpoints`` FULL checkpoints each (every
``--tokens / --checkpoints`` tokens up to ``--tokens``; states laid out as llama.cpp writes
them, one KV section, so each conversation's checkpoints share their KV pages on disk) into
a disk directory (``--dir``, by default a temporary one under /dev/shm: the page files'
fdatasyncs cost nothing there), then opens a new pool on it, as a restart does, and
reports the memory that pool holds for the entries it found (tracemalloc, and the
process's RSS). Then it looks up every conversation's deepest checkpoint: by the index
alone (``full_offers``) and read from disk (``lookup``: record file, pages, MAC,
assembly), each checked against the state that was saved, and reports the memory again.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import struct
import tempfile
import time
import tracemalloc
from pathlib import Path

import numpy as np

from statecache.config import CacheConfig
from statecache.kvpages import SEQ_MAGIC
from statecache.pool import CheckpointPool
from statecache.records import Kind, Owner, Role
from statecache.tiers.disk import DiskTier

FP = "bench-index-memory"
PAGE = 32
LAYERS = 2
ROW = 8  # bytes of a K row and of a V row: small, the pages' bytes are not measured here
TAIL = 4096  # a recurrent state's bytes (kept in each record file's rest)
VOCAB = 150_000


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def conversation(conv: int, n_max: int) -> tuple[np.ndarray, np.ndarray]:
    """A conversation's tokens and its KV rows (by position only, as in a live lane)."""
    rng = np.random.default_rng(conv)
    tokens = rng.integers(0, VOCAB, n_max, dtype=np.int32)
    rows = rng.integers(0, 256, (2 * LAYERS, n_max, ROW), dtype=np.uint8)
    return tokens, rows


def state(rows: np.ndarray, n: int, conv: int) -> bytes:
    """The FULL state after ``n`` tokens (tests/unit/kvstate.py's layout, vectorized)."""
    cells = np.zeros(n, dtype=[("pos", "<i4"), ("nseq", "<u4"), ("seq", "<i4")])
    cells["pos"] = np.arange(n)
    cells["nseq"] = 1
    out = [struct.pack("<Ii", SEQ_MAGIC, 0), struct.pack("<II", 1, n), cells.tobytes(),
           struct.pack("<II", 0, LAYERS)]
    for kind in (0, 1):
        for layer in range(LAYERS):
            out.append(struct.pack("<iQ", 1, ROW))
            out.append(rows[2 * layer + kind, :n].tobytes())
    out.append(np.random.default_rng((conv, n)).bytes(TAIL))
    return b"".join(out)


def _cfg(d: Path, ram: int) -> CacheConfig:
    return CacheConfig(page_size=PAGE, ram_budget=ram, disk_path=str(d / "ckpt"),
                       disk_budget=1 << 40, secret_path=str(d / "keys" / "secret.key"))


def _points(n_max: int, k: int) -> list[int]:
    step = n_max // k
    return [step * (i + 1) for i in range(k)]


def write(d: Path, convs: int, k: int, n_max: int) -> float:
    # RAM smaller than any state: each goes straight to disk, in the inserting thread
    pool = CheckpointPool(_cfg(d, 1 << 20), FP, kv_sections=1)
    t0 = time.perf_counter()
    for c in range(convs):
        tokens, rows = conversation(c, n_max)
        for n in _points(n_max, k):
            rec = pool.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None,
                              tokens=tokens[:n], role=Role.PERIODIC, data=state(rows, n, c))
            assert rec is not None, "the disk refused a checkpoint"
    pool.close()
    return time.perf_counter() - t0


def measure(d: Path, convs: int, k: int, n_max: int, reads: int, trace: bool
            ) -> dict[str, float]:
    gc.collect()
    if trace:  # its own bookkeeping counts in the RSS
        tracemalloc.start()
    rss0, (t0_bytes, _) = _rss(), tracemalloc.get_traced_memory()
    t0 = time.perf_counter()
    pool = CheckpointPool(_cfg(d, 1 << 20), FP, kv_sections=1)
    t_open = time.perf_counter() - t0
    gc.collect()
    held = tracemalloc.get_traced_memory()[0] - t0_bytes
    rss_held = _rss() - rss0
    tracemalloc.stop()
    entries = pool.stats().tier(DiskTier.name).entries
    assert entries == convs * k, f"{entries} entries found, {convs * k} written"
    tokens_held = convs * sum(_points(n_max, k))
    offers, reads_s = [], []
    for c in range(convs):
        tokens, rows = conversation(c, n_max)
        ask = np.concatenate([tokens, np.array([7], dtype=np.int32)])
        chain = pool.chain(ask)
        t0 = time.perf_counter()
        got = pool.full_offers(ask, chain, max_n=n_max)
        offers.append(time.perf_counter() - t0)
        assert [o.n for o in got] == [n_max], got
        if c < reads:
            t0 = time.perf_counter()
            lease = pool.lookup(ask, chain, max_n=n_max)
            reads_s.append(time.perf_counter() - t0)
            assert lease is not None and lease.record.n == n_max and lease.tier == DiskTier.name
            with lease:
                assert bytes(lease.data) == state(rows, n_max, c)
    gc.collect()
    after = _rss() - rss0
    pool.sanity_check()
    pool.close()
    return {"entries": entries, "tokens": tokens_held, "held": held, "rss": rss_held,
            "rss_after_lookups": after, "open_s": t_open,
            "offer_ms": statistics.median(offers) * 1e3,
            "read_ms": statistics.median(reads_s) * 1e3 if reads_s else 0.0}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--checkpoints", type=int, default=10, help="per conversation")
    p.add_argument("--tokens", type=int, default=20_000, help="the deepest checkpoint's n")
    p.add_argument("--reads", type=int, default=10, help="conversations read back from disk")
    p.add_argument("--dir", type=Path, help="default: a temporary directory under /dev/shm")
    p.add_argument("--rss-only", action="store_true",
                   help="no tracemalloc (whose bookkeeping the RSS counts otherwise)")
    a = p.parse_args()
    base = a.dir or Path(tempfile.mkdtemp(prefix="statecache-index-",
                                          dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    try:
        t_write = write(base, a.conversations, a.checkpoints, a.tokens)
        r = measure(base, a.conversations, a.checkpoints, a.tokens, a.reads, not a.rss_only)
    finally:
        if a.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    e = r["entries"]
    print(f"{e:,} FULL checkpoints on disk ({a.conversations} conversations x "
          f"{a.checkpoints}, up to {a.tokens:,} tokens; {r['tokens']:,} tokens in all), "
          f"written in {t_write:.1f} s")
    held = "" if a.rss_only else (
        f"it holds {r['held'] / 2**20:.1f} MiB (tracemalloc): {r['held'] / e:,.0f} B per "
        f"entry, {r['held'] / r['tokens']:.2f} B per token of the entries; ")
    print(f"pool opened on them in {r['open_s']:.2f} s; {held}RSS +"
          f"{r['rss'] / 2**20:.1f} MiB, +{r['rss_after_lookups'] / 2**20:.1f} MiB after "
          f"the lookups")
    print(f"deepest checkpoint of a conversation: by the index {r['offer_ms']:.2f} ms, read "
          f"from disk and assembled {r['read_ms']:.1f} ms (medians)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
