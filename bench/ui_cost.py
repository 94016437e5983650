"""What the live page (``GET /ui``) costs the server: the page's size in bytes, and the
server's CPU per second during a 4-stream decode with the page open (its one request
for ``/admin/ui.json`` a second, as the page makes) against the page closed.

    python -m bench.ui_cost --model models/hybrid-mid.gguf

The phases alternate (closed, open, closed, open, ...) on one server under the same
decode, so drift falls on both. CPU is read from ``/proc`` per thread: the whole
process, and its main thread alone, the event loop, where the page's requests are
answered (the engine thread and ggml's compute threads are the rest). On a machine whose
cores the decode fills, the process total cannot grow much; a cost shows as loop time
and as fewer decoded tokens, so both are printed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import _sse_lines
from bench.servers import ROOT, THREADS, ModelSpec, running

STREAMS = 4
SYSTEM = ("You are a coding agent working in a Python repository. Read files before you "
          "change them, run the tests after each change and report what you did. ") * 12
_TICK = os.sysconf("SC_CLK_TCK")


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as r:
        return bytes(r.read())


def cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of ``pid`` so far: the scheduler's nanoseconds on a CPU
    (``schedstat``; ``stat``'s user and system time count in ticks of 10 ms, as coarse as
    the cost measured)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0]) / 1e9
        except OSError:
            continue  # the thread ended
    return out


def busy() -> float:
    """CPU seconds the whole machine has been busy (every core, /proc/stat)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle, iowait
    return (sum(fields[:8]) - idle) / _TICK


def stepped(url: str) -> float:
    """Tokens through the model so far (every lane's steps: decode, and the little prefill
    a new turn of a cached conversation needs). The generated-tokens counter moves only
    when a request ends, too seldom for phases of seconds."""
    for line in _get(url + "/metrics").decode().splitlines():
        if line.startswith("statecache_step_tokens_total "):
            return float(line.split()[1])
    raise RuntimeError("no statecache_step_tokens_total in /metrics")


def decode(url: str, worker: int, stop: threading.Event, max_tokens: int) -> None:
    """One stream after another, each a new turn of this worker's conversation; the
    workers start apart, so that their turns do not end together."""
    turn = 0
    stop.wait(0.5 * worker)
    while not stop.is_set():
        turn += 1
        body = {"model": "bench", "stream": True, "temperature": 0.0, "max_tokens": max_tokens,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": f"Task {worker}.{turn}: fix the "
                                                         f"failing test number {worker}."}]}
        for _ in _sse_lines(url, body):
            if stop.is_set():
                break


@dataclass
class Poller:
    """The page's requests: one for ``/admin/ui.json`` each ``1 / hz`` seconds after the
    last one answered (the page's ``setTimeout`` after each draw)."""

    url: str
    hz: float
    stop: threading.Event = field(default_factory=threading.Event)
    sizes: list[int] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)

    def run(self) -> None:
        while not self.stop.wait(1.0 / self.hz):
            t0 = time.perf_counter()
            self.sizes.append(len(_get(self.url + "/admin/ui.json")))
            self.latencies.append(time.perf_counter() - t0)


def phase(url: str, pid: int, seconds: float, hz: float) -> dict[str, Any]:
    poller = Poller(url, hz) if hz else None
    thread = threading.Thread(target=poller.run) if poller else None
    tokens0, cpu0, t0 = stepped(url), cpu(pid), time.perf_counter()
    busy0, own0 = busy(), sum(cpu(os.getpid()).values())
    if thread is not None:
        thread.start()
    time.sleep(seconds)
    if poller is not None and thread is not None:
        poller.stop.set()
        thread.join()
    tokens1, cpu1, t1 = stepped(url), cpu(pid), time.perf_counter()
    busy1, own1 = busy(), sum(cpu(os.getpid()).values())
    wall = t1 - t0
    used = {tid: s - cpu0.get(tid, 0.0) for tid, s in cpu1.items()}
    server = sum(used.values())
    return {"hz": hz, "wall_s": wall, "cpu_per_s": server / wall,
            "others_cpu_per_s": max(0.0, busy1 - busy0 - server - (own1 - own0)) / wall,
            "loop_cpu_per_s": used.get(pid, 0.0) / wall, "tokens_per_s": (tokens1 - tokens0) / wall,
            "polls": len(poller.sizes) if poller else 0,
            "json_bytes": statistics.mean(poller.sizes) if poller and poller.sizes else 0,
            "poll_ms": 1000 * statistics.mean(poller.latencies)
            if poller and poller.latencies else 0}


