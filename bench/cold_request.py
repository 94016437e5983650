"""One recorded cold request, sent alone to fresh servers in turn: where a cold turn's
time goes with and without the cache around the same prefill (issue 46's cold gap).

Each repeat starts each variant fresh (2 lanes, 2 threads, the recorded context), sends
the fixture's first cold request (``bench.replay``'s, to llama-server as its own body)
and prints its TTFT and, for statecache, the time inside ``llama_decode``, its prefill
steps and the time its checkpoints took. Variants:

- ``llama-server``;
- ``statecache``: as configured by default;
- ``no-cache``: ``statecache serve --no-cache`` (no checkpoints, nothing cut short);
- ``share-grid``: ``cache.share_grid_tokens = 512`` (share points moved onto the steps'
  grid, where the memory publishes PARTIAL states: a hybrid, a window-sized SWA cache);
- ``no-disk``, ``no-compress``: ``cache.disk_enabled = false``, ``cache.compress_level =
  0`` (whether the disk writer's threads slow the prefill beside them);
- ``no-periodic``, ``no-periodic-no-disk``: ``cache.periodic_pages = 0`` (no periodic
  checkpoints: inside Claude Code's first turn they are FULL states), without the disk;
- ``exact``: ``cache.exact = true`` (every step and checkpoint on the grid of 512);
- ``shared-store``: with a shared tier (``[cache.remote]``) on a valkey-server this bench
  starts, a key prefix of its own each run (so no run reuses another's states).

Each line ends with the CPU time the server's threads other than its two busiest (the
engine's and ggml's, at 2 threads) ran during the request: the disk writer's, the event
loop's. At the end, a table of the prefill's time by depth, in bands of ``--band`` tokens,
the median over the repeats (a step's time shared by its tokens among the bands they lie
in): statecache's from its steps (``GET /admin/requests``'s
``steps_ms``, inside ``llama_decode``), llama-server's from its log (its progress lines, to
10 ms), so a gap shows where in the prompt it lies.

``--swa-window`` runs statecache's variants with ``model.swa_full = false``.

``--in-process`` compares inside one statecache server instead of across fresh ones: each
repeat sends the cold request twice, in turn, once as it is and once with llama-server's
``"cache_prompt": false`` (no checkpoints, every step on the grid: what ``--no-cache``
does, docs/api.md), to a server configured as the first of ``--variants`` that is
statecache's. Both start their system prompt with the repeat's own line, so
neither reuses anything. What differs between the two is only what the cache does for
one request; what a process does differently from another (where its buffers lie, what
ran before) is the same for both. It prints each pair's ratio of the time inside
``llama_decode`` and of the TTFT (cache ÷ no cache), their medians and a 95% confidence
interval (6 repeats or more).

    python -m bench.cold_request --repeats 2                    # every SWA cell kept
    python -m bench.cold_request --repeats 2 --swa-window \\
        --variants llama-server,statecache,no-cache,share-grid
    python -m bench.cold_request --repeats 3 --swa-window --variants no-cache,statecache \\
        --band 2048 --json results/cold-steps.json
    python -m bench.cold_request --in-process --repeats 6 --swa-window
    python -m bench.cold_request --pairs results/a.json,results/b.json --past 17000

``--pairs`` reads ``--in-process --json`` files back and pools their pairs: each pair's
time inside ``llama_decode`` in the tokens before a position and past it, with and
without the cache (a step's time shared among its tokens, so two step grids compare).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import re
import statistics
import sys
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from bench.batching import wait_quiet
from bench.paired import median_ci
from bench.remote import valkey
from bench.replay import (
    FIXTURES,
    MODELS,
    STATECACHE_CONFIG,
    Sent,
    last_record,
    load,
    model_spec,
    send,
)
from bench.servers import ROOT, ModelSpec, Server, running

VARIANTS = {  # name: (system, [cache] keys, serve flags)
    "llama-server": ("llama-server", "", ()),
    "statecache": ("statecache", "", ()),
    "no-cache": ("statecache", "", ("--no-cache",)),
    "share-grid": ("statecache", "share_grid_tokens = 512\n", ()),
    "no-disk": ("statecache", "disk_enabled = false\n", ()),
    "no-compress": ("statecache", "compress_level = 0\n", ()),
    "no-periodic": ("statecache", "periodic_pages = 0\n", ()),
    "no-periodic-no-disk": ("statecache", "periodic_pages = 0\ndisk_enabled = false\n", ()),
    "exact": ("statecache", "exact = true\n", ()),
    "shared-store": ("statecache", '[cache.remote]\nurl = "{store}"\nprefix = "{run}"\n', ()),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.cold_request", description=__doc__.split("\n")[0])
    ap.add_argument("--fixture", default="claude-gemma3", help="bench/fixtures/agents/NAME")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default="llama-server,statecache,no-cache")
    ap.add_argument("--swa-window", action="store_true", help="model.swa_full = false")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "results" / "logs")
    ap.add_argument("--band", type=int, default=4096, help="tokens a row of the depth table")
    ap.add_argument("--json", type=Path, help="write each run's steps here")
    ap.add_argument("--in-process", action="store_true",
                    help="one statecache server: the request with and without the cache")
    ap.add_argument("--pairs", help="read back --in-process --json files (comma-separated): "
                    "their pairs pooled, split at --past")
    ap.add_argument("--past", type=int, default=17000,
                    help="--pairs: each pair's time in the tokens before and past this one")
    a = ap.parse_args(argv)
    if a.pairs:
        print("\n".join(pooled_pairs([json.loads(Path(f).read_text())
                                      for f in a.pairs.split(",")], a.past)))
        return 0
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    fx = load(FIXTURES / f"{a.fixture}.jsonl.zst")
    cold = next(r for r in fx.requests if r.kind == "cold")
    spec, n_ctx = model_spec(fx.model), MODELS[fx.model][0]
    steps: dict[str, list[list[tuple[int, int, float]]]] = {n: [] for n in names}
    with contextlib.ExitStack() as stack:
        store = ""
        if any("{store}" in VARIANTS[n][1] for n in names):
            store = stack.enter_context(valkey(Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="bench-cold-store-")))))
        if a.in_process:
            return in_process(cold, spec, n_ctx, a, store)
        _fresh_servers(cold, spec, n_ctx, a, names, steps, store)
    if a.json:
        a.json.write_text(json.dumps({"command": " ".join(sys.argv), "steps": steps}))
    bands = {n: [by_band(run, a.band) for run in runs] for n, runs in steps.items()}
    print()
    print("\n".join(depth_table(bands, a.band)))
    return 0


def _fresh_servers(cold: Sent, spec: ModelSpec, n_ctx: int, a: argparse.Namespace,
                   names: list[str], steps: dict[str, list[list[tuple[int, int, float]]]],
                   store: str) -> None:
    """Each repeat, each variant on a fresh server: its line, its steps into ``steps``."""
    for r in range(a.repeats):
        for name in names:
            system, cache_keys, flags = VARIANTS[name]
            ours = system == "statecache"
            cache_keys = cache_keys.replace("{store}", store).replace("{run}", f"r{r}-{name}")
            with running(system, spec, n_ctx=n_ctx, lanes=2, log_dir=a.log_dir,
                         extra_config=cache_keys + STATECACHE_CONFIG if ours else "",
                         extra_args=flags, tag=f"-cold-r{r}",
                         model_config="swa_full = false\n" if ours and a.swa_window else ""
                         ) as srv:
                before = srv.thread_cpu_ns()
                status, ttft, _, err = send(srv.url, cold, peer=not ours)
                ran = sorted(ns - before.get(tid, 0) for tid, ns in srv.thread_cpu_ns().items())
                line = f"r{r} {name}: {status} TTFT {ttft:.2f} s"
                if ours:
                    run, _, said = prefill_record(srv)
                    steps[name].append(run)
                    line += f", {said}"
                line += f"; other threads {sum(ran[:-2]) / 1e9:.2f} s CPU"
                print(line + (f" ({err})" if err else ""), flush=True)
            if not ours:
                steps[name].append(llama_server_steps(srv.log_path))


def in_process(cold: Sent, spec: ModelSpec, n_ctx: int, a: argparse.Namespace,
               store: str = "") -> int:
    """``--in-process``: the pairs in one server, and their ratios."""
    names = ("cache", "no cache")
    ratios: dict[str, list[float]] = {"llama_decode": [], "TTFT": []}
    steps: dict[str, list[list[tuple[int, int, float]]]] = {n: [] for n in names}
    variant = next((n for n in a.variants.split(",") if VARIANTS[n][0] == "statecache"
                    and "--no-cache" not in VARIANTS[n][2]), "statecache")
    _, cache_keys, flags = VARIANTS[variant]
    cache_keys = cache_keys.replace("{store}", store).replace("{run}", "in-process")
    print(f"statecache as in variant {variant!r}", flush=True)
    with running("statecache", spec, n_ctx=n_ctx, lanes=2, log_dir=a.log_dir,
                 extra_config=cache_keys + STATECACHE_CONFIG, extra_args=flags,
                 tag=f"-cold-in-process-{variant}",
                 model_config="swa_full = false\n" if a.swa_window else "") as srv:
        for r in range(a.repeats):
            took: dict[str, tuple[float, float]] = {}
            for name in names if r % 2 == 0 else names[::-1]:
                wait_quiet([srv.proc.pid])
                req = with_line(cold, f"Run {r}.", cache=name == "cache")
                status, ttft, usage, err = send(srv.url, req)
                run, decode_s, said = prefill_record(srv)
                steps[name].append(run)
                took[name] = (decode_s, ttft)
                print(f"r{r} {name}: {status} TTFT {ttft:.2f} s, {said}, reused "
                      f"{usage.get('cached', 0)}" + (f" ({err})" if err else ""), flush=True)
            for i, key in enumerate(ratios):
                if took["no cache"][i] > 0:
                    ratios[key].append(took["cache"][i] / took["no cache"][i])
    if a.json:
        a.json.write_text(json.dumps({"command": " ".join(sys.argv), "steps": steps,
                                      "ratios": ratios}))
    print()
    for key, xs in ratios.items():
        ci = median_ci(xs)
        print(f"cache ÷ no cache, {key}: median {statistics.median(xs):.3f}"
              + (f" (95% CI {ci[0]:.3f} to {ci[1]:.3f})" if ci else " (too few repeats for a CI)")
              + f", pairs {', '.join(f'{x:.3f}' for x in xs)}")
    bands = {n: [by_band(run, a.band) for run in runs] for n, runs in steps.items()}
    print()
    print("\n".join(depth_table(bands, a.band)))
    return 0


def prefill_record(srv: Server) -> tuple[list[tuple[int, int, float]], float, str]:
    """The server's last request, from ``/admin/requests``: its prefill steps (start,
    tokens, seconds), its seconds inside ``llama_decode``, and a line that says so."""
    rec = last_record(srv)
    ph = rec.get("phases_ms", {})
    decode_s = ph.get("llama_decode", 0) / 1000
    said = (f"llama_decode {decode_s:.2f} s in {ph.get('prefill_steps')} steps, "
            f"checkpoints {ph.get('checkpoints', 0):.0f} ms")
    return [(p, n, ms / 1000) for p, n, ms in rec.get("steps_ms", [])], decode_s, said


def with_line(req: Sent, line: str, *, cache: bool) -> Sent:
    """``req`` with ``line`` on a line of its own before its system prompt or
    instructions (before its first message where it has neither), and
    ``"cache_prompt": false`` unless ``cache``."""
    body = json.loads(req.body)
    system = body.get("system")
    if isinstance(body.get("instructions"), str):  # Responses
        body["instructions"] = f"{line}\n{body['instructions']}"
    elif isinstance(system, str):
        body["system"] = f"{line}\n{system}"
    elif isinstance(system, list) and system and isinstance(system[0].get("text"), str):
        system[0]["text"] = f"{line}\n{system[0]['text']}"
    else:  # the first message's first text: a chat's or Responses' input
        first = (body.get("messages") or body["input"])[0]
        if isinstance(first.get("content"), str):
            first["content"] = f"{line}\n{first['content']}"
        else:
            part = next(c for c in first["content"] if isinstance(c.get("text"), str))
            part["text"] = f"{line}\n{part['text']}"
    if not cache:
        body["cache_prompt"] = False
    headers = tuple((k, v) for k, v in req.headers if k.lower() != "content-length")
    return dataclasses.replace(req, headers=headers, body=json.dumps(body).encode())


_PROGRESS = re.compile(r"prompt processing, n_tokens = +(\d+),.* t = +([\d.]+) s")


def llama_server_steps(log: Path) -> list[tuple[int, int, float]]:
    """llama-server's prefill of the first request in ``log`` as (first position, tokens,
    seconds) between its progress lines (to 10 ms: it prints seconds to two places)."""
    out: list[tuple[int, int, float]] = []
    pos, t = 0, 0.0
    for line in log.read_text(errors="replace").splitlines():
        if "task 0 " not in line:
            continue
        m = _PROGRESS.search(line)
        if m:
            end, at = int(m[1]), float(m[2])
            out.append((pos, end - pos, at - t))
            pos, t = end, at
    return out


def split_at(steps: Iterable[tuple[int, int, float]], at: int) -> tuple[float, float]:
    """Seconds of the tokens before position ``at`` and of those at or past it, each
    step's time shared among its tokens (as ``by_band``)."""
    before = past = 0.0
    for pos, n, s in steps:
        inside = min(max(at - pos, 0), n)
        before += s * inside / n
        past += s * (n - inside) / n
    return before, past


