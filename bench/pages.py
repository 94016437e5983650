"""Bytes a long cold prompt's checkpoints take, whole states against KV pages:
``python -m bench.pages --model models/hybrid-tiny.gguf --tokens 77774``.

One prefill of ``--tokens`` tokens, a FULL checkpoint every ``--every`` tokens (the
periodic points of a long first turn), each state inserted into two pools with the
same bytes: **whole** (every state kept whole, on disk uncompressed: the layout before
KV pages) and **pages** (this version: KV pages held once, zstd where it pays). For each:
bytes held in RAM and on disk against the ideal (the longest prompt's state plus, for
every other checkpoint, what does not grow with its length: a hybrid's recurrent state,
an SWA model's window; the bytes a token adds measured between the last two states),
insert time (save and insert, as the engine does them), the deepest checkpoint's
restore time (lookup + assemble + ``set_data``) from RAM and from disk (page cache
dropped), and how many such conversations a RAM budget holds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from proxy.engine.binding import FLAGS_FULL, Context, ContextParams, Model
from statecache.config import CacheConfig
from statecache.pool import CheckpointPool
from statecache.records import Kind, Owner, Record, Role
from statecache.sizes import format_size, parse_size
from statecache.tiers.disk import DiskTier
from statecache.tiers.ram import RamTier

# The prose they prefill: the README as it stood at dc409ae (1,103 lines), frozen so that
# a README rewrite does not change the workload these figures were measured on.
TEXT = Path(__file__).resolve().parent / "texts" / "prose.md"


def _drop_cache(d: Path) -> None:
    for root, _, files in os.walk(d):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)


def _restore_s(pool: CheckpointPool, ctx: Context, tokens: list[int], n: int,
               repeats: int, drop: Path | None = None) -> tuple[float, str]:
    """Median seconds of lookup + assemble + restore of the state after ``n`` tokens."""
    times = []
    tier = ""
    for _ in range(repeats):
        if drop is not None:
            _drop_cache(drop)
        t0 = time.perf_counter()
        chain = pool.chain(tokens)
        lease = pool.lookup(tokens, chain, max_n=n)
        assert lease is not None and lease.record.n == n
        with lease:
            assert ctx.restore(1, lease.data, FLAGS_FULL)
            tier = lease.tier
        times.append(time.perf_counter() - t0)
        ctx.clear_lane(1)
    return statistics.median(times), tier


def _save(ctx: Context, pool: CheckpointPool, tokens: list[int]) -> Record | None:
    """Lane 0's state into ``pool`` as the engine saves it (publishing.save): where RAM
    keeps states whole, written into a buffer the pool keeps; else copied from the
    context's buffer."""
    if not pool.keeps_whole:
        return pool.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=tokens,
                           role=Role.PERIODIC, data=ctx.save(0, FLAGS_FULL))
    buf = pool.state_buffer(ctx.state_size(0, FLAGS_FULL))
    ctx.save_into(0, buf, FLAGS_FULL)
    return pool.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=tokens,
                       role=Role.PERIODIC, data=buf, owned=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", type=Path, default=Path("models/hybrid-tiny.gguf"))
    ap.add_argument("--tokens", type=int, default=77_774)
    ap.add_argument("--every", type=int, default=2048, help="tokens between checkpoints")
    ap.add_argument("--budget", default="2GiB", help="RAM budget for 'conversations held'")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", type=Path, help="write the result here too (bench.run)")
    args = ap.parse_args(argv)
    budget = parse_size(args.budget)
    with Model(args.model) as m, tempfile.TemporaryDirectory() as tmp, \
            Context(m, ContextParams(n_ctx=2 * (args.tokens + 512), n_seq_max=2,
                                     n_batch=512, n_ubatch=512)) as ctx:
        mem = ctx.describe_memory()
        text = TEXT.read_text()
        toks: list[int] = []
        while len(toks) < args.tokens + 1:
            toks += m.tokenize(text)
        toks = toks[:args.tokens]
        kinds = {"whole": (0, 0), "pages": (mem.kv_sections, 1)}
        pools: dict[str, CheckpointPool] = {}
        for name, (sections, level) in kinds.items():
            cfg = CacheConfig(ram_budget=64 << 30, disk_budget=1 << 40, disk_path=f"{tmp}/{name}",
                              secret_path=f"{tmp}/key", compress_level=level)
            pools[name] = CheckpointPool(cfg, m.fingerprint, kv_sections=sections)
        insert_s = {k: 0.0 for k in kinds}
        ends = list(range(args.every, args.tokens, args.every)) + [args.tokens]
        sizes: list[int] = []
        pos = 0
        t_prefill = 0.0
        for end in ends:
            t0 = time.perf_counter()
            ctx.prefill(0, toks[pos:end], pos, logits_last=False)
            t_prefill += time.perf_counter() - t0
            pos = end
            sizes.append(ctx.state_size(0, FLAGS_FULL))
            for name, pool in pools.items():
                t0 = time.perf_counter()
                rec = _save(ctx, pool, toks[:end])
                insert_s[name] += time.perf_counter() - t0
                assert rec is not None
        last = sizes[-1]
        n = len(ends)
        per_token = (sizes[-1] - sizes[-2]) / (ends[-1] - ends[-2])
        fixed = [max(0.0, s - per_token * e) for s, e in zip(sizes[:-1], ends[:-1], strict=True)]
        ideal = int(last + sum(fixed))
        print(f"{args.model.name} ({mem.kind.value}): {args.tokens:,} tokens prefilled in "
              f"{t_prefill:.1f} s, {n} FULL checkpoints, every {args.every:,} tokens; the "
              f"last state {format_size(last)}; ideal {format_size(ideal)} (the last state "
              f"+ {n - 1} x {format_size(int(sum(fixed) / max(n - 1, 1)))}, at "
              f"{per_token:,.0f} B a token)")
        rows = []
        for name, pool in pools.items():
            t0 = time.perf_counter()
            pool.flush()
            flush_s = time.perf_counter() - t0
            s = pool.stats()
            pool.sanity_check()
            ram_s, _ = _restore_s(pool, ctx, toks + [1], args.tokens, args.repeats)
            pool.close()
            cfg = CacheConfig(ram_budget=1 << 20, disk_budget=1 << 40,
                              disk_path=f"{tmp}/{name}", secret_path=f"{tmp}/key",
                              compress_level=kinds[name][1])
            cold = CheckpointPool(cfg, m.fingerprint, kv_sections=kinds[name][0])
            disk_s, tier = _restore_s(cold, ctx, toks + [1], args.tokens, args.repeats,
                                      drop=Path(tmp) / name)
            assert tier == DiskTier.name, tier
            cold.close()
            rows.append((name, s, flush_s, ram_s, disk_s))
        result = {"model": args.model.name, "memory": mem.kind.value, "tokens": args.tokens,
                  "checkpoints": n, "last_state": last, "ideal": ideal, "budget": budget,
                  "layouts": [{"layout": name, "ram_bytes": s.tier(RamTier.name).bytes,
                               "disk_bytes": s.tier(DiskTier.name).bytes,
                               "insert_ms": insert_s[name] / n * 1e3, "flush_s": flush_s,
                               "restore_ram_ms": ram_s * 1e3, "restore_disk_ms": disk_s * 1e3,
                               "conversations": budget / max(s.tier(RamTier.name).bytes, 1)}
                              for name, s, flush_s, ram_s, disk_s in rows]}
    print("\n".join(table([result])))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def table(results: list[dict[str, Any]]) -> list[str]:
    """One row per model and layout; restore and conversations against whole states."""
    out = ["| model (memory), tokens, checkpoints | layout | RAM held (x ideal) | disk written "
           "(x ideal) | insert ms/ckpt | restore RAM / disk ms | x whole | conversations in "
           "budget |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        ideal = max(r["ideal"], 1)
        base = r["layouts"][0]
        for i, row in enumerate(r["layouts"]):
            head = (f"{r['model']} ({r['memory']}), {r['tokens']:,}, {r['checkpoints']}"
                    if i == 0 else "")
            vs = (f"{row['restore_ram_ms'] / max(base['restore_ram_ms'], 1e-9):.2f} / "
                  f"{row['restore_disk_ms'] / max(base['restore_disk_ms'], 1e-9):.2f}")
            out.append(f"| {head} | {row['layout']} | {format_size(row['ram_bytes'])} "
                       f"({row['ram_bytes'] / ideal:.2f}) | {format_size(row['disk_bytes'])} "
                       f"({row['disk_bytes'] / ideal:.2f}) | {row['insert_ms']:.1f} "
                       f"| {row['restore_ram_ms']:.1f} / {row['restore_disk_ms']:.1f} | {vs} "
                       f"| {row['conversations']:.1f} in {format_size(r['budget'])} |")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
