"""One cold prefill, llama-server against our binding, alternated: where a cold turn's
time inside ``llama_decode`` goes when no proxy stands around it (issue 46's cold gap).

Each repeat prefills the same generated prompt (``--words`` random words, Gemma 3 by
default) in a fresh llama-server (``-np 2``, 2 threads, ubatches of 512, the context the
replay gives it) and then in a fresh ``proxy.engine.binding.Context`` with the settings
the engine uses (two lanes, a persistent threadpool polling 50, a full-size SWA cache),
and prints each time. ``--server`` may name several llama-server binaries (another
build: without OpenMP, say); ``--swa-window`` adds the binding with a window-sized SWA
cache.

    python -m bench.cold_prefill --repeats 2
    python -m bench.cold_prefill --server build/llama-server/cmake/bin/llama-server \\
        --server /tmp/ls-noomp/bin/llama-server --swa-window
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import urllib.request
from pathlib import Path

from bench.servers import LLAMA_SERVER, ROOT, ModelSpec, running
from proxy.models import gemma_model_path

LOG_DIR = ROOT / "results" / "logs"
WORDS = ["alpha", "beta", "gamma", "delta", "river", "mountain", "code", "function",
         "return", "value", "index", "table"]


def prompt_text(words: int, seed: int = 3) -> str:
    rnd = random.Random(seed)
    return " ".join(rnd.choice(WORDS) + str(rnd.randint(0, 999)) for _ in range(words))


def server_prefill(binary: Path, model: Path, text: str, n_ctx: int) -> tuple[int, float]:
    """A fresh llama-server as the replay starts it (bench/servers.py), one prefill."""
    spec = ModelSpec(model.stem, model, is_gemma=False)  # a raw prompt: no template
    with running("llama-server", spec, n_ctx=n_ctx, lanes=2, log_dir=LOG_DIR,
                 threads=2, binary=binary) as srv:
        body = json.dumps({"prompt": text, "n_predict": 1, "cache_prompt": False,
                           "temperature": 0}).encode()
        req = urllib.request.Request(srv.url + "/completion", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.load(r)
    return int(out["tokens_evaluated"]), out["timings"]["prompt_ms"] / 1000


def binding_prefill(model: Path, text: str, n_ctx: int, swa_full: bool) -> tuple[int, float]:
    # its own process: the model and context are gone before the next server starts
    code = (
        "import sys, time\n"
        "from proxy.engine.binding import init_backend\n"
        "from proxy.engine.binding.model import Model\n"
        "from proxy.engine.binding.context import Context, ContextParams\n"
        "init_backend()\n"
        "m = Model(sys.argv[1]); toks = m.tokenize(sys.stdin.read(), add_special=True)\n"
        "ctx = Context(m, ContextParams(n_ctx=2 * int(sys.argv[2]), n_seq_max=2, threads=2,"
        " poll=50, swa_full=sys.argv[3] == 'full'))\n"
        "t = time.perf_counter(); ctx.prefill(0, toks, 0)\n"
        "print(len(toks), time.perf_counter() - t)\n")
    out = subprocess.run([sys.executable, "-c", code, str(model), str(n_ctx),
                          "full" if swa_full else "window"], input=text, text=True,
                         capture_output=True, check=True).stdout.split()
    return int(out[-2]), float(out[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench.cold_prefill", description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="default: Gemma 3 270M")
    ap.add_argument("--words", type=int, default=5000, help="5,000: about 19,400 tokens")
    ap.add_argument("--n-ctx", type=int, default=32768, help="tokens per lane")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--server", type=Path, action="append", help="llama-server binaries")
    ap.add_argument("--swa-window", action="store_true")
    a = ap.parse_args(argv)
    model = a.model or gemma_model_path()
    servers = a.server or [LLAMA_SERVER]
    text = prompt_text(a.words)
    for r in range(a.repeats):
        for binary in servers:
            n, s = server_prefill(binary, model, text, a.n_ctx)
            print(f"r{r} llama-server {binary}: {n} tokens in {s:.2f} s", flush=True)
        for full in (True, False) if a.swa_window else (True,):
            n, s = binding_prefill(model, text, a.n_ctx, full)
            print(f"r{r} binding (SWA {'full' if full else 'window'}): {n} tokens in {s:.2f} s",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
