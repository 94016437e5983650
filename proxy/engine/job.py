"""One request's progress through the engine, and one lane's share of a step.

A ``Job`` is what the engine thread knows of a request: its prompt and lane, how far
it got and how it ends, and three groups of its own: what it has produced and not yet
handed on (``out``), its place in the queue (``wait``), its speculative drafts
(``spec``). Runs on the engine thread only (the HTTP side sets ``cancelled``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from proxy.engine.detok import TextStream
from proxy.engine.lanes import Lane
from proxy.engine.sampling import Sampler
from proxy.engine.types import GenerationRequest, RequestStats, TokenLogprob
from statecache.pool.lease import Lease
from statecache.records import Kind, Role

Delta = tuple[str, tuple[int, ...]]
NONE: np.ndarray = np.empty(0, dtype=np.int32)


@dataclass(slots=True)
class Output:
    """What the request has produced."""

    sampler: Sampler | None = None
    stream: TextStream | None = None
    generated: list[int] = field(default_factory=list)
    pending: int = -1  # sampled token not yet decoded
    t_first: float = 0.0  # when the first token was sampled
    logprobs: list[TokenLogprob] = field(default_factory=list)  # not yet sent
    deltas: list[Delta] = field(default_factory=list)  # text produced and not yet sent
    written: bool = False  # the engine has handed this stream's tokens on before


@dataclass(slots=True)
class Waiting:
    """The request's place in the queue."""

    starved: int = 0  # steps in a row this prefilling job got no tokens
    skipped: int = 0  # admissions that passed this waiting job over
    # Admission may make this job wait for ``waiting_for``, which prefills a prefix of
    # this prompt too and publishes a FULL checkpoint at ``wait_point``.
    waiting_for: Job | None = None
    wait_point: int = 0
    # A state to restore from disk or the shared store is read on the fetch thread
    # while other requests run (once per job); it waits in the queue meanwhile.
    fetching: bool = False
    fetched: bool = False
    prefetched: Lease | None = None

    def drop_prefetched(self) -> None:
        if self.prefetched is not None:
            self.prefetched.close()
            self.prefetched = None


@dataclass(slots=True)
class Drafting:
    """Speculative decoding (proxy/engine/speculation.py)."""

    on: bool = False  # drafts are verified for this request
    drafts: np.ndarray = field(default_factory=lambda: NONE)  # this step's drafts
    # tokens accepted by a verification that a lane without rollback (restored to its
    # staged state) decodes again in its next step, before ``pending``
    replay: np.ndarray = field(default_factory=lambda: NONE)
    staged: bytes | None = None  # the lane's partial state before this step's verification
    # what drafting has paid off on this lane (proxy/engine/draftlength.py): per source
    # (prompt lookup from a new match, the draft model, prompt lookup where its copy
    # holds), the drafts the target accepted and the rejections, both decaying
    accepted: list[float] = field(default_factory=lambda: [0.0] * 4)
    rejected: list[float] = field(default_factory=lambda: [0.0] * 4)
    source: int = 0  # of this step's drafts
    fresh: bool = True  # its record not yet primed from the model's
    # prompt lookup: where in the lane's tokens this step's drafts start (-1: elsewhere),
    # and where the copy they came from goes on (drafting.lookup)
    start: int = -1
    cursor: int = -1
    resting: bool = False  # drafting does not pay here now: a probe after ``rest`` tokens
    rest: int = 16  # (half the first rest: each rest is twice the last one, up to a cap)
    since: int = 0  # tokens decoded since this lane rests
    misses: int = 0  # steps in a row that found nothing to draft
    probing: bool = False  # this step's drafts are a probe
    # a resting lane's last lookup check (proxy/engine/draftlength.py _worth_now): at
    # which (tokens held, pending token), and whether it found drafts that pay
    watched: tuple[tuple[int, int], bool] = ((-1, -1), False)


@dataclass(slots=True)
class Job:
    """One request's progress through the engine."""

    req: GenerationRequest
    prompt: np.ndarray
    use_cache: bool
    t_submit: float
    lane: Lane | None = None
    pos: int = 0  # prompt tokens consumed so far
    reuse: int = 0
    estimate: str = ""  # why the plan read a state from where it did (the Started line)
    publish: list[tuple[int, Role, Kind]] = field(default_factory=list)
    # FULL checkpoints its prefill passes without stopping (a lane that can be cut back
    # anywhere): owed by the lane once passed (Lane.owed), sorted
    owed: list[tuple[int, Role, float]] = field(default_factory=list)
    # checkpoints inside a step of a window-sized SWA cache, saved after the step that
    # passes them from the saves before and after it (``Publisher.save_behind``), sorted
    behind: list[tuple[int, Role, Kind]] = field(default_factory=list)
    # the lane's SWA cache before the step that passed them (``Publisher.before_step``)
    before: memoryview | None = None
    # checkpoints at the prompt's end saved once its first token is written
    # (``Executor.publish_after_first``): nothing else waits for them
    after_first: list[tuple[Role, Kind]] = field(default_factory=list)
    # seconds a FULL checkpoint published at a position is kept above ordinary ones
    # (a client's cache breakpoint there)
    keep: dict[int, float] = field(default_factory=dict)
    finish_reason: str = ""
    error: BaseException | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    t_admitted: float = 0.0
    cancelled: bool = False
    stopping: bool = False  # the server is shutting down: end at the next step
    out: Output = field(default_factory=Output)
    wait: Waiting = field(default_factory=Waiting)
    spec: Drafting = field(default_factory=Drafting)

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.prompt)

    @property
    def prewarm(self) -> bool:
        return self.req.prewarm

    @property
    def history(self) -> int:
        """The prompt's tokens before its generation prompt (all of them where unknown)."""
        h = self.req.history_tokens
        return len(self.prompt) if h is None else min(h, len(self.prompt))

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def fail(self, exc: BaseException) -> None:
        """This request ends with ``exc``; the others go on."""
        self.error = exc
        self.finish_reason = "error"


@dataclass(slots=True, frozen=True)
class StepDrafts:
    """What one step drafted: tokens, by how many lanes; the tokens asked of the draft
    model and the seconds it took (its catch-up included)."""

    tokens: int = 0
    lanes: int = 0
    model_asked: int = 0
    model_s: float = 0.0


@dataclass(slots=True)
class Work:
    """One lane's share of a step: ``n`` tokens from ``pos0``. A decoding lane's work is
    its replayed tokens, ``pending`` and its drafts; logits from ``pending`` on."""

    job: Job
    n: int
    pos0: int
    row: int = -1  # batch row of the first token whose logits are kept (-1: none)
    room: int = 0  # drafts this work may carry (counted in ``n`` until they are known)

    def tokens(self) -> np.ndarray | list[int]:
        """The tokens this work decodes: a prompt chunk, or the replayed tokens,
        ``pending`` and the drafts."""
        job, spec = self.job, self.job.spec
        if job.prefilling:
            return job.prompt[self.pos0: self.pos0 + self.n]
        if not len(spec.replay) and not len(spec.drafts):
            return [job.out.pending]  # a plain decode: one token
        return np.concatenate([spec.replay, np.array([job.out.pending], dtype=np.int32),
                               spec.drafts])
