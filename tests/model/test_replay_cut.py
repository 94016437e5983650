"""A follow-up from a client that sends replies back verbatim skips the replay cut.

The replay checkpoint before the generation prompt serves clients that strip or
re-render the reply: their next turn leaves the lane inside it. Cutting the prefill
there costs a step (a pass over the weights). When the HTTP side knows the client sent
the last reply back as generated (``Divergence.replayed``), the engine does not cut
there; the answers stay those of the same request served cold.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from proxy.engine.engine import Engine
from proxy.engine.types import (
    Divergence,
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
)
from statecache.config import load_config
from statecache.records import Kind, Role
from tests.busy import THREADS


def _run(eng: Engine, prompt: tuple[int, ...], *, history: int | None = None,
         divergence: Divergence | None = None, use_cache: bool = True
         ) -> tuple[list[int], FinishEvent]:
    async def go() -> tuple[list[int], FinishEvent]:
        out: list[int] = []
        async for ev in eng.generate(GenerationRequest(
                "t", prompt, SamplingParams(temperature=0.0, max_tokens=8),
                history_tokens=history, divergence=divergence, use_cache=use_cache)):
            if isinstance(ev, TokenEvent):
                out += ev.token_ids
            elif isinstance(ev, FinishEvent):
                return out, ev
        raise AssertionError("no FinishEvent")
    return asyncio.run(go())


def _replay_partials(eng: Engine) -> set[int]:
    assert eng.pool is not None
    return {r["n"] for r in eng.pool.describe()
            if r["kind"] == Kind.PARTIAL.value and r["role"] == Role.REPLAY.value}


def test_a_verbatim_client_gets_no_replay_cut(hybrid_path: Path, tmp_path: Path) -> None:
    cfg = load_config(None, {"model.path": str(hybrid_path), "model.threads": THREADS,
                             "engine.sanity_checks": True, "model.n_ctx": 2048,
                             "server.lanes": 1, "cache.disk_enabled": False,
                             "cache.periodic_pages": 0})
    eng = Engine(cfg, hybrid_path)
    page = eng.exec.page
    try:
        tok = eng.model.tokenize
        first = tuple(tok("a first question about recurrent state " * 12))
        reply, _ = _run(eng, first, history=len(first) - 3)
        base = first + tuple(reply)
        known = Divergence(len(base), "evicted", replayed=True)
        # one prefill step, two with the cut: the prompt's end needs no step of its own
        # (its state is saved with the logits of its last row)
        for text, divergence, steps in ((" and now the follow-up question " * 7, known, 1),
                                        (" a different follow-up instead " * 7, None, 2)):
            follow = base + tuple(tok(text))
            history = len(follow) - 3  # a generation prompt of 3 tokens
            cut_at = (history // page) * page
            assert len(base) < cut_at < len(follow) - 1  # a cut of its own
            got, fin = _run(eng, follow, history=history, divergence=divergence)
            # the lane holds the turn and its reply but the reply's last token
            assert fin.stats.source == "lane" and fin.usage.cached_tokens == len(base) - 1
            # known to replay verbatim: no cut at the history's page; else one there
            assert fin.stats.prefill_steps == steps
            parts = _replay_partials(eng)
            assert (cut_at in parts) is (divergence is None)
            assert len(follow) in parts  # an exact repeat reuses all of it
            cold, _ = _run(eng, follow, use_cache=False)
            assert got == cold
            again, fin = _run(eng, first, history=len(first) - 3)  # back to the turn's end
            assert again == reply and fin.stats.source in ("lane", "ram")
    finally:
        eng.close()
