"""The step planner's arithmetic (proxy/engine/steps.py), without a model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from proxy.engine.job import Waiting
from proxy.engine.steps import SHORT_PREFILL, plan_step
from proxy.engine.timing import CHUNK, StepTimer


def test_a_burst_is_what_fits_in_the_pause_in_whole_recurrent_chunks() -> None:
    t = StepTimer()
    assert t.burst_tokens(0.1, 16, 512, beside=1) == CHUNK + 1  # nothing measured yet
    t.record(0.004, 1, 0)  # a decode-only step
    t.record(0.100, 0, 100)  # a prefill-only batch: 1 ms a token
    # 100 tokens fit in 100 ms: whole chunks of 64, plus the token that goes with the
    # decoding lanes' ubatch
    assert t.burst_tokens(0.1, 16, 512, beside=1) == 65
    assert t.burst_tokens(0.1, 16, 512, beside=0) == 64
    assert t.burst_tokens(0.2, 16, 512, beside=1) == 193
    assert t.burst_tokens(1.0, 16, 512, beside=1) == 512  # the step's budget
    assert t.burst_tokens(0.01, 16, 512, beside=1) == 16  # never below min_prefill_chunk
    assert t.burst_tokens(0.0, 16, 300, beside=1) == 300  # pause 0: no limit


@dataclass
class _Job:
    prompt: np.ndarray
    reuse: int = 0
    pos: int = 0
    name: str = ""
    wait: Waiting = field(default_factory=Waiting)

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.prompt)


@dataclass
class _Work:
    job: Any
    n: int


@dataclass
class _Exec:
    given: list[tuple[str, int]] = field(default_factory=list)

    def work_for(self, job: _Job, budget: int) -> _Work | None:
        if not job.prefilling:
            return _Work(job, 1)
        n = min(budget, len(job.prompt) - job.pos)
        return _Work(job, n) if n > 0 else None


def _plan(jobs: list[_Job], timer: StepTimer) -> dict[str, int]:
    works = plan_step(jobs, _Exec(), timer, step_tokens=512, prefill_chunk=512,  # type: ignore[arg-type]
                      pause_s=0.1, min_chunk=16)
    return {w.job.name: w.n for w in works}


def _measured(share: float = 0.5) -> StepTimer:
    t = StepTimer(share=share)
    t.record(0.004, 1, 0)
    t.record(0.100, 0, 100)  # 1 ms a prefill token
    return t


def test_a_long_prompt_prefills_in_bursts_and_the_streams_get_their_share() -> None:
    t = _measured()
    stream = _Job(np.zeros(10, dtype=np.int32), pos=10, name="stream")  # decoding
    long = _Job(np.zeros(8000, dtype=np.int32), name="long")
    got = _plan([stream, long], t)
    assert got == {"stream": 1, "long": 65} and t.burst  # one burst...
    long.pos += 65
    t.record(0.070, 1, 65)
    assert t.owed_s == pytest.approx(0.070)  # ...then as long for the stream alone
    alone = 0
    while (got := _plan([stream, long], t)) == {"stream": 1}:
        t.record(0.004, 1, 0)
        alone += 1
    assert alone == 18 and got == {"stream": 1, "long": 65}  # 18 x 4 ms >= 70 ms
    # the last burst of a prompt does not wait: its first token is that close
    t.record(0.070, 1, 65)
    assert t.owed_s > 0 and _plan([stream, long], t) == {"stream": 1}
    long.pos = 8000 - 65
    assert _plan([stream, long], t) == {"stream": 1, "long": 65}
    long.pos = 65
    # a larger share for the streams: three times the burst's time
    t = _measured(share=0.75)
    _plan([stream, long], t)
    t.record(0.070, 1, 65)
    assert t.owed_s == pytest.approx(0.210)
    # no stream: the prompt goes at full size, and nothing is owed
    assert _plan([long], t) == {"long": 512} and t.owed_s == 0


def test_a_short_request_goes_in_at_once_and_holds_the_burst_back() -> None:
    t = _measured()
    stream = _Job(np.zeros(10, dtype=np.int32), pos=10, name="stream")
    long = _Job(np.zeros(8000, dtype=np.int32), pos=7900, name="long")
    short = _Job(np.zeros(100, dtype=np.int32), name="short")
    assert SHORT_PREFILL >= 100
    # a short request (its whole prefill is 100 tokens) goes in at once; the long
    # prompt's burst waits for the next step
    assert _plan([stream, short, long], t) == {"stream": 1, "short": 100}
    assert long.wait.starved == 1
    # the tail of a long prompt (100 tokens left) is no short request: a burst
    assert _plan([stream, long], t) == {"stream": 1, "long": 65}
    # no stream, a short request and a long prompt: the short one's first token first
    short2 = _Job(np.zeros(100, dtype=np.int32), name="short2")
    long2 = _Job(np.zeros(8000, dtype=np.int32), name="long2")
    assert _plan([short2, long2], _measured()) == {"short2": 100, "long2": 16}
