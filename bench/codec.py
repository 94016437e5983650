"""What compression buys on real states: ``python -m bench.codec``.

For each memory kind, a state after a long prompt is cut into its KV pages and its rest
(statecache.kvpages); each codec and level compresses every page and the rest, and the
table gives the bytes kept (stored / raw) and the compress and decompress rates of one
thread. The disk tier and the shared tier write through statecache.formats.codec; its level is
chosen from this table (docs/design.md, "Compression").
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from pathlib import Path

import lz4.frame
import numpy as np
import zstandard

from proxy.engine.binding import FLAGS_FULL, Context, ContextParams, Model
from statecache.kvpages import split
from statecache.pages import PageChain, namespace_hash

P = 32
# The prose they prefill: the README as it stood at dc409ae (1,103 lines), frozen so that
# a README rewrite does not change the workload these figures were measured on.
TEXT = Path(__file__).resolve().parent / "texts" / "prose.md"


def _shuffle(data: bytes, width: int) -> bytes:
    """Byte planes of ``width``-byte words (the exponents of floats end up together)."""
    n = len(data) // width * width
    arr = np.frombuffer(data, dtype=np.uint8, count=n).reshape(-1, width)
    return arr.T.tobytes() + data[n:]


def codecs() -> dict[str, Callable[[bytes], bytes]]:
    out: dict[str, Callable[[bytes], bytes]] = {
        "lz4": lambda b: lz4.frame.compress(b, store_size=False)}
    for level in (1, 3, 6, 9):
        c = zstandard.ZstdCompressor(level=level)
        out[f"zstd-{level}"] = c.compress
    c1 = zstandard.ZstdCompressor(level=1)
    out["shuffle2+zstd-1"] = lambda b: c1.compress(_shuffle(b, 2))
    out["shuffle4+zstd-1"] = lambda b: c1.compress(_shuffle(b, 4))
    return out


def _decompress(name: str) -> Callable[[bytes], bytes]:
    if name == "lz4":
        return lz4.frame.decompress
    d = zstandard.ZstdDecompressor()
    return lambda b: d.decompress(b, max_output_size=1 << 30)


def pieces(model_path: Path, n_tokens: int) -> tuple[str, list[bytes], bytes]:
    """The memory kind, the KV pages and the rest of a FULL state after ``n_tokens``."""
    with Model(model_path) as m, Context(m, ContextParams(n_ctx=n_tokens + 64, n_seq_max=1,
                                                          n_batch=512, n_ubatch=512)) as ctx:
        mem = ctx.describe_memory()
        text = TEXT.read_text()
        toks = m.tokenize(text * (1 + n_tokens * 4 // max(len(text), 1)))[:n_tokens]
        ctx.prefill(0, toks, 0, logits_last=False)
        blob = bytes(ctx.save(0, FLAGS_FULL))
        chain = PageChain(namespace_hash(m.fingerprint, ""), P, toks).hashes
        sp = split(blob, sections=mem.kv_sections, page_size=P, chain=chain)
        return mem.kind.value, [sp.page(i) for i in range(len(sp.keys))], bytes(sp.rest)


def measure(parts: list[bytes]) -> dict[str, tuple[float, float, float]]:
    """codec -> (stored / raw, compress MB/s, decompress MB/s) over ``parts``."""
    raw = sum(map(len, parts))
    out = {}
    for name, f in codecs().items():
        t0 = time.perf_counter()
        packed = [f(p) for p in parts]
        tc = time.perf_counter() - t0
        if name.startswith("shuffle"):
            td = float("nan")  # decompression as zstd's, plus the unshuffle
        else:
            d = _decompress(name)
            t0 = time.perf_counter()
            for p in packed:
                d(p)
            td = time.perf_counter() - t0
        out[name] = (sum(map(len, packed)) / raw, raw / tc / 1e6, raw / td / 1e6)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", action="append", type=Path,
                    help="GGUF (repeat); default: the plain, SWA and hybrid test models")
    ap.add_argument("--tokens", type=int, default=4000)
    args = ap.parse_args(argv)
    from proxy.models import gemma_model_path

    models = args.model or [Path("models/draft-tiny.gguf"), gemma_model_path(),
                            Path("models/hybrid-tiny.gguf"), Path("models/hybrid-mid.gguf")]
    print("| model | memory | part | raw MiB | codec | stored/raw | compress MB/s "
          "| decompress MB/s |")
    print("|---|---|---|---|---|---|---|---|")
    for path in models:
        kind, pages, rest = pieces(path, args.tokens)
        for part, items in (("KV pages", pages), ("rest", [rest])):
            raw = sum(map(len, items)) / (1 << 20)
            if not items or raw == 0:
                continue
            for name, (ratio, c, d) in measure(items).items():
                print(f"| {path.name} | {kind} | {part} | {raw:.2f} | {name} | {ratio:.3f} "
                      f"| {c:,.0f} | {d:,.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
