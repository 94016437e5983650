"""Batched steps under load, statecache against llama-server on the same model, threads
and number of lanes (slots), side by side in one run:

1. aggregate decode tokens/s with 1, 2 and 4 concurrent streams (and each as a ratio
   to the system's own one-stream rate), against ``proxy.engine.binding`` decoding as
   many lanes in one batch per step in a loop (no HTTP); every system is started at once and
   their runs take turns (see ``decode_rates``), so the machine's drift falls on all;
   statecache runs twice: as configured, and writing every token on its own
   (``statecache-per-token``, ``server.stream_interval_ms = 0``, as llama-server does);
2. inter-token latency p50/p95 of a stream while another request prefills a long
   prompt, against the same stream's quiet p50/p95;
3. TTFT of a short request sent right behind a long one.

    python -m bench.batching --model models/hybrid-mid.gguf --json results/batching.json

Token arrival times come from the client (``/v1/completions``, streaming): on the
synthetic models one character is one token. A chunk that carries k tokens counts as
one gap then k-1 gaps of zero, which is what a reader of the stream sees.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import _sse_lines
from bench.paired import paired
from bench.paired import table as paired_table
from bench.servers import LLAMA_SERVER, ModelSpec, Server, checkout, running
from statecache.config import ServerConfig

# statecache again, with server.stream_interval_ms = 0: every step's tokens written at
# once, as llama-server writes them (by default a stream is written at most every
# server.stream_interval_ms)
PER_TOKEN = "statecache-per-token"
BINDING = "binding"  # proxy.engine.binding decoding in this process, among the servers' turns

STREAMS = ("1", "2", "4")  # concurrent streams whose aggregate decode rate is measured

WORDS = ("alpha", "beta", "gamma", "delta", "omega", "sigma", "theta", "kappa")


def _prompt(n_chars: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    out: list[str] = []
    size = 0
    while size < n_chars:
        w = WORDS[int(rng.integers(len(WORDS)))]
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n_chars]


def _stream(url: str, prompt: str, max_tokens: int,
            stop: threading.Event | None = None) -> dict[str, Any]:
    """One streaming completion: send time, token arrival times, usage. ``stop`` set:
    the client leaves."""
    body = {"model": "bench", "prompt": prompt, "stream": True, "temperature": 0.0,
            "max_tokens": max_tokens, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    arrivals: list[float] = []
    usage: dict[str, Any] = {}
    for line in _sse_lines(url, body, "/v1/completions"):
        if stop is not None and stop.is_set():
            break
        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
            continue
        obj = json.loads(line[5:])
        usage = obj.get("usage") or usage
        now = time.perf_counter()
        for ch in obj.get("choices") or []:
            arrivals += [now] * len(ch.get("text") or "")
    return {"t0": t0, "arrivals": arrivals, "usage": usage}


def _in_threads(jobs: list[tuple[str, int, float]], url: str) -> list[dict[str, Any]]:
    """Run (prompt, max_tokens, delay) streams at once, each in its own thread."""
    out: list[dict[str, Any]] = [{} for _ in jobs]

    def run(i: int, prompt: str, n: int, delay: float) -> None:
        time.sleep(delay)
        out[i] = _stream(url, prompt, n)

    threads = [threading.Thread(target=run, args=(i, *j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs), q)) if xs else float("nan")


def _gaps(arrivals: list[float], lo: float, hi: float) -> list[float]:
    return [b - a for a, b in zip(arrivals, arrivals[1:], strict=False) if lo <= b <= hi]


def aggregate_decode(url: str, n_out: int, streams: int) -> float:
    """Tokens/s of ``streams`` concurrent streams, over the span where all decode."""
    res = _in_threads([(_prompt(200, 10 + i), n_out, 0.0) for i in range(streams)], url)
    start = max(r["arrivals"][0] for r in res)
    end = min(r["arrivals"][-1] for r in res)
    n = sum(sum(1 for t in r["arrivals"] if start <= t <= end) for r in res)
    return n / (end - start) if end > start else float("nan")


def itl_during_prefill(url: str, n_long: int, max_tokens: int) -> dict[str, float]:
    """A stream decodes quietly for a while, then a long prompt arrives beside it; the
    stream's client leaves once the long prompt's first token is out."""
    stop = threading.Event()
    got: dict[str, Any] = {}

    def reader() -> None:
        got["stream"] = _stream(url, _prompt(200, 1), max_tokens, stop)

    t = threading.Thread(target=reader)
    t.start()
    time.sleep(1.5)
    long = _stream(url, _prompt(n_long, 2), 1)
    time.sleep(0.2)
    stop.set()
    t.join()
    stream = got["stream"]
    t_first_long = long["arrivals"][0] if long["arrivals"] else long["t0"]
    quiet = _gaps(stream["arrivals"], stream["arrivals"][0], long["t0"])
    busy = _gaps(stream["arrivals"], long["t0"], t_first_long)
    return {"quiet_p50_ms": 1000 * _pct(quiet, 50), "quiet_p95_ms": 1000 * _pct(quiet, 95),
            "busy_p50_ms": 1000 * _pct(busy, 50), "busy_p95_ms": 1000 * _pct(busy, 95),
            "busy_p99_ms": 1000 * _pct(busy, 99), "busy_max_ms": 1000 * max(busy, default=0.0),
            "long_prefill_s": t_first_long - long["t0"], "busy_tokens": len(busy)}


def short_behind_long(url: str, n_long: int) -> dict[str, float]:
    res = _in_threads([(_prompt(n_long, 3), 1, 0.0), (_prompt(50, 4), 1, 0.2)], url)
    long, short = res
    return {"short_ttft_s": short["arrivals"][0] - short["t0"],
            "long_ttft_s": long["arrivals"][0] - long["t0"]}


def _thread_cpu(pid: int) -> dict[int, int]:
    """On-CPU nanoseconds of each thread of ``pid`` (Linux's schedstat); {} elsewhere."""
    out: dict[int, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[int(tid)] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return out


def cpu_per_token(url: str, pid: int, n_out: int) -> dict[str, float]:
    """One stream's server CPU per token (microseconds): in the two busiest threads (the
    decode's: the thread that calls llama_decode and the ggml worker beside it, on 2
    threads) and in all the others (HTTP, event loop, and statecache's checkpoint
    writers, busy with the states of the streams before this one); and the benchmark
    client's (this thread: reading the stream). Every microsecond of the last two kinds
    runs on the cores the decode needs. {} where it cannot be read."""
    before = _thread_cpu(pid)
    client = time.thread_time()
    r = _stream(url, _prompt(200, 10), n_out)
    client = time.thread_time() - client
    after = _thread_cpu(pid)
    n = int((r["usage"] or {}).get("completion_tokens") or 0)
    used = sorted((after[t] - before.get(t, 0) for t in after), reverse=True)
    if not n or len(used) < 2:
        return {}
    return {"decode_threads_us": sum(used[:2]) / n / 1000,
            "other_threads_us": sum(used[2:]) / n / 1000,
            "client_us": client / n * 1e6}


class DirectDecoder:
    """``streams`` streams decoded by proxy.engine.binding in a loop, in this process:
    one batch per step, greedy, no HTTP: the floor of the proxy (and of llama-server).
    The model stays loaded so that its runs can sit between the servers'."""

    def __init__(self, model_path: Path, lanes: int = 4) -> None:
        from proxy.engine.binding import Context, ContextParams, Model

        self.model = Model(model_path)
        self.ctx = Context(self.model, ContextParams(n_ctx=4096 * lanes, n_seq_max=lanes,
                                                     n_batch=512, n_ubatch=512, poll=50))
        self.prompts = [self.model.tokenize(_prompt(200, 10 + i)) for i in range(lanes)]

    def rate(self, n_out: int, streams: int = 1, lanes: tuple[int, ...] = ()) -> float:
        """Tokens/s of ``streams`` lanes (``lanes``: these ones; else 0, 1, ...) that
        decode ``n_out`` tokens each, together."""
        ctx = self.ctx
        ctx.clear_all()
        ids = lanes or tuple(range(streams))
        toks: list[int] = []
        pos: list[int] = []
        for lane, prompt in zip(ids, self.prompts, strict=False):
            logits = ctx.prefill(lane, prompt, 0)
            assert logits is not None
            toks.append(int(np.argmax(logits)))
            pos.append(len(prompt))
        batch = ctx.batch
        t0 = time.perf_counter()
        for _ in range(n_out):
            batch.clear()
            rows = [batch.add(lane, [toks[i]], pos[i], logits_last=True)
                    for i, lane in enumerate(ids)]
            ctx.decode()
            for i, row in enumerate(rows):
                toks[i] = int(ctx.logits_view(row).argmax())
                pos[i] += 1
        return n_out * len(ids) / (time.perf_counter() - t0)

    def close(self) -> None:
        self.ctx.close()
        self.model.close()


def system_config(system: str, *, mine: str, theirs: str | None, against: str) -> str:
    """The TOML tables ``system`` runs with (``\\n`` in them is a newline): ``mine``
    (``--statecache-config``) for this checkout's statecache and its per-token run,
    ``theirs`` (``--against-config``) for ``against`` if given, else ``mine``; nothing for
    llama-server."""
    if system == "llama-server":
        return ""
    extra = theirs if system == against and theirs is not None else mine
    extra = extra.replace("\\n", "\n")
    return _server_key(extra, "stream_interval_ms = 0") if system == PER_TOKEN else extra


def _process_cpu_ns(pid: int) -> int:
    return sum(_thread_cpu(pid).values())


def wait_quiet(pids: list[int], *, share: float = 0.03, window: float = 0.25,
               limit: float = 30.0) -> None:
    """Wait until each process in ``pids``, and this one, uses under ``share`` of a core
    over ``window`` seconds (a server that is idle, not saving or writing what the last
    request left; the binding's threadpool here, whose worker polls for a good part of
    a second after a run, as every server's does); after ``limit`` seconds, say which
    is still busy and go on."""
    deadline = time.monotonic() + limit
    pids = [*pids, os.getpid()]
    while True:
        before = {p: _process_cpu_ns(p) for p in pids}
        time.sleep(window)
        busy = [p for p in pids if _process_cpu_ns(p) - before[p] > share * window * 1e9]
        if not busy:
            return
        if time.monotonic() > deadline:
            print(f"bench.batching: process {busy} still busy after {limit:.0f} s; "
                  "measuring beside it", file=sys.stderr)
            return


def decode_rates(servers: dict[str, Server], direct: DirectDecoder, n_out: int,
                 repeats: int, streams: tuple[str, ...] = STREAMS
                 ) -> dict[str, dict[str, list[float]]]:
    """Aggregate decode rates with each of ``streams`` concurrent streams (1, 2 and 4) of
    every server and of the binding (``BINDING``): ``repeats`` runs each, that take
    turns: in each repeat every system runs once per stream count, in an order that
    rotates, and the other servers are idle while one runs. So a machine that slows
    down over the run (these cores drift by several percent in minutes) slows every
    system alike; ``paired`` compares the runs of one repeat."""
    turn = [*servers, BINDING]
    runs: dict[str, dict[str, list[float]]] = {n: {c: [] for c in streams} for n in turn}
    for rep in range(repeats):
        k = rep % len(turn)
        for c in streams:
            for name in turn[k:] + turn[:k]:
                if name == BINDING:
                    wait_quiet([s.proc.pid for s in servers.values()])
                    runs[name][c].append(direct.rate(n_out, int(c)))
                    continue
                wait_quiet([s.proc.pid for n, s in servers.items() if n != name])
                runs[name][c].append(aggregate_decode(servers[name].url, n_out, int(c)))
    return runs


def lane_gap(direct: DirectDecoder, n_out: int, repeats: int) -> dict[str, float]:
    """The binding decoding two streams in lanes 0 and 1, and in lanes 0 and 2, in turn
    (medians): llama.cpp (kv_unified off) puts separate lanes in one ubatch only while
    their ids follow each other, so lanes 0 and 2 take a pass over the weights each."""
    pairs = {"0,1": (0, 1), "0,2": (0, 2)}
    runs: dict[str, list[float]] = {key: [] for key in pairs}
    for _ in range(repeats):
        for key, lanes in pairs.items():
            runs[key].append(direct.rate(n_out, lanes=lanes))
    return {k: statistics.median(v) for k, v in runs.items()}


def finite_median(xs: list[float]) -> float:
    """The median of the runs that have a rate; NaN where none has (``aggregate_decode``:
    streams that never all decoded at once)."""
    ok = [x for x in xs if math.isfinite(x)]
    return statistics.median(ok) if ok else float("nan")


def measure_system(srv: Server, others: list[Server], args: argparse.Namespace
                   ) -> dict[str, Any]:
    """What is measured on one system at a time, the others idle."""
    out: dict[str, Any] = {}
    quiet = [s.proc.pid for s in others]
    wait_quiet(quiet)
    out["cpu_per_token"] = cpu_per_token(srv.url, srv.proc.pid, args.out_tokens)
    if not args.decode_only:
        wait_quiet(quiet)
        out["itl"] = itl_during_prefill(srv.url, args.long, args.n_ctx - 512)
        wait_quiet(quiet)
        out["short_behind_long"] = short_behind_long(srv.url, args.long)
    out["peak_rss_kb"] = srv.peak_rss_kb()
    return out


def _server_key(toml: str, line: str) -> str:
    """``toml`` with ``line`` in its [server] table (added if it has none)."""
    if "[server]" in toml:
        return toml.replace("[server]", "[server]\n" + line, 1)
    return f"{toml}\n[server]\n{line}\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.batching")
    p.add_argument("--model", default="models/hybrid-mid.gguf")
    p.add_argument("--json", default="results/batching.json")
    p.add_argument("--systems", default="statecache,llama-server")
    p.add_argument("--n-ctx", type=int, default=12288, help="context per lane")
    p.add_argument("--long", type=int, default=8000, help="tokens of the long prompt")
    p.add_argument("--out-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--log-dir", default="results/logs")
    p.add_argument("--statecache-config", default="",
                   help='TOML tables for statecache, e.g. "[engine]\\nmin_prefill_chunk = 2"')
    p.add_argument("--streams", default=",".join(STREAMS),
                   help="the numbers of concurrent streams to decode, of 1, 2 and 4 (e.g. "
                        "1 alone, for many repeats of one stream in the time of a few)")
    p.add_argument("--decode-only", action="store_true",
                   help="only the aggregate decode rates (no long prefill)")
    p.add_argument("--no-per-token", action="store_true",
                   help=f"without {PER_TOKEN} (statecache writing every token on its own)")
    p.add_argument("--against", default="", metavar="REV",
                   help="also statecache at git revision REV (a worktree of it), as the "
                        "system statecache@REV, paired with this checkout's statecache")
    p.add_argument("--against-config", default=None, metavar="TOML",
                   help="TOML tables for statecache@REV instead of --statecache-config's "
                        "(so --against HEAD compares two configs of one commit)")
    a = p.parse_args(argv)
    streams = tuple(c.strip() for c in a.streams.split(","))
    if not streams or any(c not in STREAMS for c in streams) or len(set(streams)) < len(streams):
        p.error(f"--streams: some of {', '.join(STREAMS)}, each once, got {a.streams!r}")
    # resolved: a checkout of another revision runs from its own folder
    spec = ModelSpec(Path(a.model).stem, Path(a.model).resolve(), is_gemma=False)
    against = f"statecache@{a.against}" if a.against else ""
    result: dict[str, Any] = {"model": spec.label, "date": time.strftime("%Y-%m-%d %H:%M"),
                              "interleaved": True, "repeats": a.repeats,
                              "stream_interval_ms": ServerConfig().stream_interval_ms}
    systems = []
    for system in a.systems.split(","):
        if system == "llama-server" and not LLAMA_SERVER.exists():
            result[system] = {"skipped": "not built (bench/build_llama_server.sh)"}
        else:
            systems.append(system)
        if system == "statecache" and not a.no_per_token:
            systems.append(PER_TOKEN)
    if against:
        systems.append(against)
    with contextlib.ExitStack() as stack:
        other_root = stack.enter_context(checkout(a.against)) if against else None
        # every system runs at once, each idle while another is measured
        servers: dict[str, Server] = {}
        for system in systems:
            extra = system_config(system, mine=a.statecache_config, theirs=a.against_config,
                                  against=against)
            servers[system] = stack.enter_context(running(
                "statecache" if system in (PER_TOKEN, against) else system, spec,
                n_ctx=a.n_ctx, lanes=4, log_dir=Path(a.log_dir), extra_config=extra,
                tag={PER_TOKEN: "-per-token", against: "-against"}.get(system, ""),
                root=other_root if system == against else None))
            _stream(servers[system].url, _prompt(100, 0), 16)  # warm-up
        direct = DirectDecoder(spec.path)
        stack.callback(direct.close)
        runs = decode_rates(servers, direct, a.out_tokens, a.repeats, streams)
        for other in (BINDING, "llama-server", against):
            if "statecache" in runs and other in runs:
                result[f"paired_statecache_{other}"] = paired(runs, "statecache", other)
        for name, rr in runs.items():
            r = {c: finite_median(v) for c, v in rr.items()}
            out = {"decode_tps": r, "decode_runs": rr}
            if "1" in r:
                out["scaling"] = {c: v / r["1"] for c, v in r.items()}
            srv = servers.get(name)
            if srv is not None:
                out.update(measure_system(srv, [s for s in servers.values() if s is not srv],
                                          a))
            result[name] = out
        if "1" in streams:
            result["direct_decode_tps"] = result[BINDING]["decode_tps"]["1"]
        if "2" in streams:  # two streams in lanes 0 and 1 against 0 and 2
            result["lane_gap"] = lane_gap(direct, a.out_tokens, a.repeats)
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))
    print(summary(result))
    return 0


def summary(result: dict[str, Any]) -> str:
    """Each system's median tokens/s per stream count, and statecache's paired ratios
    (the report's table of them)."""
    lines = []
    for name, r in result.items():
        if isinstance(r, dict) and "decode_tps" in r:
            lines.append(f"{name:32s} " + "  ".join(
                f"{c}: {v:7.1f}" for c, v in r["decode_tps"].items()))
    return "\n".join(lines + paired_table(result))


if __name__ == "__main__":
    raise SystemExit(main())
