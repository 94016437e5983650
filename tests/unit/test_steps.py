"""The step planner's arithmetic (proxy/engine/steps.py), without a model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from proxy.engine.steps import SHORT_PREFILL, StepTimer, plan_step


def test_prefill_beside_decoding_is_sized_from_steps_that_carried_both() -> None:
    t = StepTimer()
    t.record(0.004, 1, 0)  # a decode-only step: a(1) = 4 ms
    t.record(0.400, 0, 512)  # a large prefill-only batch: 0.78 ms a token
    # what a 4 ms step may add at factor 2 (4 ms more), at the large batch's rate
    assert t.prefill_allowance(2.0, 1, 1, 512) == 5
    # steps with a decoding lane and a small slice show the slice's real cost: 2 ms a
    # token; the allowance follows it
    for _ in range(30):
        t.record(0.004 + 4 * 0.002, 1, 4)
    assert t.prefill_allowance(2.0, 1, 1, 512) == 2
    assert t.prefill_allowance(2.0, 1, 16, 512) == 16  # never below min_prefill_chunk
    assert t.prefill_allowance(0.0, 1, 1, 512) == 512  # factor 0: no limit


@dataclass
class _Job:
    prompt: np.ndarray
    reuse: int = 0
    pos: int = 0
    starved: int = 0
    name: str = ""

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
                      factor=2.0, min_chunk=16)
    return {w.job.name: w.n for w in works}


def test_the_tail_of_a_long_prompt_stays_limited_but_a_short_request_is_not() -> None:
    t = StepTimer()
    t.record(0.004, 1, 0)
    t.record(0.400, 0, 512)
    stream = _Job(np.zeros(10, dtype=np.int32), pos=10, name="stream")  # decoding
    # a long prompt with 100 tokens left: its tail, still latency-limited
    tail = _Job(np.zeros(8000, dtype=np.int32), pos=7900, name="tail")
    got = _plan([stream, tail], t)
    assert got["stream"] == 1 and got["tail"] == 16
    # a short request (its whole prefill is 100 tokens) goes in at once
    short = _Job(np.zeros(100, dtype=np.int32), name="short")
    assert SHORT_PREFILL >= 100
    got = _plan([stream, short], t)
    assert got["short"] == 100
