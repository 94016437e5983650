"""Adaptive drafting's choices (proxy/engine/speculation.py) on step costs that do not
depend on how busy the machine is: the real controller and step timer, a lane and a
"target" that replies with a fixed token sequence, and a cost model (``StepCosts``) that
charges each step, each prompt lookup and each token asked of a draft model what the
model measured costs (the HTTP tests run the real model and set such costs too).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from proxy.engine.draftlength import LOOKUP
from proxy.engine.job import Job, StepDrafts, Work
from proxy.engine.lanes import Lane
from proxy.engine.speculation import Speculation
from proxy.engine.timing import StepCosts, StepTimer
from proxy.meters import EngineMeter
from statecache.config import load_config

STEP = 0.025  # Gemma 3 270M, one token, on this machine's two cores
PER_DRAFT = 0.055 / 8  # what a draft adds (its logits row: Gemma's 262k-token vocabulary)
LOOKUP_S = 0.0001  # a prompt lookup: under 2% of a step (a resting lane watches for copies)


def _reply(prompt: list[int], n: int) -> list[int]:
    """A reply that starts as the prompt does, turns away (prompt lookup's first drafts
    are rejected), then copies the prompt."""
    own = prompt[:3] + [900]
    return (own + prompt * 4)[:n]


def _run(prompt: list[int], reply: list[int], per_draft: float,
         timer: StepTimer | None = None, draft: Any = None,
         spec: Speculation | None = None, lookup_record: tuple[float, float] | None = None,
         ) -> tuple[Any, Job, Speculation]:
    """One request; ``spec``: the controller of an earlier one (the server's, kept);
    ``lookup_record``: the lane's record of drafts from new short matches (accepted,
    rejected) as the request starts."""
    if spec is None:
        cfg = load_config(None)  # "auto": prompt lookup, and the draft model if given
        parts: Any = SimpleNamespace(
            cfg=cfg, meter=EngineMeter(), draft=draft, rs_snapshots=False, staging=False,
            ctx=SimpleNamespace(n_ctx_seq=8192, seq_rm=lambda *a: True))
        spec = Speculation(parts, timer or StepTimer())
    timer, meter = spec.timer, spec.p.meter
    timer.costs = StepCosts(decode_s=STEP, draft_s=per_draft, lookup_s=LOOKUP_S,
                            model_s=getattr(draft or spec.p.draft, "per_token", 0.0))
    req: Any = SimpleNamespace(sampling=SimpleNamespace(max_tokens=len(reply)), tenant="",
                               session=None)
    lane = Lane(0)
    lane.extend(np.array(prompt, dtype=np.int32))
    job = Job(req=req, prompt=np.array(prompt, dtype=np.int32), use_cache=False,
              t_submit=0.0, lane=lane, pos=len(prompt))
    job.spec.on = True
    if lookup_record is not None:
        job.spec.accepted[LOOKUP], job.spec.rejected[LOOKUP] = lookup_record

    def take(j: Job, row: int) -> None:  # the target's next token, whatever was drafted
        tok = reply[len(j.out.generated)]
        j.out.generated.append(tok)
        j.out.pending = tok
        if len(j.out.generated) >= len(reply):
            j.finish_reason = "length"

    take(job, 0)  # the first token, sampled where the prompt ended
    while not job.done:
        w = Work(job, n=1, pos0=lane.n, row=0, room=spec.room(job, 1, 512))
        spec.lanes_decoding = 1
        spec.propose([w])
        k = len(job.spec.drafts)
        drafts = StepDrafts(tokens=k, lanes=1) if k else None
        timer.record(timer.took(0.0, 1, 0, drafts=drafts), 1, 0, drafts=drafts)
        spec.verify(w, take)
    spec.remember(job)  # as the engine does when a request ends
    return meter, job, spec


def test_a_reply_that_copies_its_prompt_keeps_drafting() -> None:
    # the first verification is all rejected (the reply's own words), then the copy
    # goes on: drafting pays (8 drafts cost 2.2 steps, each accepted), the lane must not
    # rest through the copy
    prompt = list(range(10, 130))
    reply = _reply(prompt, 96)
    meter, job, _ = _run(prompt, reply, PER_DRAFT)
    verifications = meter.spec_verifications.get()
    assert job.out.generated == reply  # drafts never change what the target said
    assert meter.spec_tokens.get("drafted") >= 60, meter
    assert verifications < 0.3 * len(reply), verifications
    assert meter.spec_rests.get() == 0, meter


def test_drafts_that_cost_more_than_they_yield_rest() -> None:
    # the same copy where each draft costs a whole step: even all accepted, a
    # verification of k yields k + 1 tokens in k + 1 steps' time. The lane rests after
    # its first measurements and only probes.
    prompt = list(range(10, 130))
    reply = _reply(prompt, 200)
    meter, job, _ = _run(prompt, reply, STEP * 1.2)
    assert job.out.generated == reply
    assert meter.spec_rests.get() >= 1, meter
    assert meter.spec_tokens.get("drafted") < 0.5 * len(reply), meter


def test_a_new_request_where_no_drafts_pay_goes_on_resting() -> None:
    # each draft costs more than a step (the tiny synthetic targets on these cores): no
    # draft pays, even accepted. The requests after the first go on from the rest the
    # last one reached, not each from the start: verifying the first drafts found, then
    # probing at its 32nd, 96th and 224th tokens
    prompt = list(range(10, 130))
    reply = _reply(prompt, 240)
    meter, _, spec = _run(prompt, reply, STEP * 1.2)
    assert meter.spec_rests.get() >= 1, meter
    before = meter.spec_verifications.get()
    for _ in range(4):
        meter, job, _ = _run(prompt, reply, STEP * 1.2, spec=spec)
        assert job.out.generated == reply
    assert meter.spec_verifications.get() - before <= 3, meter


def _measured() -> StepTimer:
    """Costs a server's timer held after earlier requests (SmolLM2 on this machine: a
    draft adds about half a step), where a lane that knows nothing of its text
    (acceptance: the prior, one half) would not draft."""
    return StepTimer(decode_s={1: 0.0127}, verify_s={1: 0.009, 2: 0.0134, 4: 0.021,
                                                      8: 0.041})


def test_a_copy_from_the_first_token_is_probed_at_once() -> None:
    # the reply copies the prompt from its first token: the first drafts lookup finds
    # are a probe, not judged by the prior and rested on
    prompt = list(range(10, 130))
    reply = (prompt * 2)[:64]
    meter, job, _ = _run(prompt, reply, 0.005, _measured())
    assert job.out.generated == reply
    assert meter.spec_rests.get() == 0, meter
    assert meter.spec_verifications.get() < 0.5 * len(reply), meter


def test_a_stray_slow_first_measurement_does_not_stop_drafting() -> None:
    # the first verifications a server measured ran while something else held the cores
    # (or a draft model's weights were being paged in): ten times what they cost. A
    # later sample at half that or less replaces the figure; one stray must not keep a
    # copying lane resting for the rest of the process
    stray = StepTimer(decode_s={1: STEP}, verify_s={k: 10 * k * PER_DRAFT for k in (2, 8)})
    prompt = list(range(10, 130))
    reply = _reply(prompt, 200)
    meter, job, _ = _run(prompt, reply, PER_DRAFT, stray)
    assert job.out.generated == reply
    assert meter.spec_tokens.get("drafted") >= 0.6 * len(reply), meter


def test_probes_that_copy_well_but_lose_grow_apart() -> None:
    # every draft is accepted (the reply copies its prompt) but a draft costs more than
    # a step: a probe that copied well says nothing for the next step, so the lane's
    # rests grow as after any probe that did not pay, and probes stay rare (a rest that
    # started short again after each would probe every few dozen tokens)
    prompt = list(range(10, 130))
    reply = _reply(prompt, 1000)
    meter, job, _ = _run(prompt, reply, STEP * 1.2)
    assert job.out.generated == reply
    assert meter.spec_probes.get() <= 6, meter  # 32, 64, ... 1024 tokens apart
    assert meter.spec_verifications.get() <= 12, meter


class _SilentDraft:
    """A draft model that is never sure enough of a token (``draft_min_p``): asked for
    drafts, it makes none; ``per_token``: what the cost model charges a token of it."""

    def __init__(self, per_token: float) -> None:
        self.per_token = per_token
        self.asked = 0
        self.followed = 0

    def behind(self, lane_id: int, tokens: np.ndarray, tenant: str) -> int:
        return 0

    def propose(self, asks: list[Any]) -> dict[int, np.ndarray]:
        want = sum(a.want for a in asks)
        self.asked += want
        self.followed = sum(a.step for a in asks)
        return {}


def test_a_draft_model_that_drafts_nothing_is_not_asked_by_each_new_request() -> None:
    # what the first request learned of the draft model (asked, it made nothing) is
    # where the next ones start: they do not ask it again at each step until their own
    # misses add up
    prompt = list(range(10, 130))
    reply = [900 + i for i in range(24)]  # nothing prompt lookup could find
    draft = _SilentDraft(STEP)  # the tiny synthetic pairs: a draft token costs a step
    timer = StepTimer(decode_s={1: STEP})
    spec = None
    asked = []
    for _ in range(3):
        before = draft.asked
        _, job, spec = _run(prompt, reply, PER_DRAFT, timer, draft=draft, spec=spec)
        assert job.out.generated == reply
        asked.append(draft.asked - before)
    assert asked[0] > 0, asked
    # at most a probe (two drafts, at a request's first step, as rarely as probes keep
    # not paying): a model measured to lose is measured again now and then
    assert all(n <= 2 for n in asked[1:]) and sum(asked[1:]) < asked[0], asked


def test_a_probe_with_nothing_to_draft_stays_in_the_fast_path() -> None:
    # a resting lone lane's probe is checked where it decodes (Executor.decode_alone):
    # nothing found, the lane rests again (twice as long) without a planned step; a copy
    # found, the probe is the next planned step's
    prompt = list(range(10, 130))
    reply = [900 + i for i in range(38)] + [prompt[3], 999]  # the lane ends with prompt[3]
    _, job, spec = _run(prompt, reply, PER_DRAFT, _measured())
    for pending, quiet in ((901, True), (prompt[4], False)):
        job.spec.resting, job.spec.since, job.spec.rest = True, 64, 64
        job.out.pending = pending
        assert spec.wants_step(job)
        assert spec.quiet_probe(job) is quiet
        assert job.spec.resting and job.spec.rest == (128 if quiet else 64)
        assert spec.wants_step(job) is not quiet


def test_a_copy_that_holds_is_judged_apart_from_new_short_matches() -> None:
    # on this lane, drafts from new matches of two tokens were rejected again and again
    # (a reply that reuses its prompt's words in an order of its own): their record is
    # poor. A reply that copies the prompt whole must still be drafted: drafts from a
    # longer match, and from the copy while it holds, have records of their own
    prompt = list(range(10, 130))
    reply = (prompt * 2)[:160]
    meter, job, _ = _run(prompt, reply, 0.005, _measured(), lookup_record=(0.0, 20.0))
    assert job.out.generated == reply
    assert meter.spec_tokens.get("accepted") >= 0.6 * len(reply), meter
    assert meter.spec_verifications.get() < 0.4 * len(reply), meter


def test_a_resting_lane_drafts_a_copy_as_soon_as_it_starts() -> None:
    # the reply's first dozen tokens are its own: prompt lookup finds nothing, and the
    # lane rests (a probe 32 tokens later). The copy of the prompt that follows is
    # drafted within a few tokens (a lookup at every token costs far less than a step
    # here), not after the rest
    prompt = list(range(10, 130))
    own = list(range(900, 912))
    reply = own + prompt[:100]
    verified_at: list[int] = []
    timer = _measured()
    cfg = load_config(None)
    parts: Any = SimpleNamespace(
        cfg=cfg, meter=EngineMeter(), draft=None, rs_snapshots=False, staging=False,
        ctx=SimpleNamespace(n_ctx_seq=8192, seq_rm=lambda *a: True))
    spec = Speculation(parts, timer)
    verify = spec.verify

    def noting(w: Work, take: Any) -> None:
        if len(w.job.spec.drafts):
            verified_at.append(len(w.job.out.generated))
        verify(w, take)

    spec.verify = noting  # type: ignore[method-assign]
    meter, job, _ = _run(prompt, reply, 0.005, spec=spec)
    assert job.out.generated == reply
    assert meter.spec_rests.get() >= 1, meter  # it rested through its own words
    assert verified_at and verified_at[0] <= len(own) + 4, verified_at


def test_draft_costs_follow_the_step_as_the_context_grows() -> None:
    # verifications measured on a short chat (a step of 9 ms); the lane then decodes a
    # long file and a step takes 13.5 ms: a draft's cost grows with it (attention reads
    # the longer context for every drafted token too), where a cost kept in seconds
    # would make drafts look a third cheaper than they are
    timer = StepTimer()
    timer.record(0.009 * 10, 1, 0, steps=10, alone=True)
    timer.record(0.009 + 3 * 0.0045, 1, 0, drafts=StepDrafts(tokens=3, lanes=1))
    assert abs((timer.verify_cost(3) or 0) - 3 * 0.0045) < 1e-9
    for _ in range(30):
        timer.record(0.0135 * 25, 1, 0, steps=25, alone=True)
    assert abs((timer.verify_cost(3) or 0) - 3 * 0.00675) < 1e-4
    # measured again at the new size: kept as measured
    timer.record(0.0135 + 3 * 0.0066, 1, 0, drafts=StepDrafts(tokens=3, lanes=1))
    assert abs((timer.verify_cost(3) or 0) - 3 * 0.00673) < 1e-4


class _RightDraft:
    """A draft model that drafts exactly the reply's next tokens, in no time."""

    def __init__(self, prompt: list[int], reply: list[int]) -> None:
        self.n_prompt, self.reply = len(prompt), reply
        self.asked = 0
        self.followed = 0

    def behind(self, lane_id: int, tokens: np.ndarray, tenant: str) -> int:
        return 0

    def propose(self, asks: list[Any]) -> dict[int, np.ndarray]:
        out = {}
        for a in asks:
            if a.want:
                self.asked += a.want
                at = len(a.tokens) - self.n_prompt  # the reply's tokens the lane will hold
                out[a.lane] = np.array(self.reply[at: at + a.want], dtype=np.int32)
        return out


