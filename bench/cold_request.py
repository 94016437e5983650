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
  checkpoints: inside Claude Code's first turn they are FULL states), without the disk.

Each line ends with the CPU time the server's threads other than its two busiest (the
engine's and ggml's, at 2 threads) ran during the request: the disk writer's, the event
loop's.

``--swa-window`` runs statecache's variants with ``model.swa_full = false``.

    python -m bench.cold_request --repeats 2                    # every SWA cell kept
    python -m bench.cold_request --repeats 2 --swa-window \\
        --variants llama-server,statecache,no-cache,share-grid
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.replay import FIXTURES, MODELS, STATECACHE_CONFIG, last_record, load, model_spec, send
from bench.servers import ROOT, running

VARIANTS = {  # name: (system, [cache] keys, serve flags)
    "llama-server": ("llama-server", "", ()),
    "statecache": ("statecache", "", ()),
    "no-cache": ("statecache", "", ("--no-cache",)),
    "share-grid": ("statecache", "share_grid_tokens = 512\n", ()),
    "no-disk": ("statecache", "disk_enabled = false\n", ()),
    "no-compress": ("statecache", "compress_level = 0\n", ()),
    "no-periodic": ("statecache", "periodic_pages = 0\n", ()),
    "no-periodic-no-disk": ("statecache", "periodic_pages = 0\ndisk_enabled = false\n", ()),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.cold_request", description=__doc__.split("\n")[0])
    ap.add_argument("--fixture", default="claude-gemma3", help="bench/fixtures/agents/NAME")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--variants", default="llama-server,statecache,no-cache")
    ap.add_argument("--swa-window", action="store_true", help="model.swa_full = false")
    ap.add_argument("--log-dir", type=Path, default=ROOT / "results" / "logs")
    a = ap.parse_args(argv)
    names = a.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"unknown variants {unknown}; known: {', '.join(VARIANTS)}")
    fx = load(FIXTURES / f"{a.fixture}.jsonl.zst")
    cold = next(r for r in fx.requests if r.kind == "cold")
    spec, n_ctx = model_spec(fx.model), MODELS[fx.model][0]
    for r in range(a.repeats):
        for name in names:
            system, cache_keys, flags = VARIANTS[name]
            ours = system == "statecache"
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
                    ph = last_record(srv).get("phases_ms", {})
                    line += (f", llama_decode {ph.get('llama_decode', 0) / 1000:.2f} s in "
                             f"{ph.get('prefill_steps')} steps, checkpoints "
                             f"{ph.get('checkpoints', 0):.0f} ms")
                line += f"; other threads {sum(ran[:-2]) / 1e9:.2f} s CPU"
                print(line + (f" ({err})" if err else ""), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
