"""Adaptive drafting's choices (proxy/engine/speculation.py) on step costs that do not
depend on how busy the machine is: the real controller and step timer, a lane and a
"target" that replies with a fixed token sequence, and a clock that charges each step
what the model measured costs (the HTTP tests run the real model, where timings vary).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np

from proxy.engine.job import Job, StepDrafts, Work
from proxy.engine.lanes import Lane
from proxy.engine.speculation import Speculation
from proxy.engine.timing import StepTimer
from proxy.meters import EngineMeter
from statecache.config import load_config

STEP = 0.025  # Gemma 3 270M, one token, on this machine's two cores
PER_DRAFT = 0.055 / 8  # what a draft adds (its logits row: Gemma's 262k-token vocabulary)


def _reply(prompt: list[int], n: int) -> list[int]:
    """A reply that starts as the prompt does, turns away (prompt lookup's first drafts
    are rejected), then copies the prompt."""
    own = prompt[:3] + [900]
    return (own + prompt * 4)[:n]


def _run(prompt: list[int], reply: list[int], per_draft: float,
         timer: StepTimer | None = None) -> tuple[Any, Job]:
    cfg = load_config(None)  # "auto": prompt lookup, where no draft model is loaded
    meter = EngineMeter()
    parts: Any = SimpleNamespace(
        cfg=cfg, meter=meter, draft=None, rs_snapshots=False, staging=False,
        ctx=SimpleNamespace(n_ctx_seq=8192, seq_rm=lambda *a: True))
    timer = timer or StepTimer()
    spec = Speculation(parts, timer)
    req: Any = SimpleNamespace(sampling=SimpleNamespace(max_tokens=len(reply)), tenant="",
                               session=None)
    lane = Lane(0)
    lane.extend(np.array(prompt, dtype=np.int32))
    job = Job(req=req, prompt=np.array(prompt, dtype=np.int32), use_cache=False,
              t_submit=0.0, lane=lane, pos=len(prompt))
    job.spec.on = True

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
        if k:
            timer.record(STEP + k * per_draft, 1, 0, drafts=StepDrafts(tokens=k, lanes=1))
        else:
            timer.record(STEP, 1, 0)
        spec.verify(w, take)
    return meter, job


def test_a_reply_that_copies_its_prompt_keeps_drafting() -> None:
    # the first verification is all rejected (the reply's own words), then the copy
    # goes on: drafting pays (8 drafts cost 2.2 steps, each accepted), the lane must not
    # rest through the copy
    prompt = list(range(10, 130))
    reply = _reply(prompt, 96)
    meter, job = _run(prompt, reply, PER_DRAFT)
    verifications = meter.spec_verifications.get()
    assert job.out.generated == reply  # drafts never change what the target said
    assert meter.spec_tokens.get("drafted") >= 60, meter
    assert verifications < 0.3 * len(reply), verifications
    assert meter.get("spec_rests") == 0, meter


def test_drafts_that_cost_more_than_they_yield_rest() -> None:
    # the same copy where each draft costs a whole step: even all accepted, a
    # verification of k yields k + 1 tokens in k + 1 steps' time. The lane rests after
    # its first measurements and only probes.
    prompt = list(range(10, 130))
    reply = _reply(prompt, 200)
    meter, job = _run(prompt, reply, STEP * 1.2)
    assert job.out.generated == reply
    assert meter.get("spec_rests") >= 1, meter
    assert meter.spec_tokens.get("drafted") < 0.5 * len(reply), meter


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
    meter, job = _run(prompt, reply, 0.005, _measured())
    assert job.out.generated == reply
    assert meter.get("spec_rests") == 0, meter
    assert meter.spec_verifications.get() < 0.5 * len(reply), meter


def test_a_stray_slow_first_measurement_does_not_stop_drafting() -> None:
    # the first verifications a server measured ran while something else held the cores
    # (or a draft model's weights were being paged in): ten times what they cost. A
    # later sample at half that or less replaces the figure; one stray must not keep a
    # copying lane resting for the rest of the process
    stray = StepTimer(decode_s={1: STEP}, verify_s={k: 10 * k * PER_DRAFT for k in (2, 8)})
    prompt = list(range(10, 130))
    reply = _reply(prompt, 200)
    meter, job = _run(prompt, reply, PER_DRAFT, stray)
    assert job.out.generated == reply
    assert meter.spec_tokens.get("drafted") >= 0.6 * len(reply), meter
