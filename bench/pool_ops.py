"""One run of the pool's three operations, timed, as JSON on stdout: insert a FULL state
(cut into KV pages), restore one from RAM (lookup, assembled or kept whole, released),
restore one from disk (read, authenticated, assembled, back into RAM).

    python bench/pool_ops.py [--conversations 16] [--tokens 1024] [--rounds 5]

It uses only the pool's public face (``CheckpointPool``, ``CacheConfig``) and no module
of bench, so ``python -m bench.pool --against REV`` runs this same file against another
commit's statecache: ``runpy`` from that checkout's folder, which puts its packages
first on the path. The states are written the way llama.cpp lays out a sequence state
(docs/design.md, "The layout of a sequence state"): one attention cache of two layers,
rows that depend on the conversation and the position, and a recurrent tail.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import tempfile
import time

SEQ_MAGIC = 0xAF143CD8  # llama_context::state_seq_get_data's io_magic
LAYERS = 2
ROW = 128  # bytes of a K row and of a V row: 512 bytes of KV a token
PAGE = 32


def state(conv: int, n: int) -> bytes:
    """Conversation ``conv``'s FULL state after ``n`` tokens, saved from lane 0."""
    out = [struct.pack("<Ii", SEQ_MAGIC, 0), struct.pack("<II", 1, n)]
    out += [struct.pack("<iIi", p, 1, 0) for p in range(n)]
    out.append(struct.pack("<II", 0, LAYERS))
    for kind in (0, 1):  # K rows, then V rows
        for layer in range(LAYERS):
            out.append(struct.pack("<iQ", 1, ROW))
            seed = hashlib.blake2b(struct.pack("<iii", conv, layer, kind)).digest()
            out += [(seed * (ROW // len(seed) + 1))[:ROW - 4] + struct.pack("<i", p)
                    for p in range(n)]
    out.append(hashlib.blake2b(struct.pack("<ii", conv, n)).digest() * 8)
    return b"".join(out)


def tokens(conv: int, n: int) -> list[int]:
    return [(conv * 7919 + i * 31) % 50_000 for i in range(n)]


def run(conversations: int, n_max: int, rounds: int) -> dict[str, float]:
    from statecache.config import CacheConfig
    from statecache.pool import CheckpointPool
    from statecache.records import Kind, Owner, Role

    points = [(c, n) for c in range(conversations) for n in range(n_max // 4, n_max + 1,
                                                                  n_max // 4)]
    states = {p: state(*p) for p in points}
    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        cfg = CacheConfig(page_size=PAGE, ram_budget=1 << 30, disk_path=f"{tmp}/ckpt",
                          disk_budget=1 << 32, secret_path=f"{tmp}/key/secret.key",
                          disk_enabled=False)

        def insert_all(pool: CheckpointPool) -> float:
            t0 = time.perf_counter()
            for c, n in points:
                rec = pool.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None,
                                  tokens=tokens(c, n), role=Role.END_OF_REPLY,
                                  data=states[c, n])
                assert rec is not None
            return time.perf_counter() - t0

        def restore_all(pool: CheckpointPool) -> float:
            t0 = time.perf_counter()
            for c, n in points:
                toks = tokens(c, n + 3)  # a follow-up: the state is its deepest prefix
                lease = pool.lookup(toks, pool.chain(toks), max_n=n)
                assert lease is not None and lease.record.n == n
                assert len(lease.data) == len(states[c, n])
                lease.close()
            return time.perf_counter() - t0

        ram = CheckpointPool(cfg, "bench-pool", kv_sections=1)
        out["insert_us"] = insert_all(ram) / len(points) * 1e6
        # the states stay in RAM: each round restores every one of them again
        times = sorted(restore_all(ram) for _ in range(rounds))
        out["restore_ram_us"] = times[len(times) // 2] / len(points) * 1e6
        ram.close()
        on_disk = CheckpointPool(CacheConfig(**{**_fields(cfg), "disk_enabled": True}),
                                 "bench-pool", kv_sections=1)
        insert_all(on_disk)
        on_disk.flush()
        on_disk.close()
        again = CheckpointPool(CacheConfig(**{**_fields(cfg), "disk_enabled": True}),
                               "bench-pool", kv_sections=1)  # every state on disk alone
        out["restore_disk_us"] = restore_all(again) / len(points) * 1e6
        again.close()
    out["states"] = len(points)
    return out


def _fields(cfg: object) -> dict[str, object]:
    import dataclasses

    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/pool_ops.py")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--tokens", type=int, default=1024, help="the longest state's tokens")
    p.add_argument("--rounds", type=int, default=5, help="restores from RAM of every state "
                   "(the median round counts)")
    a = p.parse_args(argv)
    print(json.dumps(run(a.conversations, a.tokens, a.rounds)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
