"""Speculative decoding: decode tokens/s with and without each draft source, on each target
memory kind, through the server (one streaming request at a time, greedy), side by side
in one run; the acceptance rate; and the bytes a checkpoint of the draft costs with and
without the partial-only rule.

    python -m bench.speculative --json results/speculative.json     # tiny pairs, mid, SmolLM2
    python -m bench.speculative --full ...                          # + Gemma 3, the 0.8B pair
    python -m bench.speculative --quick ...                         # the tiny hybrid pair
    python -m bench.speculative --rollback-check                    # snapshots vs staged

Three workloads of 256 tokens: ``chat`` (a prose question), ``code-edit`` (a file and a
request to re-emit it with one change: prompt lookup's case) and ``re-emit`` (a file the
assistant wrote two turns earlier, asked for again with one change). The rate is the
engine's own for each request, first token to last (``GET /admin/requests``): a
client's moves with the stream's writes, batched every ``server.stream_interval_ms``. The synthetic
models answer with random characters, so lookup finds little to draft there (it shows
its overhead); their draft pairs made by tools/synth_gguf.py (a target and its first
layers) show a draft model on each memory kind, and the real models (SmolLM2, Gemma 3)
show lookup on code.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.harness import _sse_lines
from bench.paired import median_ci
from bench.servers import Server, running, settle
from bench.spec_models import (
    MODELS,
    Target,
    picked,
    targets,
    verify_cost,
    workloads,
)
from statecache.config import SpeculativeConfig


def _chat(url: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    # a conversation of its own every time: a repeat of a request must not draft from the
    # reply remembered for the last one (proxy/engine/drafting.py History)
    body = {"model": "bench", "messages": messages, "stream": True, "temperature": 0.0,
            "max_tokens": max_tokens, "stream_options": {"include_usage": True},
            "prompt_cache_key": f"bench-{time.perf_counter_ns()}"}
    t0 = time.perf_counter()
    t_first = 0.0
    usage: dict[str, Any] = {}
    rid = ""
    text: list[str] = []
    for line in _sse_lines(url, body, "/v1/chat/completions"):
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        obj = json.loads(line[5:])
        rid = obj.get("id") or rid
        usage = obj.get("usage") or usage
        for ch in obj.get("choices") or []:
            d = ch.get("delta") or {}
            text.append(d.get("content") or "")
            if not t_first and (d.get("content") or d.get("reasoning_content")):
                t_first = time.perf_counter()
    t_end = time.perf_counter()
    n = int(usage.get("completion_tokens", 0))
    span = t_end - (t_first or t0)
    return {"tokens": n, "ttft_s": (t_first or t_end) - t0,
            "client_tps": (n - 1) / span if n > 1 and span > 0 else 0.0,
            "decode_tps": _engine_rate(url, rid), "text": "".join(text)}


def _quiet_turn(servers: list[Server], url: str, messages: list[dict[str, str]],
                max_tokens: int, tries: int = 4) -> dict[str, Any]:
    """One turn on ``url`` while the other servers stay idle: each starts idle (the last
    one's disk writes are not in this decode), and a turn during which another worked
    more than 2% of its time (an idle lane's save, a timer) is run again."""
    me = next(s for s in servers if s.url == url)
    others = [s for s in servers if s is not me]
    got: dict[str, Any] = {}
    for _ in range(tries):
        settle(servers)
        before = [s.cpu_ns() for s in others]
        t0 = time.perf_counter_ns()
        got = _chat(url, messages, max_tokens)
        spent = time.perf_counter_ns() - t0
        if all(s.cpu_ns() - b < 0.02 * spent for s, b in zip(others, before, strict=True)):
            break
    return got


def _engine_rate(url: str, request_id: str) -> float:
    """The engine's decode rate for one request, first token to last, as GET
    /admin/requests lists it. What the client sees is the stream, written at most every
    ``server.stream_interval_ms`` (32 ms): on a tiny model's tenth of a second of decode,
    that alone moves a client's rate by a third either way."""
    for _ in range(200):  # the list gets the request once its handler returned
        with urllib.request.urlopen(url + "/admin/requests", timeout=10) as r:
            recent = json.loads(r.read())["requests"]
        for rec in reversed(recent):
            if rec.get("request_id") == request_id:
                return float(rec["decode_tps"])
        time.sleep(0.005)
    raise RuntimeError(f"request {request_id} is not in {url}/admin/requests")


_METRIC = re.compile(r'^statecache_(?:speculative_tokens|draft)_total\{what="(drafted|accepted|'
                     r'tokens_decoded)"\}\s+([0-9.e+]+)$', re.M)


def _spec_counts(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return {f"spec_{m[1]}": float(m[2]) for m in _METRIC.finditer(text)}


# the sources a target is measured with: "off" and the default config ("auto": prompt
# lookup, and the draft model where the target has one); --sources adds "lookup", "draft"
DEFAULT_SOURCES = ("off", "auto")


def source_config(source: str) -> str:
    """The [speculative] section a source runs with: ``off``, ``auto``, ``lookup`` or
    ``draft`` as ``speculative.source``; ``fixedN``: prompt lookup drafting what it
    finds, up to N tokens, at every step (no adaptive rule), to set the rule against."""
    fixed = re.fullmatch(r"fixed(\d+)", source)
    if fixed:
        return (f'[speculative]\nsource = "lookup"\nadaptive = false\n'
                f"lookup_draft_max = {int(fixed.group(1))}\n")
    return f'[speculative]\nsource = "{source}"\n'


def run_target(t: Target, args: argparse.Namespace) -> dict[str, Any]:
    """Decode tokens/s of each source, its servers running side by side, in rounds: each
    round starts every source's server afresh and runs each workload once on every
    source in turn (the order alternates), and a source's speedup is the median of its
    ratios to "off" in the same round (the machine's drift cancels out). Fresh servers
    each round, because a server's own start moves its rate: the same config started
    five times decoded the tiny hybrid from 0.92x to 1.05x of the first start, and a
    single pair of servers then decides a tiny model's cell (docs/speculative.md, "Why
    fresh servers each round")."""
    sources = [s for s in args.sources if s != "draft" or t.draft is not None]
    out: dict[str, Any] = {"kind": t.label, "model": t.model.label}
    turns = workloads(args.code_lines)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {
        name: {s: [] for s in sources} for name in turns}
    # tokens drafted and accepted, and the draft model's tokens (following the prompt
    # and catching up), over the measured turns
    counted: dict[str, dict[str, dict[str, float]]] = {
        name: {s: {} for s in sources} for name in turns}
    rounds = 0
    while True:
        with contextlib.ExitStack() as stack:
            urls = {}
            servers: list[Server] = []
            for source in sources:
                extra = source_config(source)
                if args.draft_max:
                    extra += f"draft_max = {args.draft_max}\n"
                flags = ("--draft", str(t.draft)) if source in ("draft", "auto") and t.draft \
                    else ()
                srv = stack.enter_context(running(
                    "statecache", t.model, n_ctx=4096, lanes=1, log_dir=Path(args.log_dir),
                    extra_config=extra, extra_args=flags, tag=f"-spec-{source}"))
                urls[source] = srv.url
                servers.append(srv)
            for name, (messages, max_tokens) in turns.items():
                before = {}
                for source in sources:
                    _chat(urls[source], messages, max_tokens)  # warm-up: the prompt cached
                    before[source] = _spec_counts(urls[source])
                for source in (sources if rounds % 2 == 0 else sources[::-1]):
                    runs[name][source].append(_quiet_turn(servers, urls[source], messages,
                                                          max_tokens))
                for source in sources:
                    after = _spec_counts(urls[source])
                    acc = counted[name][source]
                    for key, v in after.items():
                        acc[key] = acc.get(key, 0.0) + v - before[source].get(key, 0.0)
        rounds += 1
        # at least --repeats rounds, more while a source has decoded a workload for less
        # than --min-seconds (a tiny model decodes 256 tokens in a tenth of a second)
        spent = min(sum(x["tokens"] / x["decode_tps"] for x in runs[name][s] if x["decode_tps"])
                    for name in turns for s in sources)
        if rounds >= args.repeats and (spent >= args.min_seconds or rounds >= 4 * args.repeats):
            break
    for name in turns:
        for source in sources:
            c = counted[name][source]
            drafted, accepted = c.get("spec_drafted", 0.0), c.get("spec_accepted", 0.0)
            ratios = [r["decode_tps"] / b["decode_tps"]
                      for r, b in zip(runs[name][source], runs[name]["off"], strict=True)
                      if b["decode_tps"]]
            out.setdefault(source, {})[name] = {
                "decode_tps": statistics.median(r["decode_tps"] for r in runs[name][source]),
                "tokens": runs[name][source][0]["tokens"], "turns": len(runs[name][source]),
                "ratios": [round(x, 3) for x in ratios] if source != "off" else None,
                "drafted": drafted, "accepted": accepted,
                "draft_decoded": c.get("spec_tokens_decoded", 0.0),
                "acceptance": accepted / drafted if drafted else None,
                "speedup": statistics.median(ratios) if source != "off" and ratios else None,
                # 95%, distribution-free (None under 6 rounds)
                "interval": median_ci(ratios) if source != "off" and ratios else None,
                # what the model wrote (the first round's), and in how many rounds the
                # reply was "off"'s, character for character (greedy: a reply may leave
                # it only after a near-tie: docs/speculative.md, "Is a greedy reply
                # with drafting the reply without it?")
                "reply": runs[name][source][0]["text"],
                "same_as_off": sum(r["text"] == b["text"] for r, b in zip(
                    runs[name][source], runs[name]["off"], strict=True)),
            }
    out["rounds"] = rounds
    return out


def draft_checkpoint_bytes(model: Path, tokens: int) -> dict[str, Any]:
    """Bytes of one checkpoint of a draft lane holding ``tokens`` tokens: its full state
    (what a checkpoint costs without the rule) against what statecache keeps (the
    partial state of a recurrent draft, nothing for a plain-attention draft)."""
    import numpy as np

    from proxy.engine.binding import (
        FLAGS_FULL,
        FLAGS_PARTIAL,
        Context,
        ContextParams,
        MemoryKind,
        Model,
        init_backend,
    )

    init_backend()
    with Model(model) as m, Context(m, ContextParams(n_ctx=tokens + 64, n_batch=512,
                                                      n_ubatch=512)) as ctx:
        ctx.prefill(0, np.arange(tokens, dtype=np.int32) % 200 + 10, 0, logits_last=False)
        full = ctx.state_size(0, FLAGS_FULL)
        recurrent = m.is_hybrid or m.is_recurrent
        kept = ctx.state_size(0, FLAGS_PARTIAL) if recurrent else 0
    return {"model": model.name, "tokens": tokens,
            "memory": "recurrent/hybrid" if recurrent else MemoryKind.ATTENTION.value,
            "full_bytes": full, "kept_bytes": kept}


def rollback_check(target: Path, draft: Path, n_out: int, repeats: int,
                   draft_max: int = 3) -> list[dict[str, Any]]:
    """A hybrid target with a draft model, in process (no HTTP): decode tokens/s of one
    greedy stream, drafting or not (``speculative: false``), with rejected drafts rolled
    back through n_rs_seq snapshots or through a staged partial state."""
    import asyncio

    from proxy.engine.engine import Engine
    from proxy.engine.types import GenerationRequest, SamplingParams, TokenEvent
    from statecache.config import load_config

    rows = []
    for rollback in ("snapshots", "staged"):
        cfg = load_config(None, {
            "model.path": str(target), "model.draft_path": str(draft), "model.n_ctx": 4096,
            "server.lanes": 1, "cache.enabled": False, "speculative.source": "draft",
            "speculative.draft_min_p": 0.0,  # as the server runs of the draft source
            "speculative.draft_max": draft_max,
            "speculative.rollback": rollback})
        eng = Engine(cfg, target)
        try:
            prompt = tuple(eng.model.tokenize("Tell me a long story about a robot."))

            async def one(spec: bool, eng: Engine = eng, prompt: tuple[int, ...] = prompt
                          ) -> float:
                req = GenerationRequest("bench", prompt, SamplingParams(
                    temperature=0.0, max_tokens=n_out, speculative=spec))
                t0, n = time.perf_counter(), 0
                async for ev in eng.generate(req):
                    if isinstance(ev, TokenEvent):
                        n += len(ev.token_ids)
                return n / (time.perf_counter() - t0)

            for spec in (False, True):
                asyncio.run(one(spec))  # warm-up
                tps = statistics.median(asyncio.run(one(spec)) for _ in range(repeats))
                rows.append({"rollback": rollback, "drafting": spec, "decode_tps": tps,
                             "n_rs_seq": eng.memory.n_rs_seq})
        finally:
            eng.close()
    return rows


def table(result: dict[str, Any]) -> list[str]:
    lines = ["| target (memory) | model | workload | source | decode tok/s | vs off | "
             "95% interval | drafted | accepted | acceptance | reply as off's |",
             "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|"] if result["targets"] else []
    for t in result["targets"]:
        if "error" in t:
            lines.append(f"| {t['kind']} | {t['model']} | failed: {t['error'][:80]} ||||||||")
            continue
        for source in ("off", "auto", "lookup", "draft", *sorted(
                (k for k in t if k.startswith("fixed")), key=lambda k: int(k[5:]))):
            if source not in t:
                continue
            for name, r in t[source].items():
                acc = f"{100 * r['acceptance']:.0f}%" if r.get("acceptance") is not None else "-"
                sp = f"{r['speedup']:.2f}x" if r.get("speedup") else "-"
                ci = r.get("interval")
                band = f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-"
                same = f"{r['same_as_off']}/{r['turns']}" if source != "off" and \
                    "same_as_off" in r else "-"
                lines.append(f"| {t['kind']} | {t['model']} | {name} | {source} | "
                             f"{r['decode_tps']:.1f} | {sp} | {band} | {int(r['drafted'])} | "
                             f"{int(r['accepted'])} | {acc} | {same} |")
    if result.get("rollback"):
        lines += ["", "Rolling back a hybrid target with a draft model (in process, one "
                  "stream): per-token snapshots (n_rs_seq) against a staged partial state:",
                  "", "| rollback | n_rs_seq | drafting | decode tok/s |", "|---|---:|---|---:|"]
        for r in result["rollback"]:
            lines.append(f"| {r['rollback']} | {r['n_rs_seq']} | "
                         f"{'yes' if r['drafting'] else 'no (speculative: false)'} | "
                         f"{r['decode_tps']:.1f} |")
    if result.get("ceiling"):
        from bench.ceiling import table as ceiling_table
        lines += ["", "What prompt lookup could make of each undrafted reply at best, each "
                  "step priced by the verification costs measured here (bench.ceiling):",
                  "", *ceiling_table(result["ceiling"])]
    if result.get("verify"):
        base = {(r["model"], r.get("context", 300)): r["ms"] for r in result["verify"]
                if r["tokens"] == 1}
        lines += ["", "What a verification costs the target: one lane holding a context "
                  "decoding n tokens at once (n_rs_seq snapshots on for the hybrid pairs), "
                  "median of 8; each size in a run of its own, then alternating with steps "
                  "of one token (each step's graph built anew: the n-token step, and the "
                  "one-token step after it):", "",
                  "| model | context | tokens | ms | x one token | alternating: ms | "
                  "one token after it: ms |", "|---|---:|---:|---:|---:|---:|---:|"]
        for r in result["verify"]:
            ctx = r.get("context", 300)
            alt = [f"{r[k]:.1f}" if k in r else "-" for k in ("after_one_ms", "one_after_ms")]
            lines.append(f"| {r['model']} | {ctx} | {r['tokens']} | {r['ms']:.1f} | "
                         f"{r['ms'] / base[(r['model'], ctx)]:.2f} | {alt[0]} | {alt[1]} |")
    if not result["checkpoints"]:
        return lines
    lines += ["", "Draft checkpoints (one lane at the given length): full state, against what "
              "statecache keeps (partial-only for a recurrent draft, nothing for a "
              "plain-attention draft):", "",
              "| draft | memory | tokens | full state | kept |", "|---|---|---:|---:|---:|"]
    for c in result["checkpoints"]:
        lines.append(f"| {c['model']} | {c['memory']} | {c['tokens']:,} | "
                     f"{c['full_bytes']:,} | {c['kept_bytes']:,} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.speculative")
    p.add_argument("--json", default="results/speculative.json")
    p.add_argument("--full", action="store_true", help="also Gemma 3 and the bench-size pair")
    p.add_argument("--quick", action="store_true", help="only the tiny hybrid and its pair")
    p.add_argument("--draft-max", type=int, default=0,
                   help="speculative.draft_max (0: the default config's)")
    p.add_argument("--repeats", type=int, default=3,
                   help="rounds at least (each starts the servers afresh and runs every "
                   "workload once on each)")
    p.add_argument("--min-seconds", type=float, default=6.0,
                   help="rounds go on (to 4 x --repeats) until each source decoded each "
                   "workload this long")
    p.add_argument("--sources", type=lambda v: tuple(v.split(",")), default=DEFAULT_SOURCES,
                   help="comma-separated: off (always measured), auto (the default "
                   "config), lookup, draft, fixedN (lookup's drafts up to N at every "
                   "step, no adaptive rule)")
    p.add_argument("--only", default="",
                   help="only the targets whose model label has this (or, comma-separated, "
                   "any of these)")
    p.add_argument("--code-lines", type=int, default=0,
                   help="the code file's first lines only (0: all 65)")
    p.add_argument("--log-dir", default="results/logs")
    p.add_argument("--rollback-check", action="store_true",
                   help="only: snapshots against staged rollback on a hybrid and its draft")
    p.add_argument("--verify-only", action="store_true",
                   help="only: what a verification costs each real model, beside 300 and "
                   "800 tokens")
    p.add_argument("--verify-model", action="append", default=[], metavar="GGUF",
                   help="with --verify-only: this model too (repeatable), e.g. SmolLM2 "
                   "quantized otherwise with llama-quantize")
    p.add_argument("--pair", default="mid", choices=("mid", "bench"),
                   help="with --rollback-check: hybrid-mid or hybrid-bench and its draft")
    a = p.parse_args(argv)
    dm = a.draft_max or SpeculativeConfig().draft_max
    if a.rollback_check:
        rows = rollback_check(MODELS / f"hybrid-{a.pair}.gguf",
                              MODELS / f"hybrid-{a.pair}-draft.gguf", 256, a.repeats,
                              dm)
        print("\n".join(table({"targets": [], "checkpoints": [], "rollback": rows})))
        return 0
    if a.verify_only:
        paths = [t.model.path for t in targets(True)
                 if t.draft is None and picked(a.only, t.model.label)]
        rows = [r for path in paths + [Path(m) for m in a.verify_model] for ctx in (300, 800)
                for r in verify_cost(path, 0, (1, 2, 4, 9, 17), ctx)]
        print("\n".join(table({"targets": [], "checkpoints": [], "verify": rows})))
        return 0
    result: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "draft_max": dm,
                              "targets": [], "checkpoints": []}
    if "off" not in a.sources:
        a.sources = ("off", *a.sources)
    ts = [t for t in targets(a.full, a.quick) if picked(a.only, t.model.label)]
    for t in ts:
        try:
            result["targets"].append(run_target(t, a))
        except Exception as e:  # one broken target must not end the benchmark
            result["targets"].append({"kind": t.label, "model": t.model.label,
                                      "error": f"{type(e).__name__}: {e}"})
    result["verify"] = [r for t in ts  # the qwen35 hybrids: n_rs_seq rollback
                        if t.draft is not None and t.label.startswith("hybrid")
                        and "jamba" not in t.label
                        for r in verify_cost(t.model.path, dm + 1)]
    # the real models (prompt lookup), beside a short prompt and a file's length of one
    result["verify"] += [r for t in ts if t.draft is None for ctx in (300, 800)
                         for r in verify_cost(t.model.path, 0, (1, 2, 4, 9, 17), ctx)]
    mid = [t for t in ts if t.model.label == "hybrid-mid"]
    if mid and mid[0].draft is not None:
        result["rollback"] = rollback_check(mid[0].model.path, mid[0].draft, 256, a.repeats,
                                            dm)
    # how much of each real model's speedup lookup could reach here at best (bench.ceiling)
    if any(t.draft is None for t in ts):
        from bench.ceiling import measure as ceiling
        result["ceiling"] = ceiling(result, a.only)
    for t in ts:
        if t.draft is not None:
            for n in (2000, 8000):
                result["checkpoints"].append(draft_checkpoint_bytes(t.draft, n))
    result["checkpoints"].append(draft_checkpoint_bytes(MODELS / "draft-tiny.gguf", 2000))
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))
    print("\n".join(table(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
