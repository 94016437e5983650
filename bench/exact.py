"""Exact mode against the cache-off server: interleaved conversations with follow-ups,
edits and regenerations, one request at a time, asked of a statecache with
``cache.exact = true`` and a small RAM budget (it evicts all the time) and of the same
server with ``--no-cache``. Every reply's tokens and logprobs must be equal, bit for bit,
and every exact-mode reply must say it took the exact path (``/admin/requests``).
It exits 1 on any difference.

    python -m bench.exact --model models/hybrid-tiny.gguf --requests 200

``--exact false`` runs the default mode against the same reference (what it guarantees
instead: docs/exact.md). ``--cost`` sends the same requests to an exact-mode server and a
default one and gives each kind's median TTFT on both:

    python -m bench.exact --cost --model models/hybrid-mid.gguf --requests 40 \
        --system-words 400 --max-chars 12000
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openai import OpenAI

from bench.servers import ROOT, ModelSpec, running

WORDS = ("read", "the", "file", "then", "fix", "test", "run", "shell", "patch", "diff",
         "error", "line", "function", "class", "return", "value", "loop", "index")


@dataclass
class Tally:
    requests: int = 0
    equal: int = 0  # replies equal to the cold server's, tokens and logprobs
    same_text: int = 0  # the same text, logprobs not bit-identical
    exact_path: int = 0  # replies /admin/requests says took the exact path
    cached: int = 0  # requests that reused a state (cached tokens > 0)
    said_exact_but_differ: int = 0  # a reply said exact that the cold one is not: a defect
    breaks: dict[str, int] = field(default_factory=dict)  # exact_breaks named, how often
    failures: list[str] = field(default_factory=list)
    kinds: dict[str, int] = field(default_factory=dict)
    ttft_s: dict[str, list[float]] = field(default_factory=dict)


def _text(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _ask(client: OpenAI, messages: list[dict[str, str]], max_tokens: int
         ) -> tuple[str, list[tuple[str, float]], str]:
    r = client.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                       max_tokens=max_tokens, temperature=0, logprobs=True)
    choice = r.choices[0]
    content = choice.logprobs.content if choice.logprobs and choice.logprobs.content else []
    return choice.message.content or "", [(t.token, t.logprob) for t in content], r.id


def _record(url: str, request_id: str) -> dict[str, Any]:
    """The request's record in ``/admin/requests``."""
    with urllib.request.urlopen(url + "/admin/requests", timeout=30) as resp:
        records = json.loads(resp.read())["requests"]
    return next(r for r in reversed(records) if r.get("request_id") == request_id)


def conversations(rng: random.Random, n: int, system_words: int) -> list[list[dict[str, str]]]:
    system = _text(random.Random(0), system_words, system_words)  # shared by all
    return [[{"role": "system", "content": system},
             {"role": "user", "content": f"conversation {i}: " + _text(rng, 5, 80)}]
            for i in range(n)]