def test_a_draft_model_whose_steps_lose_is_asked_only_in_probes() -> None:
    # each part of asking the draft model looks cheap (its time, the verification), and
    # its drafts are all accepted; but the steps that asked it yielded a lone lane's
    # tokens three times slower than steps without it (what hybrid-mid's pair did here:
    # costs its parts' estimates missed). It is then asked only in a probe; measured
    # to pay, it drafts the reply
    prompt = list(range(10, 130))
    reply = [900 + i for i in range(200)]  # nothing prompt lookup could find
    asked = {}
    for yield_s in (3 * STEP, STEP / 2):
        timer = StepTimer(decode_s={1: STEP}, alone_s=STEP, verify_s={1: PER_DRAFT},
                          model_step_s=yield_s, model_yielded=1.0)
        draft = _RightDraft(prompt, reply)
        _, job, _ = _run(prompt, reply, PER_DRAFT, timer, draft=draft)
        assert job.out.generated == reply
        asked[yield_s] = draft.asked
    assert asked[3 * STEP] <= 4, asked
    assert asked[STEP / 2] >= 100, asked


def test_steps_that_ask_the_draft_model_measure_what_a_lone_lane_got() -> None:
    timer = StepTimer()
    asked = StepDrafts(tokens=1, lanes=1, model_asked=1, model_s=0.004)
    timer.record(0.010, 1, 0, drafts=asked, yielded=2)
    assert abs(timer.model_yield_s - 0.005) < 1e-12
    timer.record(0.010, 2, 0, drafts=asked, yielded=3)  # two lanes: not a lone lane's
    timer.record(0.010, 1, 0, drafts=StepDrafts(tokens=1, lanes=1), yielded=2)  # lookup's
    assert abs(timer.model_yield_s - 0.005) < 1e-12


