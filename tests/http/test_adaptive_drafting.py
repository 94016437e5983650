"""Speculative decoding on by default and adaptive (proxy/engine/speculation.py): the
default config drafts, a lane where drafting loses stops drafting, a regenerated reply
is drafted from the conversation's earlier reply, and a request can still say no. Each
answer is compared with the same request served without drafting (the near-tie rule).
Where a test asserts on what the adaptive rule chose, its engine is charged fixed step
costs (``serve(costs=...)``): the choice is made from step times, which a busy machine
moves."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest

from proxy.api.app import ENGINE
from proxy.meters import EngineMeter
from tests.busy import GEMMA_COSTS, TINY_COSTS
from tests.http.agent import ask, assert_same_or_near_tie
from tests.http.conftest import serve
from tests.http.test_sessions import NEAR_TIE

pytestmark = pytest.mark.http

CODE = "\n".join(f"def f{i}(x):\n    return x * {i} + {i * i}" for i in range(12))


def _drafted(m: EngineMeter) -> tuple[float, float]:
    return m.spec_tokens.get("drafted"), m.spec_tokens.get("accepted")


async def _plain(model: Path, tmp: Path, messages: list[dict[str, str]],
                 max_tokens: int) -> list[dict[str, object]]:
    async with serve(model, tmp / "plain", cache__enabled=False, server__lanes=1,
                     speculative__source="off") as plain:
        return (await ask(plain.client, messages, max_tokens))["tokens"]


async def test_the_default_config_drafts(gemma_path: Path, tmp_path: Path) -> None:
    # nothing about drafting in the config: prompt lookup drafts a reply that copies code
    messages = [{"role": "user", "content": "Copy this code exactly:\n" + CODE}]
    async with serve(gemma_path, tmp_path / "ckpt", costs=GEMMA_COSTS) as srv:
        got = await ask(srv.client, messages, 96)
        drafted, accepted = _drafted(srv.app[ENGINE].meter)
        async with aiohttp.ClientSession() as http, \
                http.get(srv.url + "/admin/requests") as r:
            (rec,) = (await r.json())["requests"]
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    # the request's own figures, as GET /admin/requests lists it (bench.speculative's)
    assert (rec["drafted"], rec["accepted"]) == (drafted, accepted), rec
    assert rec["output_tokens"] == got["completion_tokens"] and rec["decode_tps"] > 0, rec
    assert_same_or_near_tie(got["tokens"], await _plain(gemma_path, tmp_path, messages, 96),
                            NEAR_TIE["gemma"])


async def test_drafting_stops_on_a_pair_where_it_loses(
        spec_target_path: Path, spec_llama_draft_path: Path, tmp_path: Path) -> None:
    # a draft model made for another target: it agrees with this one by chance only, so
    # each verification costs more than it yields; the lane rests (decoding alone, in its
    # fast path) and probes now and then, instead of drafting at every step
    messages = [{"role": "user", "content": "Tell me a story. " * 8}]
    async with serve(spec_target_path, tmp_path / "ckpt", server__lanes=1,
                     model__draft_path=str(spec_llama_draft_path),
                     speculative__draft_min_p=0.0, costs=TINY_COSTS) as srv:
        got = await ask(srv.client, messages, 200)
        m = srv.app[ENGINE].meter
        drafted, accepted = _drafted(m)
        rests, probes, alone = m.spec_rests.get(), m.spec_probes.get(), m.steps_alone.get()
    n = got["completion_tokens"]
    assert n == 200
    assert rests >= 1, (rests, drafted, accepted)
    # drafting every step would draft about draft_max (3) tokens per token produced
    assert drafted < 0.5 * n, (drafted, accepted, rests, probes)
    assert alone > 0.5 * n, alone  # most tokens came from the lone fast path
    assert_same_or_near_tie(got["tokens"],
                            await _plain(spec_target_path, tmp_path, messages, 200),
                            NEAR_TIE["hybrid"])


@pytest.mark.parametrize("history", [16384, 0])
async def test_a_regenerated_reply_drafts_from_the_earlier_reply(
        spec_llama_target_path: Path, tmp_path: Path, history: int) -> None:
    # A client asks again (a retry, a regenerate): the prompt holds nothing of the first
    # reply, but the conversation's history does, and the greedy reply is the same one.
    # A random model's reply seldom repeats itself or its prompt: without the history,
    # prompt lookup finds little to draft. (Not adaptive: what is drafted here must not
    # depend on how busy the machine is.)
    messages = [{"role": "user", "content": "Write something. " * 6}]
    key = {"X-Statecache-Session": "conversation-1"}
    async with serve(spec_llama_target_path, tmp_path / "ckpt", server__lanes=1,
                     speculative__history_tokens=history,
                     speculative__adaptive=False) as srv:
        first = await ask(srv.client, messages, 128, extra_headers=key)
        m = srv.app[ENGINE].meter
        before = _drafted(m)
        second = await ask(srv.client, messages, 128, extra_headers=key)
        drafted, accepted = (a - b for a, b in zip(_drafted(m), before, strict=True))
    assert [t["token"] for t in second["tokens"]] == [t["token"] for t in first["tokens"]]
    n = second["completion_tokens"]
    if history:
        assert accepted >= 0.5 * n, (accepted, drafted, n)
    else:
        assert accepted < 0.25 * n, (accepted, drafted, n)
    assert_same_or_near_tie(second["tokens"],
                            await _plain(spec_llama_target_path, tmp_path, messages, 128),
                            NEAR_TIE["draft"])


async def test_a_request_says_no_under_the_default_config(gemma_path: Path,
                                                         tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "Copy this code exactly:\n" + CODE}]
    async with serve(gemma_path, tmp_path / "ckpt") as srv:
        await srv.client.chat.completions.create(
            model="x", messages=messages, max_tokens=64, temperature=0,  # type: ignore[arg-type]
            extra_body={"speculative": False})
        assert _drafted(srv.app[ENGINE].meter) == (0, 0)



async def test_a_draft_model_that_drafts_nothing_costs_no_planned_steps(
        spec_jamba_target_path: Path, spec_jamba_draft_path: Path, tmp_path: Path) -> None:
    # a draft model that is never sure enough of a token (draft_min_p) drafts nothing,
    # and prompt lookup finds nothing in a random model's reply: after the first
    # request, which learns so, a request decodes in the lone fast path, its draft
    # model asked nothing and its probes checked there, not in planned steps of their
    # own (each costs more than a token of the fast path: on a tiny model a tenth of
    # its decode rate)
    async with serve(spec_jamba_target_path, tmp_path / "ckpt", server__lanes=1,
                     model__draft_path=str(spec_jamba_draft_path),
                     speculative__draft_min_p=0.999, costs=TINY_COSTS) as srv:
        m = srv.app[ENGINE].meter
        planned, followed = [], []
        for i in range(3):
            messages = [{"role": "user", "content": f"Conversation {i}. Tell me a story."}]
            steps, alone = m.steps.get(), m.steps_alone.get()
            decoded = m.draft_total.get("tokens_decoded")
            got = await ask(srv.client, messages, 400,  # (no history to draft from)
                            extra_headers={"X-Statecache-Session": f"conversation-{i}"})
            assert got["completion_tokens"] == 400
            planned.append(m.steps.get() - steps - (m.steps_alone.get() - alone))
            # what the draft model decoded beyond following the prompt
            followed.append(m.draft_total.get("tokens_decoded") - decoded
                            - got["prompt_tokens"])
        drafted, accepted = _drafted(m)
    # a probe of the draft model catches it up on what its lane rested through: one
    # that drafts nothing is probed only where that is a few tokens (a reply's start),
    # not hundreds of tokens into the reply (1 more here; the code before, 225)
    assert max(followed[1:]) <= 16, followed
    # the prompt's prefill (two steps: a checkpoint is published inside it), the first
    # decode step (and the next, where the draft model was asked there), a probe or two
    # of the draft model: 5 or 6 here; the code before it planned 18, asking the draft
    # model at each start and probing in planned steps
    assert max(planned[1:]) <= 8, (planned, drafted, accepted)
    assert drafted == 0, (drafted, accepted)
