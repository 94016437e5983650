"""Decode tokens/s with the old numpy sampler and llama.cpp's sampler chain, side by side.

One lane decodes one token per step, as the engine's decode steps do, and each step
samples the next token from that step's logits. The samplers take turns, a few rounds
each, in one process on one context, so a noisy machine slows them alike:

- ``argmax``: greedy, the exact argmax of the logits (the same before and after).
- ``numpy t=1``: the numpy sampler the engine had before issue 13 (a copy of the
  logits, temperature 1, no truncation: OpenAI's defaults), kept here for comparison.
- ``chain t=1``: the chain with the same settings (temperature 1, a seeded draw).
- ``chain default``: the chain with the [sampling] defaults (top-k 40, top-p 0.95,
  min-p 0.05, temperature 0.8).
- ``chain penalties``: the defaults with presence and frequency penalties.
- ``chain json``: the defaults under a JSON-schema grammar (a new reply begins whenever
  one ends).

    python -m bench.sampling --model PATH [--model PATH ...] [--tokens 48] [--rounds 3]

Prints one table per model: decode tokens/s (median over rounds, with the range), the
CPU milliseconds of a whole step (all threads) and the sampler's own CPU milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from proxy.api.openai import parse_chat_request
from proxy.engine.binding import Context, ContextParams, Model
from proxy.engine.sampling import Sampler, defaults, resolve
from proxy.engine.types import SamplingParams
from statecache.config import SamplingConfig

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "characters": {"type": "array", "maxItems": 4, "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"},
        "role": {"enum": ["hero", "villain", "friend"]}}, "required": ["name", "role"]}},
    "summary": {"type": "string", "maxLength": 200}},
    "required": ["title", "characters", "summary"]}


class NumpySampler:
    """The engine's sampler before issue 13 (proxy/engine/sampling.py at 3f7846b)."""

    def __init__(self, temperature: float, seed: int) -> None:
        self.temperature = temperature
        self._rng = np.random.default_rng(seed)

    def __call__(self, logits: np.ndarray) -> int:
        x = logits.astype(np.float64) / self.temperature
        x -= x.max()
        probs = np.exp(x)
        probs /= probs.sum()
        return int(self._rng.choice(probs.size, p=probs))


Pick = Callable[[Context, int], int]
Make = Callable[[], tuple[Pick, Callable[[], None]]]  # (sample, close), fresh per reply


@dataclass
class Contender:
    name: str
    make: Make


def _chain(model: Model, params: SamplingParams, prompt: np.ndarray) -> Make:
    base = defaults(SamplingConfig(model_defaults=False), {})

    def make() -> tuple[Pick, Callable[[], None]]:
        s = Sampler(model, resolve(params, base), prompt)
        return s.sample, s.close
    return make


def contenders(model: Model, prompt: np.ndarray) -> list[Contender]:
    def argmax() -> tuple[Pick, Callable[[], None]]:
        return (lambda ctx, row: int(np.argmax(ctx.logits_view(row)))), (lambda: None)

    def numpy_t1() -> tuple[Pick, Callable[[], None]]:
        old = NumpySampler(1.0, seed=1)
        return (lambda ctx, row: old(ctx.logits(row))), (lambda: None)

    grammar = parse_chat_request({"messages": [{"role": "user", "content": "x"}],
                                  "response_format": {"type": "json_schema", "json_schema": {
                                      "name": "story", "schema": SCHEMA}}}).sampling.grammar
    return [
        Contender("argmax", argmax),
        Contender("numpy t=1", numpy_t1),
        Contender("chain t=1", _chain(model, SamplingParams(
            temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=1), prompt)),
        Contender("chain default", _chain(model, SamplingParams(seed=1), prompt)),
        Contender("chain penalties", _chain(model, SamplingParams(
            seed=1, presence_penalty=0.5, frequency_penalty=0.5), prompt)),
        Contender("chain json", _chain(model, SamplingParams(seed=1, grammar=grammar), prompt)),
    ]


def decode(model: Model, ctx: Context, prompt: list[int], who: Contender,
           tokens: int) -> tuple[float, float, float]:
    """(decode tokens/s, CPU ms per step, sampler CPU ms per token) for ``tokens`` steps
    after ``prompt``. CPU time counts every thread of the process: on a shared machine it
    moves less than the wall clock does."""
    ctx.clear_lane(0)
    ctx.prefill(0, prompt, 0)
    sample, close = who.make()
    pos, row, spent = len(prompt), ctx.batch.n - 1, 0.0
    t0, c0 = time.perf_counter(), time.process_time()
    for _ in range(tokens):
        ts = time.thread_time()  # the samplers run on this thread alone
        tok = sample(ctx, row)
        spent += time.thread_time() - ts
        if model.is_eog(tok):  # a reply ended (the grammar's): the next one begins
            close()
            sample, close = who.make()
            tok = model.tokenize("\n")[0]
        ctx.batch.clear()
        row = ctx.batch.add(0, [tok], pos, logits_last=True)
        ctx.decode()
        pos += 1
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    close()
    return tokens / elapsed, 1000 * cpu / tokens, 1000 * spent / tokens


def bench(path: Path, tokens: int, rounds: int, threads: int) -> None:
    with Model(path) as model, Context(model, ContextParams(
            n_ctx=4096, n_batch=512, n_ubatch=512, threads=threads)) as ctx:
        text = f"<start_of_turn>user\n{PROMPT}<end_of_turn>\n<start_of_turn>model\n" \
            if model.chat_template() is None else \
            f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
        prompt = model.tokenize(text, add_special=True)
        arr = np.asarray(prompt, dtype=np.int32)
        who = contenders(model, arr)
        results: dict[str, list[tuple[float, float, float]]] = {c.name: [] for c in who}
        decode(model, ctx, prompt, who[0], 8)  # warm-up
        for _ in range(rounds):
            for c in who:  # round robin: noise falls on all of them alike
                results[c.name].append(decode(model, ctx, prompt, c, tokens))
        print(f"\n{path.name}: vocabulary {model.n_vocab:,}, {tokens} tokens x {rounds} "
              f"rounds, {threads or 'all'} threads")
        print(f"{'sampler':<18}{'decode tok/s':>13}{'range':>14}{'CPU ms/step':>13}"
              f"{'sampler ms':>12}")
        for name, rows in results.items():
            tps = [r[0] for r in rows]
            cpu = statistics.median(r[1] for r in rows)
            ms = statistics.median(r[2] for r in rows)
            print(f"{name:<18}{statistics.median(tps):>13.1f}"
                  f"{f'{min(tps):.1f}-{max(tps):.1f}':>14}{cpu:>13.1f}{ms:>12.2f}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, action="append", required=True)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    for path in args.model:
        bench(path, args.tokens, args.rounds, args.threads)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
