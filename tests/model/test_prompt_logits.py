"""A prompt that ends where a kept state ends starts from the logits of its last row,
kept with that state (a live lane's last prefill, a checkpoint saved at a prompt's end):
nothing is decoded again. Sampling from kept logits is what sampling from the
context's row gives, for the exact argmax, a seeded chain with penalties and a grammar;
the log-probabilities too. The replies are those of the same requests served cold, up to
a near-tie (docs/design.md fact 10)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from proxy.engine.engine import Engine
from proxy.engine.types import (
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenLogprob,
)
from statecache.config import load_config
from tests.busy import THREADS
from tests.model.runs import assert_as_cold, generate

NEAR_TIE = 0.05  # logprob gap at a first difference from the cold request
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3)
SEEDED = SamplingParams(temperature=0.9, top_k=40, seed=7, repeat_penalty=1.2,
                        max_tokens=12, logprobs=2)
JSON = SamplingParams(temperature=0.0, max_tokens=12,
                      grammar='root ::= "{" [a-z]+ ":" [0-9]+ "}"')


def _run(eng: Engine, prompt: tuple[int, ...], sp: SamplingParams, *, use_cache: bool = True
         ) -> tuple[list[int], list[TokenLogprob], FinishEvent]:
    return generate(eng, GenerationRequest("t", prompt, sp, use_cache=use_cache))


def _as_cold(cold_eng: Engine, prompt: tuple[int, ...], got: list[int]) -> None:
    assert_as_cold(cold_eng, GenerationRequest("t", prompt, GREEDY), got, NEAR_TIE)


def _engine(path: Path, **over: object) -> Engine:
    cfg = {"model.path": str(path), "model.threads": THREADS, "engine.sanity_checks": True,
           "model.n_ctx": 2048, "server.lanes": 1, "cache.disk_enabled": False,
           "engine.idle_save_s": 0, "speculative.source": "off"}
    cfg.update({k.replace("__", "."): v for k, v in over.items()})
    return Engine(load_config(None, cfg), path)


def _again(eng: Engine, prompt: tuple[int, ...], sp: SamplingParams) -> None:
    """The request twice: the second starts at the prompt's end, decodes nothing again,
    and gives the first one's tokens and log-probabilities."""
    first, lps1, _ = _run(eng, prompt, sp)
    again, lps2, fin = _run(eng, prompt, sp)
    assert (fin.usage.cached_tokens, fin.stats.prefilled) == (len(prompt), 0), fin.stats
    assert again == first
    assert lps2 == lps1


def test_a_live_lane_keeps_its_logits_for_every_sampler(gemma_path: Path) -> None:
    # Gemma 3 (SWA): the lane is cut back to the prompt's end, its logits kept in the lane
    eng, cold = _engine(gemma_path), _engine(gemma_path, cache__enabled=False)
    try:
        tok = eng.model.tokenize
        for i, sp in enumerate((GREEDY, SEEDED, JSON)):
            prompt = tuple(tok(f"Question {i}: what does a key-value cache keep? " * 6))
            _again(eng, prompt, sp)
            if sp is GREEDY:
                _as_cold(cold, prompt, _run(eng, prompt, sp)[0])
        # another seed from the same kept logits: the chain's own draw, not a replay
        prompt = tuple(tok("Question 1: what does a key-value cache keep? " * 6))
        a = _run(eng, prompt, replace(SEEDED, seed=8))[0]
        b = _run(eng, prompt, replace(SEEDED, seed=8))[0]
        assert a == b
    finally:
        eng.close()
        cold.close()


def test_a_hybrid_keeps_them_across_a_restart(hybrid_path: Path, tmp_path: Path) -> None:
    # qwen35-class hybrid: the prompt's end is a partial checkpoint with its logits; at
    # shutdown it becomes a FULL one, written to disk, read by the next process
    disk = {"cache__disk_enabled": True, "cache__disk_path": str(tmp_path / "ckpt")}
    eng, cold = _engine(hybrid_path, **disk), _engine(hybrid_path, cache__enabled=False)
    try:
        prompt = tuple(eng.model.tokenize("a question about recurrent state " * 20))
        _again(eng, prompt, GREEDY)  # in the lane, from its partial checkpoint
        first, lps1, _ = _run(eng, prompt, GREEDY)
        eng.close()
        eng = _engine(hybrid_path, **disk)
        got, lps2, fin = _run(eng, prompt, GREEDY)
        assert fin.stats.source in ("ram", "disk") and fin.stats.prefilled == 0, fin.stats
        assert fin.usage.cached_tokens == len(prompt)
        assert (got, lps2) == (first, lps1)
        _as_cold(cold, prompt, got)
        # a longer prompt goes on from there: it prefills only what is new
        longer = prompt + tuple(eng.model.tokenize(" and one more thing"))
        got, _, fin = _run(eng, longer, GREEDY)
        assert fin.usage.cached_tokens == len(prompt)
        assert fin.stats.prefilled == len(longer) - len(prompt)
        _as_cold(cold, longer, got)
    finally:
        eng.close()
        cold.close()


def test_a_first_token_from_kept_logits_goes_out_before_the_next_decode(
        hybrid_path: Path) -> None:
    # The first token of a prompt cached to its end is sampled at admission, with no
    # step: it is handed on at once, not after the next decode (a step of the model).
    eng = _engine(hybrid_path)
    ctx = eng.parts.ctx
    decode = ctx.decode
    late: list[int] = []
    calls: list[int] = []

    def checked() -> None:
        calls.append(1)
        late.extend(len(job.out.generated) for job, _ in eng.board.active
                    if job.out.generated and not job.out.written)
        decode()

    try:
        prompt = tuple(eng.model.tokenize("a question about recurrent state " * 20))
        _run(eng, prompt, GREEDY)
        ctx.decode = checked  # type: ignore[method-assign]
        _, _, fin = _run(eng, prompt, GREEDY)
        assert fin.stats.prefilled == 0 and calls  # it decoded after its first token
        assert not late, late
    finally:
        ctx.decode = decode  # type: ignore[method-assign]
        eng.close()
