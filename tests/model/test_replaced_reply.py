"""A request that holds the whole prompt of the lane's last request replaces its reply
(a retry, a regenerate, a client that strips the reasoning from replies): the lane is
cut back without first keeping its state as a FULL checkpoint, whose save grows with the
context and comes before the request's first token. A cut further back (an edit of the
history, another conversation) still keeps it. The answers are those of the same
requests served cold.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from proxy.engine.scheduler import Engine
from proxy.engine.types import FinishEvent, GenerationRequest, SamplingParams, TokenEvent
from statecache.config import load_config
from statecache.records import Kind, Role


def _run(eng: Engine, prompt: tuple[int, ...], *, use_cache: bool = True
         ) -> tuple[list[int], FinishEvent]:
    async def go() -> tuple[list[int], FinishEvent]:
        out: list[int] = []
        async for ev in eng.generate(GenerationRequest(
                "t", prompt, SamplingParams(temperature=0.0, max_tokens=8),
                use_cache=use_cache)):
            if isinstance(ev, TokenEvent):
                out += ev.token_ids
            else:
                return out, ev
        raise AssertionError("no FinishEvent")
    return asyncio.run(go())


def _full_ends(eng: Engine) -> set[int]:
    assert eng.pool is not None
    return {r["n"] for r in eng.pool.describe()
            if r["kind"] == Kind.FULL.value and r["role"] == Role.END_OF_REPLY.value}


def test_a_retry_cuts_the_reply_without_keeping_it(hybrid_path: Path) -> None:
    cfg = load_config(None, {"model.path": str(hybrid_path), "model.n_ctx": 2048,
                             "server.lanes": 1, "cache.disk_enabled": False,
                             "engine.idle_save_s": 0})  # no save between the requests
    eng = Engine(cfg, hybrid_path)
    c = eng.counters
    try:
        tok = eng.model.tokenize
        first = tuple(tok("a first question about recurrent state " * 12))
        reply, _ = _run(eng, first)
        end = len(first) + len(reply) - 1  # the lane's state: the reply's last token aside

        # the same request again: the lane goes back to its replay point, and the state
        # at the reply's end is not saved first
        again, fin = _run(eng, first)
        assert again == reply and fin.stats.source == "lane"
        assert fin.usage.cached_tokens == len(first) - 1
        assert (c["replaced_replies"], c["handoffs"]) == (1, 0)
        assert end not in _full_ends(eng)

        # a prompt that keeps only part of the last one (an edited history): the lane's
        # state is kept as a FULL checkpoint before the cut
        edited = first[: len(first) // 2] + tuple(tok(" asked another way, " * 8))
        got, _ = _run(eng, edited)
        assert (c["replaced_replies"], c["handoffs"]) == (1, 1)
        assert end in _full_ends(eng)
        cold, _ = _run(eng, edited, use_cache=False)
        assert got == cold

        # the kept state serves the first conversation's next turn from the reply's end
        follow = first + tuple(reply) + tuple(tok(" and a follow-up question"))
        got, fin = _run(eng, follow)
        assert fin.usage.cached_tokens >= end
        cold, _ = _run(eng, follow, use_cache=False)
        assert got == cold
    finally:
        eng.close()
