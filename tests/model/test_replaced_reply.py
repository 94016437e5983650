"""A request that holds the whole history of the lane's last request (its prompt before
the generation prompt) replaces that request's own turn (a retry, a regenerate, a client
that strips the reasoning from replies): the lane is cut back without first keeping its
state as a FULL checkpoint, whose save grows with the context and comes before the
request's first token. A cut further back (an edit of the history, another
conversation) still keeps it. The answers are those of the same requests served cold,
or differ first where the cold request saw a near-tie (docs/design.md fact 10: another batch
schedule moves the logits a little).
"""

from __future__ import annotations

from pathlib import Path

from proxy.engine.engine import Engine
from proxy.engine.types import (
    FinishEvent,
    GenerationRequest,
    SamplingParams,
    TokenLogprob,
)
from proxy.meter import Counter
from statecache.config import load_config
from statecache.records import Kind, Role
from tests.busy import THREADS
from tests.model.runs import assert_as_cold, generate

GEN_PROMPT = 3  # tokens of a generation prompt after the history
NEAR_TIE = 0.05  # logprob gap at a first difference from the cold request


def _run(eng: Engine, prompt: tuple[int, ...], *, use_cache: bool = True
         ) -> tuple[list[int], FinishEvent]:
    ids, _, fin = _run_logprobs(eng, prompt, use_cache=use_cache)
    return ids, fin


def _request(prompt: tuple[int, ...], use_cache: bool = True) -> GenerationRequest:
    return GenerationRequest("t", prompt, SamplingParams(temperature=0.0, max_tokens=8,
                                                         logprobs=2),
                             history_tokens=len(prompt) - GEN_PROMPT, use_cache=use_cache)


def _run_logprobs(eng: Engine, prompt: tuple[int, ...], *, use_cache: bool = True
                  ) -> tuple[list[int], list[TokenLogprob], FinishEvent]:
    return generate(eng, _request(prompt, use_cache))


def _as_cold(cold_eng: Engine, prompt: tuple[int, ...], got: list[int]) -> None:
    """``got`` is what the same request gives served cold, up to a near-tie there."""
    assert_as_cold(cold_eng, _request(prompt), got, NEAR_TIE)


def _full_ends(eng: Engine) -> set[int]:
    assert eng.pool is not None
    return {r["n"] for r in eng.pool.describe()
            if r["kind"] == Kind.FULL.value and r["role"] == Role.END_OF_REPLY.value}


def test_a_retry_cuts_the_reply_without_keeping_it(hybrid_path: Path) -> None:
    cfg = load_config(None, {"model.path": str(hybrid_path), "model.threads": THREADS,
                             "engine.sanity_checks": True, "model.n_ctx": 2048,
                             "server.lanes": 1, "cache.disk_enabled": False,
                             "engine.idle_save_s": 0})  # no save between the requests
    eng = Engine(cfg, hybrid_path)
    cold = Engine(load_config(None, {"model.path": str(hybrid_path), "model.threads": THREADS,
                                     "engine.sanity_checks": True, "model.n_ctx": 2048,
                                     "server.lanes": 1, "cache.enabled": False}), hybrid_path)
    def c(name: str) -> int:
        counter: Counter = getattr(eng.meter, name)
        return int(counter.get())

    try:
        tok = eng.model.tokenize
        first = tuple(tok("a first question about recurrent state " * 12))
        reply, _ = _run(eng, first)

        # the same request again: the lane goes back to its replay point, and the state
        # at the reply's end is not saved first
        again, fin = _run(eng, first)
        assert again == reply and fin.stats.source == "lane"
        assert fin.usage.cached_tokens == len(first) and fin.stats.prefilled == 0
        assert (c("replaced_replies"), c("handoffs")) == (1, 0)
        assert not _full_ends(eng)

        # the same history with its turn rendered anew (a client that strips reasoning
        # diverges inside the generation prompt or the reply): not saved either
        anew = first[:-GEN_PROMPT] + tuple(tok(" and so, the answer: "))
        got, fin = _run(eng, anew)
        assert fin.stats.source == "lane" and fin.usage.cached_tokens < len(first) - 1
        assert (c("replaced_replies"), c("handoffs")) == (2, 0)
        _as_cold(cold, anew, got)
        end = len(anew) + len(got) - 1  # the lane's state: the reply's last token aside

        # a prompt that keeps only part of the last one's history (an edit): the lane's
        # state is kept as a FULL checkpoint before the cut
        edited = first[: len(first) // 2] + tuple(tok(" asked another way, " * 8))
        edited_reply, _ = _run(eng, edited)
        assert c("handoffs") == 1 and end in _full_ends(eng)
        _as_cold(cold, edited, edited_reply)

        # the kept state serves that conversation's next turn from the reply's end
        follow = anew + tuple(got) + tuple(tok(" and a follow-up question"))
        got, fin = _run(eng, follow)
        assert fin.usage.cached_tokens >= end
        _as_cold(cold, follow, got)
    finally:
        eng.close()
        cold.close()