def run(url: str, cold_url: str, requests: int, seed: int, tally: Tally, *,
        convs: int = 4, system_words: int = 100, max_tokens: int = 24, max_chars: int = 3000,
        on_tick: Any = print, compare: bool = True, verbose: bool = False,
        cold_lock: Any = None) -> None:
    """``requests`` requests over ``convs`` conversations, picked at random: a follow-up
    (the reply kept, a new user message), an edit (an earlier user message rewritten,
    what came after it dropped) or a regeneration (the same messages again). Each goes
    to ``url`` and then to ``cold_url``; ``compare``: the replies must be equal, else the
    second is the default mode and only the TTFTs are kept (``cost``)."""
    rng = random.Random(seed)
    live = conversations(rng, convs, system_words)
    ours, cold = OpenAI(base_url=url + "/v1", api_key="x"), \
        OpenAI(base_url=cold_url + "/v1", api_key="x")
    last: list[str | None] = [None] * convs
    for i in range(requests):
        c = rng.randrange(convs)
        msgs = live[c]
        roll = rng.random()
        if sum(len(m["content"]) for m in msgs) > max_chars:  # a new one in its place
            live[c] = msgs = conversations(rng, 1, system_words)[0]
            last[c] = None
        kind = "first" if last[c] is None else "follow-up"
        if last[c] is not None and roll < 0.2:
            kind = "regenerate"
            msgs.pop()  # the reply: asked again
        elif last[c] is not None and roll < 0.4:
            kind = "edit"
            users = [k for k, m in enumerate(msgs) if m["role"] == "user"]
            k = rng.choice(users)
            del msgs[k + 1:]
            msgs[k] = {"role": "user", "content": msgs[k]["content"][: rng.randint(0, 80)]
                       + " " + _text(rng, 1, 60)}
        elif last[c] is not None:
            msgs.append({"role": "user", "content": _text(rng, 1, 80)})
        tally.kinds[kind] = tally.kinds.get(kind, 0) + 1
        text, lps, rid = _ask(ours, msgs, max_tokens)
        rec = _record(url, rid)
        tally.ttft_s.setdefault(kind, []).append(rec.get("ttft_s", 0.0))
        with cold_lock or contextlib.nullcontext():  # the cold server: one at a time
            ctext, clps, cold_id = _ask(cold, msgs, max_tokens)
        tally.requests += 1
        if not compare:  # the cost: the other server is the default mode, its TTFT beside
            tally.ttft_s.setdefault(f"{kind}, default", []).append(
                _record(cold_url, cold_id).get("ttft_s", 0.0))
            msgs.append({"role": "assistant", "content": text})
            last[c] = text
            continue
        tally.exact_path += bool(rec.get("exact"))
        tally.cached += bool(rec.get("cached_tokens"))
        for why in rec.get("exact_breaks") or ():
            tally.breaks[why] = tally.breaks.get(why, 0) + 1
        if (text, lps) == (ctext, clps):
            tally.equal += 1
        else:
            tally.said_exact_but_differ += bool(rec.get("exact"))
            tally.same_text += text == ctext
            at = next((j for j, (a, b) in enumerate(zip(lps, clps, strict=False)) if a != b),
                      min(len(lps), len(clps)))
            tally.failures.append(
                f"request {i} ({kind}, conversation {c}, {len(msgs)} messages, "
                f"{rec.get('prompt_tokens')} prompt tokens, {rec.get('cached_tokens')} "
                f"cached): differs at token {at}: {lps[at:at + 1]} cold {clps[at:at + 1]}; "
                f"exact path {rec.get('exact')} {rec.get('exact_breaks')}")
        msgs.append({"role": "assistant", "content": text})
        last[c] = text
        if (i + 1) % 25 == 0 or verbose:
            on_tick(f"{i + 1} requests: {tally.equal} equal, {len(tally.failures)} differ")


