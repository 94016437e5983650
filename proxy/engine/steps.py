"""What goes into one engine step, and measured step times to size it.

A step costs about ``a(d) + b * p``: ``a(d)`` a decode-only step of ``d`` lanes, ``b``
one prefill token. Both are moving averages of what the steps took, so the sizes
follow the model, the machine and the load.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.engine.executor import Executor, Job, Work

ALPHA = 0.2  # weight of the newest measurement
MIN_SAMPLE = 32  # prefill tokens a step needs to tell us the cost of one
MAX_STARVED = 2  # steps a prefill may get nothing before it goes first
SHORT_PREFILL = 256  # prompt tokens left that count as close to the first token


@dataclass(slots=True)
class StepTimer:
    decode_s: dict[int, float] = field(default_factory=dict)  # a(d)
    per_token_s: float = 0.0  # b; 0 until measured
    # b beside decoding lanes, from the small slices that steps with them carry: on a
    # CPU one prefill token there costs more than in a large prefill-only batch
    mixed_s: float = 0.0
    steps: int = 0

    def record(self, seconds: float, n_decode: int, n_prefill: int) -> None:
        self.steps += 1
        if n_decode == 0:
            if n_prefill >= MIN_SAMPLE:
                self._per_token(seconds / n_prefill)
            return
        a = self.decode_s.get(n_decode)
        if n_prefill == 0:
            self.decode_s[n_decode] = seconds if a is None else a + ALPHA * (seconds - a)
        elif a is not None:
            x = max(seconds - a, 0.0) / n_prefill
            self.mixed_s = x if not self.mixed_s else self.mixed_s + ALPHA * (x - self.mixed_s)
            if n_prefill >= MIN_SAMPLE:
                self._per_token(x)
        elif self.per_token_s:
            est = max(seconds - self.per_token_s * n_prefill, 0.0)
            self.decode_s[n_decode] = est if a is None else a + ALPHA * (est - a)

    def _per_token(self, x: float) -> None:
        self.per_token_s = x if not self.per_token_s else \
            self.per_token_s + ALPHA * (x - self.per_token_s)

    def prefill_allowance(self, factor: float, n_decode: int, min_chunk: int,
                          budget: int) -> int:
        """Prefill tokens a step may carry beside ``n_decode`` decoding lanes so that it
        takes at most ``factor`` times a decode-only step (0: no limit)."""
        if factor <= 0:
            return budget
        a = self.decode_s.get(n_decode)
        b = self.mixed_s or self.per_token_s
        if a is None or not b:
            return min(min_chunk, budget)
        fit = int((factor - 1.0) * a / b)
        return max(min(fit, budget), min(min_chunk, budget))


def plan_step(jobs: list[Job], executor: Executor, timer: StepTimer, *, step_tokens: int,
              prefill_chunk: int, factor: float, min_chunk: int) -> list[Work]:
    """One step's work: a token for every decoding lane first, then the prefills that are
    close to their first token (shortest first: a short request behind a long one does
    not wait for it), then the long prefills. While anything in the step waits on its
    latency (a decoding lane, a short prefill), the long prefills get only what keeps
    the step within ``factor`` times a decode-only step; a long prefill that got nothing
    for ``MAX_STARVED`` steps goes first among them."""
    works: list[Work] = []
    decoding = [j for j in jobs if not j.prefilling]
    used = 0
    for i, job in enumerate(decoding):
        # room for drafts (speculative decoding), leaving one token to each lane after it
        w = executor.work_for(job, step_tokens - used - (len(decoding) - i - 1))
        assert w is not None
        works.append(w)
        used += w.n
    budget = step_tokens - used
    prefilling = sorted((j for j in jobs if j.prefilling), key=lambda j: len(j.prompt) - j.pos)
    # a short request (its whole prefill is short), not the tail of a long one
    short = [j for j in prefilling if len(j.prompt) - j.reuse <= SHORT_PREFILL]
    long = sorted((j for j in prefilling if len(j.prompt) - j.reuse > SHORT_PREFILL),
                  key=lambda j: (j.starved < MAX_STARVED, len(j.prompt) - j.pos))
    for job in short:
        budget -= _add(works, job, executor, min(budget, prefill_chunk))
    if decoding or short:
        budget = min(budget, timer.prefill_allowance(factor, max(len(decoding), 1), min_chunk,
                                                     budget))
    for job in long:
        budget -= _add(works, job, executor, min(budget, prefill_chunk))
    return works


def _add(works: list[Work], job: Job, executor: Executor, budget: int) -> int:
    w = executor.work_for(job, budget) if budget > 0 else None
    if w is None:
        job.starved += 1
        return 0
    job.starved = 0
    works.append(w)
    return w.n
