"""The engine thread's time between two decodes of one stream, against the binding's:
what a token costs outside ``llama_decode`` before any HTTP, in one process.

    python -m bench.gap --model models/hybrid-mid.gguf

One stream, greedy, decoded in turns by the engine (``Engine.generate`` on an event
loop in this process, as the server drives it, cache off), by the engine with lone
runs off (``engine.lone_run_ms = 0``: every step planned), and by
``proxy.engine.binding`` in a loop (bench.batching's binding column). Every
``llama_decode`` call is timed; the gap is the time from one call's return to the next
one's start. It prints, for each, the median over ``--repeats`` of tokens/s, of the
mean gap, of the median gap (a step that did not write to the event loop: the loop is
woken once every several tokens) and of the median decode. The runs take turns, so the
machine's drift falls on all three alike.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import proxy.engine.binding as binding
from bench.batching import DirectDecoder, _prompt
from proxy.engine.engine import Engine
from proxy.engine.types import GenerationRequest, SamplingParams, TokenEvent
from statecache.config import load_config

SYSTEMS = ("engine", "engine, every step planned", "binding")
GAP_CAP_S = 0.005  # a gap longer than this is the event loop or the machine, not a token


class DecodeClock:
    """Times every ``llama_decode`` call of this process while installed."""

    def __init__(self) -> None:
        self.calls: list[tuple[float, float]] = []
        self._orig: Any = None

    def __enter__(self) -> DecodeClock:
        self._orig = orig = binding._ll.llama_decode
        calls, pc = self.calls, time.perf_counter

        def timed(ctx: Any, batch: Any) -> int:
            t0 = pc()
            rc = orig(ctx, batch)
            calls.append((t0, pc()))
            return int(rc)

        binding._ll.llama_decode = timed
        return self

    def __exit__(self, *exc: object) -> None:
        binding._ll.llama_decode = self._orig

    def summary(self, skip: int = 8) -> tuple[float, float, float]:
        """Mean gap, median gap and median decode, in µs, past the first ``skip`` calls
        (the prefill)."""
        xs = self.calls[skip:]
        gaps = [min(b[0] - a[1], GAP_CAP_S) for a, b in zip(xs, xs[1:], strict=False)]
        if not gaps:
            return float("nan"), float("nan"), float("nan")
        return (1e6 * statistics.fmean(gaps), 1e6 * statistics.median(gaps),
                1e6 * statistics.median(b - a for a, b in xs))


async def _engine_rate(eng: Engine, prompt: tuple[int, ...], n_out: int) -> float:
    req = GenerationRequest("gap", prompt, SamplingParams(temperature=0.0, max_tokens=n_out),
                            use_cache=False)
    arrivals: list[float] = []
    async for ev in eng.generate(req):
        if isinstance(ev, TokenEvent):
            arrivals += [time.perf_counter()] * len(ev.token_ids)
    return (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])


def measure(model_path: Path, n_out: int, repeats: int) -> dict[str, Any]:
    cfg = load_config(None, {"model.path": str(model_path), "server.lanes": 4,
                             "model.n_ctx": 4096, "cache.enabled": False,
                             # one token a step: this bench times what each token costs
                             # around its decode; drafting would batch tokens per decode
                             "speculative.source": "off"})
    eng = Engine(cfg, model_path)
    direct = DirectDecoder(model_path)
    loop = asyncio.new_event_loop()
    lone_s = eng.stepper.alone_s
    prompt = tuple(int(t) for t in eng.model.tokenize(_prompt(200, 10)))
    runs: dict[str, list[tuple[float, float, float, float]]] = {s: [] for s in SYSTEMS}
    try:
        for r in range(repeats):
            for name in SYSTEMS[r % 3:] + SYSTEMS[: r % 3]:
                time.sleep(0.3)  # the threadpool of the last run stops polling
                with DecodeClock() as clock:
                    if name == "binding":
                        rate = direct.rate(n_out)
                    else:
                        eng.stepper.alone_s = lone_s if name == "engine" else 0.0
                        rate = loop.run_until_complete(_engine_rate(eng, prompt, n_out))
                runs[name].append((rate, *clock.summary()))
    finally:
        loop.close()
        eng.close()
        direct.close()
    out: dict[str, Any] = {"model": model_path.name, "tokens": n_out, "repeats": repeats,
                           "date": time.strftime("%Y-%m-%d %H:%M"), "runs": runs}
    out["median"] = {name: [statistics.median(x[i] for x in rs) for i in range(4)]
                     for name, rs in runs.items()}
    return out


def table(res: dict[str, Any]) -> str:
    lines = [f"{res['model']}, one stream of {res['tokens']} tokens, medians of "
             f"{res['repeats']} runs in turns", "",
             "| | tokens/s | gap between decodes µs, mean | the same, median | decode µs |",
             "|---|---|---|---|---|"]
    for name, (rate, gap, gap50, dec) in res["median"].items():
        lines.append(f"| {name} | {rate:.1f} | {gap:.1f} | {gap50:.1f} | {dec:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.gap", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="models/hybrid-mid.gguf")
    p.add_argument("--tokens", type=int, default=400)
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--json", help="write every run here")
    a = p.parse_args(argv)
    res = measure(Path(a.model), a.tokens, a.repeats)
    print(table(res))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
