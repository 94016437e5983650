"""What goes into one engine step, and measured step times to size it.

A step costs about ``a(d) + b * p``: ``a(d)`` a decode-only step of ``d`` lanes, ``b``
one prefill token of a large batch. Both are moving averages of what the steps took,
so the sizes follow the model, the machine and the load.

While streams decode, a long prompt prefills in bursts: one step carries as many of
its tokens as fit in ``pause_s`` (whole chunks of ``CHUNK`` tokens once it is that
large), then the streams get steps of their own for as long as the burst took, times
``share / (1 - share)`` (a prompt whose rest fits in one burst does not wait). Small
slices in every step would cost more for both sides on a CPU: ``python -m bench.chunks``
measures a Gated DeltaNet hybrid (Qwen3.5's kind) at about a decode step per token for
slices under 64 tokens of a lane, and half that for whole chunks of 64; the outcome for
the streams is ``python -m bench.batching``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from proxy.engine.executor import Executor, Job, Work

ALPHA = 0.2  # weight of the newest measurement
MIN_SAMPLE = 32  # prefill tokens a step needs to tell us the cost of one
MAX_STARVED = 2  # steps a prefill may get nothing (beyond what the streams are owed)
SHORT_PREFILL = 256  # prompt tokens left that count as close to the first token
# Tokens of one lane that a recurrent layer processes as one chunk (llama.cpp's
# CHUNK_SIZE for Gated DeltaNet); a burst is a whole number of them. Beside decoding
# lanes it is one more: llama.cpp splits such a batch into a ubatch of one token of
# every lane, then the rest of the prefilling lane.
CHUNK = 64


@dataclass(slots=True)
class StepTimer:
    decode_s: dict[int, float] = field(default_factory=dict)  # a(d)
    per_token_s: float = 0.0  # b; 0 until measured
    steps: int = 0
    share: float = 0.5  # of the time, the streams' while a long prompt prefills
    owed_s: float = 0.0  # time the streams get before the next burst
    burst: bool = False  # the step planned last carries a burst

    def record(self, seconds: float, n_decode: int, n_prefill: int, *, steps: int = 1) -> None:
        """``steps`` alike took ``seconds`` in all."""
        self.steps += steps
        burst, self.burst = self.burst, False
        if burst:
            self.owed_s = seconds * self.share / (1.0 - self.share)
        elif n_decode:
            self.owed_s -= seconds
        seconds /= steps
        if n_decode == 0:
            if n_prefill >= MIN_SAMPLE:
                self._per_token(seconds / n_prefill)
            return
        a = self.decode_s.get(n_decode)
        if n_prefill == 0:
            self.decode_s[n_decode] = seconds if a is None else a + ALPHA * (seconds - a)
        elif a is not None:
            if n_prefill >= MIN_SAMPLE:
                self._per_token(max(seconds - a, 0.0) / n_prefill)
        elif self.per_token_s:
            est = max(seconds - self.per_token_s * n_prefill, 0.0)
            self.decode_s[n_decode] = est if a is None else a + ALPHA * (est - a)

    def _per_token(self, x: float) -> None:
        self.per_token_s = x if not self.per_token_s else \
            self.per_token_s + ALPHA * (x - self.per_token_s)

    def burst_tokens(self, pause_s: float, min_chunk: int, budget: int, beside: int) -> int:
        """Prefill tokens of one burst: what fits in ``pause_s`` at the measured rate,
        rounded down to whole chunks (plus ``beside``: 1 with decoding lanes in the step),
        at least ``min_chunk``; ``pause_s`` 0: no limit."""
        if pause_s <= 0:
            return budget
        b = self.per_token_s
        fit = int(pause_s / b) if b else CHUNK + beside
        if fit >= CHUNK + beside:
            fit = (fit - beside) // CHUNK * CHUNK + beside
        return min(max(fit, min_chunk), budget)


def plan_step(jobs: list[Job], executor: Executor, timer: StepTimer, *, step_tokens: int,
              prefill_chunk: int, pause_s: float, min_chunk: int) -> list[Work]:
    """One step's work: a token for every decoding lane first, then the prefills that are
    close to their first token (shortest first: a short request behind a long one does
    not wait for it), then the long prefills. While lanes decode, the long prefills go
    in bursts (the module's docstring); a step with a short prefill carries none."""
    works: list[Work] = []
    decoding = [j for j in jobs if not j.prefilling]
    used = 0
    for i, job in enumerate(decoding):
        # room for drafts (speculative decoding), leaving one token to each lane after it
        w = executor.work_for(job, step_tokens - used - (len(decoding) - i - 1))
        assert w is not None
        works.append(w)
        used += w.n
    if works and len(works) == len(jobs):
        return works  # every lane decodes: nothing to prefill
    budget = step_tokens - used
    prefilling = sorted((j for j in jobs if j.prefilling), key=lambda j: len(j.prompt) - j.pos)
    # a short request (its whole prefill is short), not the tail of a long one
    short = [j for j in prefilling if len(j.prompt) - j.reuse <= SHORT_PREFILL]
    long = sorted((j for j in prefilling if len(j.prompt) - j.reuse > SHORT_PREFILL),
                  key=lambda j: (j.starved < MAX_STARVED, len(j.prompt) - j.pos))
    given = 0
    for job in short:
        got = _add(works, job, executor, min(budget, prefill_chunk))
        budget -= got
        given += got
    if not decoding:
        timer.owed_s = 0.0
    elif long:
        burst = timer.burst_tokens(pause_s, min_chunk, budget, beside=1)
        # the streams' turn (or a short request's); a prompt whose rest fits in one
        # burst goes on: its first token is that close, and it then decodes with them
        if given or (timer.owed_s > 0 and any(len(j.prompt) - j.pos > burst for j in long)):
            for job in long:
                job.starved += 1
            return works
        budget = burst
        timer.burst = True
    if given and long and not decoding:
        budget = min(budget, min_chunk)  # the short request's first token comes first
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
