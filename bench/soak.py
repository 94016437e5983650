"""A soak: concurrent multi-turn sessions over the four APIs against one statecache, with
clients that leave mid-stream and requests that are malformed, while a second statecache
with the cache off answers a share of the same requests cold. Every reply must match the
cold one (greedy), every malformed request must get its 400 with an error body, and
nothing else may fail; the server's RSS, its checkpoint tiers and its exit on SIGINT are
reported. It exits 1 on any failure.

    python -m bench.soak --model models/hybrid-tiny.gguf --seconds 360

Both servers run one compute thread each, so the two never ask for more cores than
these 2 (with every core each, ggml's spinning barriers on an oversubscribed machine
slowed a 40-token reply to 28 s). A small RAM budget (``--ram-budget``) makes the pool
evict and read states back from disk within minutes.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.harness import _sse_lines
from bench.servers import ModelSpec, Server, running

APIS = ("chat", "chat (not streamed)", "messages", "responses")
# (body, what it is): each must get a 400 with an OpenAI-style error body
MALFORMED: tuple[tuple[bytes, str], ...] = (
    (b"{not json", "not JSON"),
    (json.dumps({"model": "x", "messages": "hi"}).encode(), "messages not a list"),
    (json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": -5}).encode(), "negative max_tokens"),
    (json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}],
                 "temperature": "hot"}).encode(), "temperature a string"),
    (json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}],
                 "max_tokens": 10**9}).encode(), "max_tokens past the context"),
    (json.dumps({"model": "x", "messages": [{"role": "wizard", "content": "hi"}]}).encode(),
     "unknown role"),
)
SYSTEM_PROMPTS = tuple("You are a coding agent. Tools: read_file, write_file, run_shell. " * k
                       for k in (5, 10, 15))  # shared by many sessions, as an agent's are


@dataclass
class Tally:
    """What the clients saw; ``failures`` is everything that must not happen."""

    replies: int = 0
    left: int = 0  # streams the client left after a few chunks
    malformed: int = 0  # malformed requests answered with their 400
    compared: int = 0  # replies compared with the cache-off server's
    failures: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, what: str, n: int = 1) -> None:
        with self.lock:
            setattr(self, what, getattr(self, what) + n)

    def fail(self, msg: str) -> None:
        with self.lock:
            self.failures.append(msg[:400])


def _post(url: str, path: str, raw: bytes) -> tuple[http.client.HTTPConnection,
                                                    http.client.HTTPResponse]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


def ask(url: str, api: str, messages: list[dict[str, str]], max_tokens: int,
        leave_after: int | None = None) -> str | None:
    """The reply text of one greedy request by ``api``; None: the client left after
    ``leave_after`` events. RuntimeError for anything but a whole reply."""
    system, turns = messages[0]["content"], messages[1:]
    if api == "messages":
        path, body = "/v1/messages", {"system": system, "messages": turns}
        body["max_tokens"] = max_tokens
    elif api == "responses":
        path, body = "/v1/responses", {"instructions": system, "input": turns,
                                       "max_output_tokens": max_tokens}
    else:
        path, body = "/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens}
    body.update(model="x", temperature=0, stream=api != "chat (not streamed)")
    if not body["stream"]:
        conn, resp = _post(url, path, json.dumps(body).encode())
        try:
            if resp.status != 200:
                raise RuntimeError(f"{api}: HTTP {resp.status} {resp.read()[:300]!r}")
            return str(json.loads(resp.read())["choices"][0]["message"].get("content") or "")
        finally:
            conn.close()
    parts: list[str] = []
    ended = False
    # closing: leaving the loop early closes the connection, which is the client leaving
    with contextlib.closing(_sse_lines(url, body, path)) as lines:
        events = (json.loads(line[5:]) for line in lines
                  if line.startswith("data:") and line[5:].strip() != "[DONE]")
        for n, ev in enumerate(events, 1):
            if "error" in ev or ev.get("type") in ("error", "response.failed"):
                raise RuntimeError(f"{api}: error event {ev}")
            if api == "chat":
                parts += [(c.get("delta") or {}).get("content") or "" for c in ev["choices"]]
                ended = ended or any(c.get("finish_reason") for c in ev["choices"])
            elif api == "messages":
                if ev.get("type") == "content_block_delta":
                    parts.append(ev["delta"].get("text", ""))
                ended = ended or ev.get("type") == "message_stop"
            else:
                if ev.get("type") == "response.output_text.delta":
                    parts.append(ev["delta"])
                ended = ended or ev.get("type") in ("response.completed", "response.incomplete")
            if leave_after is not None and n >= leave_after:
                return None
    if not ended:
        raise RuntimeError(f"{api}: the stream ended without its last event")
    return "".join(parts)


def session_client(i: int, url: str, cold_url: str, done: Callable[[], bool],
                   compare: float, tally: Tally) -> None:
    """Sessions of 1 to 6 turns until ``done()``: each turn a reply by a random API (kept in
    the conversation), a stream the client leaves (not kept) or a malformed request; a
    share ``compare`` of the replies asked again of the cache-off server."""
    rng = random.Random(i)
    while not done():
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}]
        for turn in range(rng.randint(1, 6)):
            if done():
                return
            task = f"please do task {rng.randint(0, 999)} " * rng.randint(1, 8)
            messages.append({"role": "user", "content": f"turn {turn}, client {i}: {task}"})
            max_tokens = rng.randint(4, 48)
            roll = rng.random()
            try:
                if roll < 0.08:
                    raw, what = rng.choice(MALFORMED)
                    conn, resp = _post(url, "/v1/chat/completions", raw)
                    body = resp.read()
                    conn.close()
                    if resp.status == 400 and b'"error"' in body:
                        tally.add("malformed")
                    else:
                        tally.fail(f"{what}: HTTP {resp.status} {body[:200]!r}")
                    messages.pop()
                elif roll < 0.23:
                    if ask(url, "chat", messages, max_tokens, rng.randint(1, 3)) is not None:
                        tally.fail("a stream the client meant to leave ended first")
                    tally.add("left")
                    messages.pop()
                else:
                    api = rng.choice(APIS)
                    reply = ask(url, api, messages, max_tokens)
                    assert reply is not None
                    tally.add("replies")
                    if rng.random() < compare:
                        cold = ask(cold_url, api, messages, max_tokens)
                        tally.add("compared")
                        if cold != reply:
                            tally.fail(f"{api}, {len(messages)} messages, max_tokens "
                                       f"{max_tokens}: {reply[:60]!r} cold {cold!r:.60}")
                    messages.append({"role": "assistant", "content": reply})
            except Exception as exc:  # noqa: BLE001 - every failure is reported
                tally.fail(f"client {i}: {exc!r}")
                break


def _stop(srv: Server) -> int | None:
    """SIGINT, as a user's Ctrl-C: the exit status (None: it did not exit in 60 s)."""
    srv.proc.send_signal(signal.SIGINT)
    with contextlib.suppress(Exception):
        return srv.proc.wait(timeout=60)
    return None