def measure(model: Path, seconds: float, repeats: int, rates: list[float], max_tokens: int,
            log_dir: Path) -> dict[str, Any]:
    spec = ModelSpec(model.stem, model.resolve(), is_gemma=False)
    with running("statecache", spec, n_ctx=8192, lanes=STREAMS, log_dir=log_dir,
                 root=ROOT) as srv:
        page = _get(srv.url + "/ui")
        stop = threading.Event()
        workers = [threading.Thread(target=decode, args=(srv.url, i, stop, max_tokens))
                   for i in range(STREAMS)]
        for w in workers:
            w.start()
        try:
            time.sleep(min(seconds, 10.0))  # every lane decoding, checkpoints held
            rows = [phase(srv.url, srv.proc.pid, seconds, hz)
                    for _ in range(repeats) for hz in (0.0, *rates)]
        finally:
            stop.set()
            for w in workers:
                w.join()
    return {"model": spec.label, "cores": THREADS, "streams": STREAMS, "seconds": seconds,
            "page_bytes": len(page), "page_gzip_bytes": len(gzip.compress(page, 9)),
            "date": time.strftime("%Y-%m-%d %H:%M"), "phases": rows}


def _mean(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.mean(r[key] for r in rows)


def table(res: dict[str, Any], max_others: float) -> str:
    """The means of each kind of phase, leaving out the phases during which other
    processes took more than ``max_others`` CPU s/s (on 2 cores one busy neighbour cuts
    a 4-stream decode to a few tokens/s: docs/configuration.md, "Threads on a busy
    machine")."""
    clean = [r for r in res["phases"] if r["others_cpu_per_s"] <= max_others]
    lines = [f"{res['model']}, {res['streams']} streams decoding, {res['cores']} cores, "
             f"phases of {res['seconds']:.0f} s",
             f"page: {res['page_bytes']:,} bytes ({res['page_gzip_bytes']:,} gzipped; "
             "served uncompressed)", "",
             "| page | phases | server CPU s/s | event loop CPU s/s | model tokens/s | "
             "polls | ui.json bytes | ms per poll | other processes CPU s/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    by_hz: dict[float, list[dict[str, Any]]] = {}
    for r in clean:
        by_hz.setdefault(r["hz"], []).append(r)
    closed = by_hz.get(0.0, [])
    for hz, rows in by_hz.items():
        cpu_s, loop_s, tps = (_mean(rows, k) for k in ("cpu_per_s", "loop_cpu_per_s",
                                                        "tokens_per_s"))
        polls = sum(r["polls"] for r in rows)
        name = f"open, {hz:g} poll/s" if hz else "closed"
        lines.append(f"| {name} | {len(rows)} | {cpu_s:.3f} | {loop_s:.4f} | {tps:.1f} | "
                     f"{polls} | {_mean(rows, 'json_bytes'):,.0f} | "
                     f"{_mean(rows, 'poll_ms'):.1f} | {_mean(rows, 'others_cpu_per_s'):.2f} |")
        if hz and closed:
            d_cpu = cpu_s - _mean(closed, "cpu_per_s")
            d_loop = loop_s - _mean(closed, "loop_cpu_per_s")
            d_tps = tps - _mean(closed, "tokens_per_s")
            per_poll = d_loop * sum(r["wall_s"] for r in rows) / max(1, polls)
            lines.append(f"| open minus closed | | {d_cpu:+.3f} | {d_loop:+.4f} | {d_tps:+.1f} "
                         f"| | | event loop: {1000 * per_poll:.1f} ms CPU per poll | |")
    left = len(res["phases"]) - len(clean)
    if left:
        lines += ["", f"{left} of {len(res['phases'])} phases left out: other processes took "
                  f"more than {max_others:g} CPU s/s during them"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.ui_cost", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/hybrid-mid.gguf")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each phase")
    p.add_argument("--repeats", type=int, default=4, help="closed/open rounds")
    p.add_argument("--rates", default="1",
                   help="polls per second of the open phases, comma-separated (the page: 1)")
    p.add_argument("--max-tokens", type=int, default=4096,
                   help="tokens per turn of a stream (long: the streams rarely restart)")
    p.add_argument("--max-others", type=float, default=0.1,
                   help="leave out phases in which other processes took more CPU s/s")
    p.add_argument("--log-dir", default="results/logs")
    p.add_argument("--json", help="write the result here")
    a = p.parse_args(argv)
    res = measure(Path(a.model), a.seconds, a.repeats, [float(r) for r in a.rates.split(",")],
                  a.max_tokens, Path(a.log_dir))
    print(table(res, a.max_others))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
