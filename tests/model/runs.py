"""Running one request on an ``Engine`` from a test, and comparing a reply with the same
request served cold (up to a near-tie there: docs/design.md fact 10)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

from proxy.engine.engine import Engine
from proxy.engine.types import FinishEvent, GenerationRequest, TokenEvent, TokenLogprob


def generate(eng: Engine, req: GenerationRequest
             ) -> tuple[list[int], list[TokenLogprob], FinishEvent]:
    """The reply's tokens, their log-probabilities (if asked) and the finish event."""
    async def go() -> tuple[list[int], list[TokenLogprob], FinishEvent]:
        out: list[int] = []
        lps: list[TokenLogprob] = []
        async for ev in eng.generate(req):
            if isinstance(ev, TokenEvent):
                out += ev.token_ids
                lps += ev.logprobs
            elif isinstance(ev, FinishEvent):
                return out, lps, ev
        raise AssertionError("no FinishEvent")
    return asyncio.run(go())


def assert_as_cold(cold_eng: Engine, req: GenerationRequest, got: list[int],
                   near_tie: float) -> None:
    """``got`` is what ``req`` (greedy, with log-probabilities) gives served cold, up to a
    first difference where the cold request saw a near-tie."""
    cold, lps, _ = generate(cold_eng, replace(req, use_cache=False))
    for i, (a, b) in enumerate(zip(got, cold, strict=True)):
        if a != b:
            top = dict(lps[i].top)
            mine = cold_eng.model.detokenize([a])
            assert mine in top, f"token {i}: {a} is not among the cold request's top tokens"
            assert lps[i].logprob - top[mine] <= near_tie, f"token {i}: {a} against {b}"
            return