def soak(model: Path, seconds: float, clients: int, ram_budget: str, compare: float,
         log_dir: Path, on_tick: Callable[[str], None] = print,
         disk_max_checkpoints: int = 0, replies: int = 0) -> dict[str, Any]:
    """``seconds`` of sessions, and on until ``replies`` replies have come: a test asks
    for an amount of work, which a busy machine takes longer to do, not for a time."""
    spec = ModelSpec(model.stem, model.resolve(), is_gemma=False)
    tally = Tally()
    rss: list[int] = []
    cfg = f'ram_budget = "{ram_budget}"\n'  # appended to the [cache] table
    if disk_max_checkpoints:
        cfg += f"disk_max_checkpoints = {disk_max_checkpoints}\n"
    with running("statecache", spec, n_ctx=4096, lanes=4, log_dir=log_dir, extra_config=cfg,
                 threads=1) as srv, \
            running("no-cache", spec, n_ctx=4096, lanes=4, log_dir=log_dir, threads=1) as cold:
        t0 = time.monotonic()
        until = t0 + seconds

        def done() -> bool:
            return time.monotonic() >= until and tally.replies >= replies

        threads = [threading.Thread(target=session_client,
                                    args=(i, srv.url, cold.url, done, compare, tally))
                   for i in range(clients)]
        for t in threads:
            t.start()
        while any(t.is_alive() for t in threads):
            time.sleep(min(15.0, max(0.5, until - time.monotonic())))
            rss.append((srv.rss_kb() or 0) // 1024)
            on_tick(f"{time.monotonic() - t0:5.0f} s  RSS {rss[-1]:,} MiB  replies "
                    f"{tally.replies}  left {tally.left}  malformed {tally.malformed}  "
                    f"compared {tally.compared}  failures {len(tally.failures)}")
        for t in threads:
            t.join()
        took = time.monotonic() - t0
        metrics = srv.metrics()
        exits = {"statecache": _stop(srv), "no-cache": _stop(cold)}
    for name, rc in exits.items():
        if rc != 0:
            tally.fail(f"{name} exited with {rc} on SIGINT")
    keys = ('statecache_evictions_total{tier="ram"}', 'statecache_checkpoint_bytes{tier="ram"}',
            "statecache_disk_writes_total", 'statecache_pool_hits_total{tier="disk"}',
            "statecache_disk_write_errors_total", "statecache_pool_quarantined")
    return {"model": spec.label, "seconds": seconds, "took_s": took, "clients": clients,
            "ram_budget": ram_budget, "replies": tally.replies, "left": tally.left,
            "malformed": tally.malformed, "compared": tally.compared,
            "failures": tally.failures, "rss_mib": rss,
            "metrics": {k: metrics.get(k) for k in keys}, "exits": exits}


def summary(res: dict[str, Any]) -> str:
    rss = res["rss_mib"] or [0]
    lines = [f"{res['model']}, {res['clients']} clients for {res['took_s']:.0f} s, RAM budget "
             f"{res['ram_budget']}: {res['replies']:,} replies ({res['compared']:,} compared "
             f"with the cache off), {res['left']:,} streams left mid-way, "
             f"{res['malformed']:,} malformed requests answered 400",
             f"RSS MiB: first {rss[0]:,}, peak {max(rss):,}, last {rss[-1]:,}"]
    lines += [f"{k} {v:,.0f}" for k, v in res["metrics"].items() if v is not None]
    lines.append(f"exit on SIGINT: {res['exits']}")
    lines.append(f"failures: {len(res['failures'])}")
    lines += [f"  {f}" for f in res["failures"][:20]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.soak", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/hybrid-tiny.gguf")
    p.add_argument("--seconds", type=float, default=360.0)
    p.add_argument("--clients", type=int, default=5)
    p.add_argument("--ram-budget", default="256MiB")
    p.add_argument("--compare", type=float, default=0.35,
                   help="share of the replies asked again of the cache-off server")
    p.add_argument("--replies", type=int, default=0,
                   help="go on past --seconds until this many replies have come")
    p.add_argument("--log-dir", default="results/logs")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--disk-max-checkpoints", type=int, default=0,
                   help="cache.disk_max_checkpoints (0: the default config's)")
    a = p.parse_args(argv)
    res = soak(Path(a.model), a.seconds, a.clients, a.ram_budget, a.compare, Path(a.log_dir),
               disk_max_checkpoints=a.disk_max_checkpoints, replies=a.replies)
    print(summary(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 1 if res["failures"] else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
