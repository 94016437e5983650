"""The shared tier's refusals: how many fetches it refuses against how many it serves,
by reason, in a healthy run and in one whose store is tampered with.

    python -m bench.remote_faults --model models/hybrid-tiny.gguf [--conversations 6]
        [--turns 6] [--faults 8] [--local 1MiB] [--seed 1] [--root CHECKOUT]

Starts a valkey-server and three ``statecache serve`` processes on it: A and B share a
key (one deployment), S signs with a key of its own (another deployment on the same
store). Conversations that share a system prompt go turn by turn to A or B at random
(seeded), and S serves each turn too. Each proxy has ``--local`` of RAM and no disk,
so that a turn finds the states of the turns before in the store more often than in
its own tiers. Then (the faulty run) ``--faults`` of the store's
KV pages are overwritten with garbage, with another page's valid bytes, or deleted,
and the conversations go on. For each run it prints, per proxy, its hits, its refusals
by reason, refused / hits, and the share of prompt tokens reused. ``--root``: the
proxies from another checkout (a worktree of an older commit), for the same workload.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.remote import _ask, _text, valkey
from bench.servers import ModelSpec, Server, running

_REFUSED = "statecache_remote_rejected_total"


def _store_figures(s: Server) -> dict[str, float]:
    m = s.metrics()
    out = {k[len(_REFUSED) + 9:-2]: v for k, v in m.items() if k.startswith(_REFUSED + "{")}
    out["hits"] = m.get('statecache_remote_total{event="hits"}', 0.0)
    out["skipped"] = m.get('statecache_remote_total{event="skipped"}', 0.0)
    out["deleted"] = m.get('statecache_remote_total{event="deleted"}', 0.0)
    return out


def _delta(now: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in now.items() if v - before.get(k, 0.0)}


def _quiet(servers: list[Server], timeout: float = 60) -> None:
    """Wait until every proxy's write queue is empty."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if all(s.metrics().get("statecache_remote_write_queue", 0) == 0 for s in servers):
            return
        time.sleep(0.1)


def _turns(pair: list[Server], stranger: Server, convs: list[list[dict[str, Any]]], turns: int,
           rng: random.Random, max_tokens: int) -> tuple[int, int]:
    """``turns`` more turns of every conversation, each on A or B at random and on S;
    the prompt tokens A and B were sent and reused."""
    prompt = cached = 0
    for _ in range(turns):
        for msgs in convs:
            msgs.append({"role": "user", "content": _text(rng, 16)})
            r = _ask(pair[rng.randrange(2)], msgs, max_tokens)
            _ask(stranger, msgs, max_tokens)
            msgs.append(r["reply"])
            prompt += r["prompt"] or 0
            cached += r["cached"]
        time.sleep(0.5)  # idle: the end-of-reply states go out to the store
        _quiet([*pair, stranger])
    return prompt, cached


def _spoil(url: str, faults: int, rng: random.Random) -> dict[str, int]:
    """Overwrite or delete ``faults`` KV pages of the store (any key's)."""
    import redis

    r = redis.Redis.from_url(url)
    pages = sorted(r.scan_iter(match="*:p:*", count=1000))
    done = {"garbage": 0, "other page": 0, "deleted": 0}
    for name in rng.sample(pages, min(faults, len(pages))):
        how = rng.choice(list(done))
        if how == "garbage":
            r.set(name, rng.randbytes(200))
        elif how == "other page":
            other = r.get(rng.choice(pages))
            if other is not None:
                r.set(name, other)
        else:
            r.delete(name)
        done[how] += 1
    return done


def _report(run: str, servers: dict[str, Server], before: dict[str, dict[str, float]],
            prompt: int, cached: int) -> dict[str, Any]:
    out: dict[str, Any] = {"run": run, "reused": round(cached / max(prompt, 1), 3)}
    for name, s in servers.items():
        d = _delta(_store_figures(s), before[name])
        hits = d.pop("hits", 0.0)
        extra = {k: d.pop(k) for k in ("skipped", "deleted") if k in d}
        refused = sum(d.values())
        out[name] = {"hits": hits, "refused": d, "refused/hits":
                     round(refused / hits, 3) if hits else None, **extra}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.remote_faults", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=6, help="turns of each run")
    p.add_argument("--words", type=int, default=200, help="words of the shared system prompt")
    p.add_argument("--faults", type=int, default=8, help="pages spoiled before the faulty run")
    p.add_argument("--max-tokens", type=int, default=12)
    p.add_argument("--local", default="1MiB", help="each proxy's RAM budget (no disk)")
    p.add_argument("--n-ctx", type=int, default=8192)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--log-dir", default="results/logs")
    p.add_argument("--root", type=Path, help="run the proxies from this checkout")
    args = p.parse_args(argv)
    model = ModelSpec(Path(args.model).stem, Path(args.model).resolve(), is_gemma=False)
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp, ExitStack() as stack:
        scratch = Path(tmp)
        url = stack.enter_context(valkey(scratch))
        kw: dict[str, Any] = {"n_ctx": args.n_ctx, "lanes": 1, "log_dir": Path(args.log_dir),
                              "root": args.root}

        def config(key: str) -> str:
            return (f'ram_budget = "{args.local}"\ndisk_enabled = false\n'  # in [cache]
                    f'[cache.remote]\nurl = "{url}"\nsecret_path = "{scratch / key}"\n'
                    "[engine]\nidle_save_s = 0.2\n")
        servers = {
            "A": stack.enter_context(running("statecache", model, extra_config=config(
                "shared.key"), tag="-A", **kw)),
            "B": stack.enter_context(running("statecache", model, extra_config=config(
                "shared.key"), tag="-B", **kw)),
            "S": stack.enter_context(running("statecache", model, extra_config=config(
                "stranger.key"), tag="-S", **kw)),
        }
        pair, stranger = [servers["A"], servers["B"]], servers["S"]
        system = _text(rng, args.words)
        convs = [[{"role": "system", "content": system}] for _ in range(args.conversations)]
        results = []
        for run in ("healthy", "faulty"):
            if run == "faulty":
                print(json.dumps({"spoiled": _spoil(url, args.faults, rng)}), flush=True)
            before = {n: _store_figures(s) for n, s in servers.items()}
            prompt, cached = _turns(pair, stranger, convs, args.turns, rng, args.max_tokens)
            results.append(_report(run, servers, before, prompt, cached))
            print(json.dumps(results[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