def check(model: Path, requests: int, *, exact: bool = True, ram_budget: str = "4MiB",
          lanes: int = 2, seed: int = 0, log_dir: Path = ROOT / "results" / "logs",
          disk: bool = True, on_tick: Any = print, clients: int = 1,
          cold_config: str | None = None, **kw: Any) -> Tally:
    from proxy.models import gemma_model_path

    is_gemma = model.resolve() == gemma_model_path().resolve()
    spec = ModelSpec(model.stem, model.resolve(), is_gemma=is_gemma)
    common = f"exact = {'true' if exact else 'false'}\n"
    cfg = common + f'ram_budget = "{ram_budget}"\n' + ("" if disk else "disk_enabled = false\n")
    tally = Tally()
    with running("statecache", spec, n_ctx=4096, lanes=lanes, log_dir=log_dir,
                 extra_config=cfg, threads=1) as srv, \
            running("no-cache", spec, n_ctx=4096, lanes=lanes, log_dir=log_dir,
                    extra_config=common if cold_config is None else cold_config,
                    threads=1) as cold:
        if clients == 1:
            run(srv.url, cold.url, requests, seed, tally, on_tick=on_tick, **kw)
        else:  # at once to the exact server, one at a time to the cold one
            lock = threading.Lock()
            threads = [threading.Thread(target=run, args=(srv.url, cold.url, requests // clients,
                                                          seed + k, tally),
                                        kwargs={"on_tick": on_tick, "cold_lock": lock, **kw})
                       for k in range(clients)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        tally.kinds["ram_evictions"] = int(srv.metrics().get(
            'statecache_evictions_total{tier="ram"}', 0))
    return tally


def cost(model: Path, requests: int, *, threads: int = 2, seed: int = 0,
         log_dir: Path = ROOT / "results" / "logs", **kw: Any) -> Tally:
    """Follow-up TTFT in exact mode beside the default mode: the same requests to both
    (the same RAM budget, 2 GiB: nothing evicted), the exact server first."""
    from proxy.models import gemma_model_path

    is_gemma = model.resolve() == gemma_model_path().resolve()
    spec = ModelSpec(model.stem, model.resolve(), is_gemma=is_gemma)
    tally = Tally()
    with running("statecache", spec, n_ctx=8192, lanes=2, log_dir=log_dir,
                 extra_config="exact = true\n", threads=threads, tag="-exact") as ex, \
            running("statecache", spec, n_ctx=8192, lanes=2, log_dir=log_dir,
                    threads=threads) as default:
        run(ex.url, default.url, requests, seed, tally, compare=False, **kw)
    return tally


def summary(t: Tally) -> str:
    if not t.equal and not t.failures:  # bench.exact --cost: no comparison, TTFTs alone
        lines = [f"{t.requests} requests ({', '.join(f'{k} {v}' for k, v in t.kinds.items())})"
                 ", each to the exact server and then to the default one"]
        return "\n".join(lines + _ttfts(t))
    lines = [f"{t.requests} requests ({', '.join(f'{k} {v}' for k, v in t.kinds.items())}): "
             f"{t.equal} bit-identical to the cache-off server, {t.same_text} more with the "
             f"same text; {t.exact_path} on the exact path ({t.said_exact_but_differ} of them "
             f"not equal), {t.cached} reused a state"]
    if t.breaks:
        lines.append("  off the exact path: " + ", ".join(f"{k} {v}" for k, v in t.breaks.items()))
    lines += _ttfts(t)
    lines += [f"  {f}" for f in t.failures[:10]]
    return "\n".join(lines)


def _ttfts(t: Tally) -> list[str]:
    out = []
    for kind, xs in t.ttft_s.items():
        xs = sorted(xs)
        out.append(f"  TTFT {kind}: median {1000 * xs[len(xs) // 2]:.1f} ms over "
                   f"{len(xs)}, mean {1000 * sum(xs) / len(xs):.1f} ms")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=Path("models/hybrid-tiny.gguf"))
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--exact", choices=("true", "false"), default="true")
    ap.add_argument("--ram-budget", default="4MiB")
    ap.add_argument("--lanes", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-disk", action="store_true")
    ap.add_argument("--system-words", type=int, default=100)
    ap.add_argument("--convs", type=int, default=4, help="conversations interleaved")
    ap.add_argument("--clients", type=int, default=1, help="clients at once, each with "
                    "its conversations (the cold server still serves one at a time)")
    ap.add_argument("--max-chars", type=int, default=3000, help="a longer conversation "
                    "is replaced by a new one")
    ap.add_argument("--cold-default", action="store_true", help="the cache-off server "
                    "with the default config (speculative decoding on), not exact mode's")
    ap.add_argument("--cost", action="store_true", help="no comparison: each request's "
                    "TTFT in exact mode and in the default mode")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    if args.cost:
        t = cost(args.model, args.requests, seed=args.seed, system_words=args.system_words,
                 max_chars=args.max_chars, convs=args.convs)
        print(summary(t))
        return 0
    t = check(args.model, args.requests, exact=args.exact == "true",
              ram_budget=args.ram_budget, lanes=args.lanes, seed=args.seed,
              disk=not args.no_disk, system_words=args.system_words,
              max_chars=args.max_chars, convs=args.convs, clients=args.clients,
              cold_config="" if args.cold_default else None)
    print(summary(t))
    print(f"took {time.monotonic() - t0:.0f} s")
    return 0 if not t.failures and not t.said_exact_but_differ else 1


if __name__ == "__main__":
    sys.exit(main())