def pooled_pairs(runs: list[dict[str, Any]], at: int) -> list[str]:
    """``--pairs``: the in-process runs' pairs together: each pair's seconds inside
    ``llama_decode`` before and past token ``at``, with and without the cache, how many
    pairs have the cache slower past it, and the pooled ratios' median and 95% CI."""
    lines, slower, ratios = [], 0, []
    for data in runs:
        ratios += data["ratios"]["llama_decode"]
        for c, n in zip(data["steps"]["cache"], data["steps"]["no cache"], strict=True):
            (cb, cp), (nb, np_) = split_at(c, at), split_at(n, at)
            slower += cp > np_
            lines.append(f"before {at:,}: {cb:.2f} vs {nb:.2f} s ({cb / nb:.3f}); past it: "
                         f"{cp:.2f} vs {np_:.2f} s ({cp - np_:+.2f} s)")
    ci = median_ci(ratios)
    lines.append(f"the cache slower past {at:,} in {slower} of {len(lines)} pairs; "
                 f"cache ÷ no cache inside llama_decode, {len(ratios)} pairs: median "
                 f"{statistics.median(ratios):.3f}"
                 + (f" (95% CI {ci[0]:.3f} to {ci[1]:.3f})" if ci else ""))
    return lines


def by_band(steps: Iterable[tuple[int, int, float]], band: int) -> dict[int, float]:
    """Seconds by band of ``band`` tokens, each step's time shared among the bands its
    tokens lie in (so prefills whose steps start at other positions compare)."""
    out: dict[int, float] = {}
    for pos, n, s in steps:
        for b in range(pos // band, (pos + n - 1) // band + 1):
            inside = min(pos + n, (b + 1) * band) - max(pos, b * band)
            out[b] = out.get(b, 0.0) + s * inside / n
    return out


def depth_table(bands: dict[str, list[dict[int, float]]], band: int) -> list[str]:
    """Markdown: the median seconds of each band by variant, over the repeats."""
    names = [n for n, runs in bands.items() if runs]
    rows = sorted({b for runs in bands.values() for run in runs for b in run})
    lines = ["| steps starting at | " + " | ".join(names) + " |",
             "|---|" + "---:|" * len(names)]
    for b in rows:
        cells = [f"{statistics.median(run.get(b, 0.0) for run in bands[n]):.2f}"
                 for n in names]
        lines.append(f"| {b * band:,} | " + " | ".join(cells) + " |")
    totals = [f"{statistics.median(sum(run.values()) for run in bands[n]):.2f}" for n in names]
    lines.append("| all | " + " | ".join(totals) + " |")
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
