"""One stream's decode rate through statecache with and without busy processes beside it
(``while True: pass``, one per ``--busy``), for compute threads on every core and on one
fewer: what a coding agent's build or test run on the same CPU does to the model.

    python -m bench.contention --model models/hybrid-mid.gguf

ggml's threads meet at a barrier after every operation of the graph and spin there: when
another process takes a core, the thread that lost it holds up the others until the
scheduler gives it back, once per operation. So a decode on every core slows by far more
than the share of the CPU it lost; one on fewer threads than cores loses little.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.batching import _prompt, _stream
from bench.servers import THREADS, ModelSpec, running


@contextlib.contextmanager
def busy(n: int) -> Iterator[list[subprocess.Popen[bytes]]]:
    """``n`` processes that spin on a core each until the block ends."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5 if n else 0.0)  # scheduled and spinning
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


def rate(url: str, tokens: int) -> float:
    """Tokens/s of one greedy stream, from its first token to its last."""
    arrivals = _stream(url, _prompt(200, 10), tokens)["arrivals"]
    if len(arrivals) < 2 or arrivals[-1] <= arrivals[0]:
        return float("nan")
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def measure(model: Path, tokens: int, busy_procs: int, threads: list[int],
            log_dir: Path) -> dict[str, Any]:
    spec = ModelSpec(model.stem, model.resolve(), is_gemma=False)
    rows = []
    for t in threads:
        with running("statecache", spec, n_ctx=4096, lanes=4, log_dir=log_dir,
                     threads=t) as srv:
            _stream(srv.url, _prompt(200, 10), 16)  # warm-up
            quiet = rate(srv.url, tokens)
            with busy(busy_procs):
                loaded = rate(srv.url, tokens)
        rows.append({"threads": t, "quiet_tps": quiet, "busy_tps": loaded})
    return {"model": spec.label, "cores": THREADS, "busy": busy_procs, "tokens": tokens,
            "date": time.strftime("%Y-%m-%d %H:%M"), "runs": rows}


def table(res: dict[str, Any]) -> str:
    n = res["busy"]
    lines = [f"{res['model']}, one stream of {res['tokens']} tokens, {res['cores']} cores, "
             f"{n} busy process{'es' if n != 1 else ''} beside it", "",
             "| threads | tokens/s alone | tokens/s beside the busy ones | ratio |",
             "|---|---|---|---|"]
    for r in res["runs"]:
        lines.append(f"| {r['threads']} | {r['quiet_tps']:.1f} | {r['busy_tps']:.1f} | "
                     f"{r['busy_tps'] / r['quiet_tps']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.contention", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/hybrid-mid.gguf")
    p.add_argument("--tokens", type=int, default=100)
    p.add_argument("--busy", type=int, default=1, help="busy processes beside the server")
    p.add_argument("--threads", default=",".join(str(t) for t in
                                                  dict.fromkeys((THREADS, max(THREADS - 1, 1)))),
                   help="compute threads to try, comma-separated (every core and one fewer)")
    p.add_argument("--log-dir", default="results/logs")
    p.add_argument("--json", help="write the result here")
    a = p.parse_args(argv)
    res = measure(Path(a.model), a.tokens, a.busy, [int(t) for t in a.threads.split(",")],
                  Path(a.log_dir))
    print(table(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