def test_what_the_draft_model_yields_is_total_time_over_total_tokens() -> None:
    # steps that asked the draft model alternately declined to draft (12 ms, one token)
    # and had four drafts accepted (24 ms, five tokens): 36 ms for six tokens, 6 ms a
    # token, which beats lone steps of 7 ms. An average of each step's seconds per
    # token (12 ms and 4.8 ms) says the model loses
    timer = StepTimer(alone_s=0.007)
    asked = StepDrafts(tokens=4, lanes=1, model_asked=4, model_s=0.002)
    for i in range(200):
        timer.record(0.024 if i % 2 else 0.012, 1, 0, drafts=asked, yielded=5 if i % 2 else 1)
        if i > 40:
            assert 0.0054 < timer.model_yield_s < timer.alone_s, (i, timer.model_yield_s)


def _segments(prompt: list[int], first: int, n: int) -> list[int]:
    """A reply of ``n`` pieces of the prompt, each after a word of its own: each copy
    starts where the last two tokens match the prompt (a new short match, LOOKUP), never
    a longer one."""
    out: list[int] = []
    for i in range(n):
        s = 20 * i
        out += [first + i] + prompt[s: s + 12]
    return out


def test_a_new_request_judges_short_matches_by_earlier_requests() -> None:
    # where a draft costs most of a step (SmolLM2 here), a short match pays only if it
    # is likely right. The second request's first short match is rejected (its opening
    # words); judged by that alone it would decline every later one, and each copy of
    # the prompt would wait for a probe. Earlier requests' short matches, mostly
    # accepted, are its prior, as a copy's and a long match's are (speculation._prime)
    prompt = list(range(10, 250))
    per_draft = 0.008  # of a 12.7 ms step
    first = _segments(prompt, 900, 12)
    meter, _, spec = _run(prompt, first, per_draft, _measured())
    assert spec.accepted[LOOKUP] > 4 * spec.rejected[LOOKUP], spec.accepted
    before = meter.spec_tokens.get("accepted")
    second = [prompt[100], prompt[101], 950] + _segments(prompt, 960, 12)
    meter, job, _ = _run(prompt, second, per_draft, spec=spec)
    assert job.out.generated == second
    # judged by its own first rejection, the lane accepted 89 drafts here
    assert meter.spec_tokens.get("accepted") - before >= 0.6 * len(second), meter


