"""Micro-benchmarks, each against the floor it should be compared with.

1. Checkpoint save / restore (``proxy.engine.binding.Context.save/restore`` of a real
   lane) against a numpy copy of the same bytes.
2. Disk tier write (with its fsync) and read (with its digest check) of that
   state against plain sequential file I/O of the same size in the same
   directory, fsync included, page cache warm for both reads.
3. The proxy's overhead: a cold request's TTFT and the decode rate through the
   HTTP proxy against the same tokens prefilled and decoded by
   ``proxy.engine.binding`` directly (no HTTP, no planner, no checkpoints).

    python -m bench.micro --model PATH --json out.json [--tokens N] [--repeats R]

Run in its own process so the model it loads is gone before anything else runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

Stat = dict[str, float]


def _stat(xs: list[float]) -> Stat:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def _times(fn: Callable[[], object], repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _rate(nbytes: int, ts: list[float]) -> Stat:
    return _stat([nbytes / t / 1e9 for t in ts])


def _prompt_tokens(model: Any, n: int, seed: int) -> list[int]:
    import random

    from bench.workload import _text

    toks = model.tokenize(_text(random.Random(seed), n * 6))[:n]
    return ([model.bos] if model.add_bos and model.bos >= 0 else []) + toks[: n - 1]


def state_io(ctx: Any, model: Any, n_tokens: int, repeats: int) -> tuple[dict[str, Any], bytes]:
    from proxy.engine.binding import FLAGS_FULL

    ctx.clear_all()
    ctx.prefill(0, _prompt_tokens(model, n_tokens, 1), 0, logits_last=False)
    data = bytes(ctx.save(0, FLAGS_FULL))
    n = len(data)
    save = _times(lambda: ctx.save(0, FLAGS_FULL), repeats)

    def restore() -> None:
        if not ctx.restore(1, data, FLAGS_FULL):
            raise RuntimeError("restore failed")

    rest = _times(restore, repeats)
    src = np.frombuffer(data, dtype=np.uint8)
    dst = src.copy()  # touched once, so no copy below pays for page faults
    copy = _times(lambda: np.copyto(dst, src), repeats)
    ctx.clear_all()
    return {"tokens": n_tokens, "bytes": n, "save_GBps": _rate(n, save),
            "restore_GBps": _rate(n, rest), "numpy_copy_GBps": _rate(n, copy)}, data


def disk_io(data: bytes, directory: Path, repeats: int) -> dict[str, Any]:
    from statecache.kvpages import assemble, split
    from statecache.records import Kind, Owner, Role, new_record
    from statecache.tiers.disk import DiskTier

    n = len(data)
    whole = split(data, sections=0, page_size=32, chain=()).rest  # a state kept whole
    tier = DiskTier(directory / "tier", 1 << 40, "micro", state_format=1, page_size=32)
    w: list[float] = []
    r: list[float] = []
    for i in range(repeats):
        rec = new_record(kind=Kind.FULL, owner=Owner.TARGET, lane=None,
                         tokens=list(range(i, i + 2048)), fingerprint="micro", tenant="",
                         state_format=1, nbytes=n, role=Role.BRANCH, created=0.0,
                         page_size=32, rest_nbytes=len(whole))
        t0 = time.perf_counter()  # as the pool's writer: reserve, write, commit
        which = tier.reserve(rec, [])
        if which is None or not tier.commit(rec.id, *tier.write_file(rec, whole, [], which)):
            raise RuntimeError("disk tier refused the write")
        w.append(time.perf_counter() - t0)
        t0 = time.perf_counter()  # as a lookup: read and verify, then mark it used
        back = tier.read_file(rec, rec.keys)
        tier.touch(rec.id)
        tier.utime(rec.id)
        r.append(time.perf_counter() - t0)
        if len(assemble(back.rest, [])) != n:
            raise RuntimeError("disk tier read failed")
    pw: list[float] = []
    pr: list[float] = []
    for i in range(repeats):
        path = directory / f"plain-{i}.bin"
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        pw.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            f.read()
        pr.append(time.perf_counter() - t0)
    return {"bytes": n, "tier_write_GBps": _rate(n, w), "tier_read_GBps": _rate(n, r),
            "file_write_GBps": _rate(n, pw), "file_read_GBps": _rate(n, pr)}


def direct_generation(ctx: Any, model: Any, n_prompt: int, n_out: int,
                      repeats: int) -> dict[str, Any]:
    """Cold prefill + greedy decode with proxy.engine.binding alone."""
    ttft: list[float] = []
    tps: list[float] = []
    for i in range(-1, repeats):  # i = -1: warm-up, not counted
        ctx.clear_all()
        toks = _prompt_tokens(model, n_prompt, 100 + i)
        t0 = time.perf_counter()
        logits = ctx.prefill(0, toks, 0)
        assert logits is not None
        tok = int(np.argmax(logits))
        t1 = time.perf_counter()
        pos = len(toks)
        n = 1
        for _ in range(n_out - 1):
            if model.is_eog(tok):
                break
            logits = ctx.prefill(0, [tok], pos)
            assert logits is not None
            tok = int(np.argmax(logits))
            pos += 1
            n += 1
        t2 = time.perf_counter()
        if i >= 0:
            ttft.append(t1 - t0)
            tps.append((n - 1) / (t2 - t1))
    ctx.clear_all()
    return {"prompt_tokens": n_prompt, "ttft_s": _stat(ttft), "decode_tps": _stat(tps)}


def proxy_generation(model_path: Path, model: Any, n_ctx: int, n_prompt: int, n_out: int,
                     repeats: int, log_dir: Path) -> dict[str, Any]:
    """The same through ``statecache serve`` over HTTP (cache on, prompts never seen)."""
    from bench.harness import stream_chat_completion
    from bench.servers import ModelSpec, running

    spec = ModelSpec("micro", model_path, is_gemma=False)
    ttft: list[float] = []
    tps: list[float] = []
    with running("statecache", spec, n_ctx=n_ctx, lanes=1, log_dir=log_dir) as srv:
        for i in range(-1, repeats):  # i = -1: warm-up, not counted
            toks = _prompt_tokens(model, n_prompt, 100 + i)
            text = model.detokenize(toks[1:] if toks and toks[0] == model.bos else toks)
            ttft_s, n, span = stream_chat_completion(srv.url, text, n_out)
            if i >= 0:
                ttft.append(ttft_s)
                tps.append((n - 1) / span if n > 1 and span > 0 else float("nan"))
    return {"prompt_tokens": n_prompt, "ttft_s": _stat(ttft), "decode_tps": _stat(tps)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.micro")
    p.add_argument("--model", required=True)
    p.add_argument("--json", required=True)
    p.add_argument("--tokens", type=int, default=2048, help="lane length for state sizes")
    p.add_argument("--prompt", type=int, default=1024, help="cold prompt for the overhead test")
    p.add_argument("--out-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--log-dir", default="results/logs")
    a = p.parse_args(argv)
    from proxy.engine.binding import Context, ContextParams, Model

    n_ctx = max(a.tokens, a.prompt + a.out_tokens) + 256
    out: dict[str, Any] = {"model": Path(a.model).name}
    model = Model(a.model)
    ctx = Context(model, ContextParams(n_ctx=2 * n_ctx, n_seq_max=2, n_batch=512, n_ubatch=512))
    try:
        out["state"], data = state_io(ctx, model, a.tokens, a.repeats)
        with tempfile.TemporaryDirectory(dir=Path(a.log_dir).parent) as tmp:
            out["disk"] = disk_io(data, Path(tmp), a.repeats)
        out["direct"] = direct_generation(ctx, model, a.prompt, a.out_tokens,
                                          max(3, a.repeats // 2))
    finally:
        ctx.close()
    out["proxy"] = proxy_generation(Path(a.model), model, n_ctx, a.prompt, a.out_tokens,
                                    max(3, a.repeats // 2), Path(a.log_dir))
    model.close()
    Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
