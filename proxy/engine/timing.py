"""What engine steps cost, measured as they run: ``StepTimer``.

A step costs about ``a(d) + b * p``: ``a(d)`` a decode-only step of ``d`` lanes, ``b``
one prefill token of a large batch. Both are moving averages of what the steps took,
so the sizes follow the model, the machine and the load. Beside them, what drafts add
to a step (a verification of ``k`` drafts, the draft model's own time), which
proxy/engine/draftlength.py weighs against the tokens it expects them to yield.

Where a test sets ``StepTimer.costs`` (``StepCosts``), each piece of work is charged
what that cost model says instead of the seconds it took, so every decision these
figures feed (drafting, bursts of prefill, the streams' share) is the same on a busy
machine as on a quiet one: the seconds the callers measure pass through ``took``,
``took_model`` and ``took_lookup``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from proxy.engine.job import StepDrafts

ALPHA = 0.2  # weight of the newest measurement
MIN_SAMPLE = 32  # prefill tokens a step needs to tell us the cost of one
# Tokens of one lane that a recurrent layer processes as one chunk (llama.cpp's
# CHUNK_SIZE for Gated DeltaNet); a burst is a whole number of them. Beside decoding
# lanes it is one more: llama.cpp splits such a batch into a ubatch of one token of
# every lane, then the rest of the prefilling lane.
CHUNK = 64


@dataclass(frozen=True, slots=True)
class StepCosts:
    """What each piece of work is charged, in seconds, where a test sets the costs."""

    decode_s: float  # a decode step of one lane (a lone lane's token too)
    lane_s: float = 0.0  # each further decoding lane in the step
    prefill_s: float = 0.0  # a prompt token
    draft_s: float = 0.0  # a drafted token the step verifies
    model_s: float = 0.0  # a token the draft model is asked for or follows
    lookup_s: float = 0.0  # a prompt lookup

    def step(self, n_decode: int, n_prefill: int, drafts: int = 0) -> float:
        decode = self.decode_s + self.lane_s * (n_decode - 1) if n_decode else 0.0
        return decode + self.prefill_s * n_prefill + self.draft_s * drafts


@dataclass(slots=True)
class StepTimer:
    decode_s: dict[int, float] = field(default_factory=dict)  # a(d)
    # what a verification of k drafts adds to a decode step, per lane (a bigger batch, a
    # staged save, a rollback), and the draft model's seconds per drafted token:
    # proxy/engine/draftlength.py weighs them against the drafts it expects accepted
    verify_s: dict[int, float] = field(default_factory=dict)
    # the step of one lane those costs go with (0: as they are): a draft costs about a
    # share of a step, and both grow with the lane's context (docs/design.md fact 17),
    # so the costs follow the step
    verify_at: float = 0.0
    model_s: float = 0.0  # per token asked of it
    # per token it decodes to catch up with its lane (after a rest, or a prompt that was
    # cached, not prefilled: the draft did not follow it); 0 until measured
    follow_s: float = 0.0
    # a token of a lone stream in its own run of steps (Stepper._decode_alone: no step
    # planned): what a lone lane's drafts compete with
    alone_s: float = 0.0
    # what a lone lane's steps that asked the draft model took, and the tokens they
    # yielded (moving averages of each): everything in (its following, its drafts, what
    # it declined to draft, their verification, the planned step), against alone_s,
    # where its parts' estimates may miss a cost (``model_yield_s``)
    model_step_s: float = 0.0
    model_yielded: float = 0.0
    per_token_s: float = 0.0  # b; 0 until measured
    lookup_s: float = 0.0  # what a prompt lookup costs (proxy/engine/draftlength.py)
    steps: int = 0
    share: float = 0.5  # of the time, the streams' while a long prompt prefills
    owed_s: float = 0.0  # time the streams get before the next burst
    burst: bool = False  # the step planned last carries a burst
    costs: StepCosts | None = None  # charged instead of the seconds measured (a test's)

    def took(self, seconds: float, n_decode: int, n_prefill: int, *, steps: int = 1,
             drafts: StepDrafts | None = None) -> float:
        """What ``steps`` alike count as, measured at ``seconds`` (the draft model's time
        included, as ``drafts.model_s``): those seconds, or what ``costs`` charges."""
        if self.costs is None:
            return seconds
        extra = drafts.model_s if drafts is not None else 0.0
        n_drafts = drafts.tokens if drafts is not None else 0
        return steps * self.costs.step(n_decode, n_prefill, n_drafts) + extra

    def took_model(self, seconds: float, tokens: int) -> float:
        """The draft model's ``seconds`` for ``tokens`` asked of it or followed."""
        return seconds if self.costs is None else self.costs.model_s * tokens

    def took_lookup(self, seconds: float) -> float:
        """A prompt lookup's ``seconds``."""
        return seconds if self.costs is None else self.costs.lookup_s

    def record(self, seconds: float, n_decode: int, n_prefill: int, *, steps: int = 1,
               drafts: StepDrafts | None = None, alone: bool = False,
               yielded: int = 0) -> None:
        """``steps`` alike took ``seconds`` in all; ``drafts``: what the step drafted;
        ``alone``: a lone stream's run of steps; ``yielded``: the tokens its decoding
        lanes got."""
        if alone and steps:
            self.alone_s = steady(self.alone_s or None, seconds / steps)
        if drafts is not None and drafts.model_asked and n_decode == 1 and not n_prefill \
                and yielded > 0:
            self.model_step_s = steady(self.model_step_s or None, seconds)
            self.model_yielded = average(self.model_yielded, float(yielded))
        if drafts is not None and drafts.tokens:
            self._verified(seconds, n_decode, n_prefill, drafts)
            self.steps += steps
            return
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

    def _verified(self, seconds: float, n_decode: int, n_prefill: int,
                  drafts: StepDrafts) -> None:
        a = self.base_s(n_decode)
        if not a or n_prefill or not drafts.lanes:
            return
        extra = max(seconds - drafts.model_s - a, 0.0) / drafts.lanes
        k = max(1, round(drafts.tokens / drafts.lanes))
        one = self.base_s(1) or a
        if self.verify_at and one != self.verify_at:  # the costs, as of this step's size
            for j in self.verify_s:
                self.verify_s[j] *= one / self.verify_at
        self.verify_at = one
        self.verify_s[k] = steady(self.verify_s.get(k), extra)
        for j, old in self.verify_s.items():  # the other lengths, less, scaled: no length
            if j != k:  # keeps a cost that later steps never measure again
                self.verify_s[j] = steady(old, extra * j / k, ALPHA / 2)

    def asked(self, seconds: float, tokens: int) -> None:
        """The draft model was asked for ``tokens`` drafts (made or not) in ``seconds``:
        measured even where it made none (then no verification measures the step)."""
        if tokens > 0:
            self.model_s = steady(self.model_s or None, seconds / tokens)

    def followed(self, seconds: float, tokens: int) -> None:
        """The draft model decoded ``tokens`` to catch up (and drafted) in ``seconds``."""
        if tokens > 0:
            self.follow_s = steady(self.follow_s or None, seconds / tokens)

    @property
    def model_yield_s(self) -> float:
        """Seconds per token a lone lane got from steps that asked the draft model (0:
        none measured): the average step over the average tokens it yielded, not an
        average of each step's seconds per token, which counts a step that yielded one
        token as much as one that yielded four and so makes drafts that pay look as if
        they lost (mean of ratios against ratio of means)."""
        return self.model_step_s / self.model_yielded if self.model_yielded else 0.0

    def base_s(self, lanes: int) -> float:
        """What a step of ``lanes`` decoding lanes costs without drafts (a lone lane: a
        token of its own run of steps, no step planned); 0 before it is measured."""
        if lanes == 1 and self.alone_s:
            return self.alone_s
        return self.decode_s.get(lanes, 0.0)

    def verify_cost(self, k: int) -> float | None:
        """What ``k`` drafts add to a step, per lane: measured at ``k``, else scaled from
        the nearest length measured, both as a share of a one-lane step (``verify_at``);
        None before any verification."""
        if not self.verify_s:
            return None
        scale = (self.base_s(1) or self.verify_at) / self.verify_at if self.verify_at else 1.0
        if k in self.verify_s:
            return self.verify_s[k] * scale
        near = min(self.verify_s, key=lambda j: (abs(j - k), j))
        return self.verify_s[near] * scale * k / near

    def _per_token(self, x: float) -> None:
        self.per_token_s = average(self.per_token_s, x)

    def looked(self, seconds: float) -> None:
        """A prompt lookup took ``seconds``."""
        self.lookup_s = average(self.lookup_s, seconds)

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


def average(old: float, x: float) -> float:
    """A moving average (0: nothing measured yet)."""
    return x if not old else old + ALPHA * (x - old)


def steady(old: float | None, x: float, alpha: float = ALPHA) -> float:
    """A moving average that one stray sample moves little: a step another process
    held the cores through counts as at most twice the average. A sample below half
    the average replaces it: work does not run much faster than it costs, so the
    average was such a stray (often the first sample: a first use pages weights in,
    allocates buffers), and a cost measured too high would keep drafting off, with too
    few samples to bring it down."""
    if old is None or old <= 0 or x < old / 2:
        return x
    return old + alpha * (min(x, old * 2) - old)