def test_where_costs_are_set_the_timer_learns_them_not_the_seconds_taken() -> None:
    # a busy machine: a step took half a second, a lookup 20 ms, the draft model 90 ms
    # for its 3 tokens. With a cost model set, the timer learns what it charges, so the
    # choices made from the timer are the same however long the work took
    costs = StepCosts(decode_s=0.002, lane_s=0.001, prefill_s=0.0001, draft_s=0.003,
                      model_s=0.004, lookup_s=0.00005)
    timer = StepTimer(costs=costs)
    drafts = StepDrafts(tokens=2, lanes=1, model_asked=2, model_s=timer.took_model(0.09, 3))
    assert drafts.model_s == 3 * 0.004
    assert timer.took(0.5, 1, 0) == 0.002
    assert timer.took(0.5, 2, 64) == 0.002 + 0.001 + 64 * 0.0001
    assert timer.took(0.5, 1, 0, drafts=drafts) == 0.002 + 2 * 0.003 + 3 * 0.004
    assert timer.took(0.5, 1, 0, steps=10) == 10 * 0.002
    assert timer.took_lookup(0.02) == 0.00005
    # and without one, the seconds measured
    plain = StepTimer()
    assert (plain.took(0.5, 1, 0, drafts=drafts), plain.took_model(0.09, 3),
            plain.took_lookup(0.02)) == (0.5, 0.09, 0.02)
