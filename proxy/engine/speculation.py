"""Speculative decoding inside the batched step: drafts for each decoding lane (a draft
model's or prompt lookup's, proxy/engine/drafting.py; how many, by expected gain:
proxy/engine/draftlength.py), verified by the same ``llama_decode``, and rejected
drafts taken back out of the lane's state.

Nothing rejected is ever committed: a lane's tokens grow only by the tokens the target
sampled. How a rejection leaves the lane depends on its memory (chosen once in
proxy/engine/build.py): ``seq_rm`` where the memory cuts its tail back (attention, SWA
kept whole, a hybrid's n_rs_seq snapshots of the step's ubatch), else the lane's
partial state staged before the step is restored, then the attention cells cut
(docs/design.md fact 7), and the accepted tokens are decoded again next step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from proxy.engine.binding import FLAGS_PARTIAL
from proxy.engine.build import Parts
from proxy.engine.drafting import DraftAsk, History, lookup
from proxy.engine.draftlength import COPY, DRAFT, LONG, LOOKUP, DraftLength
from proxy.engine.job import NONE, Job, Work
from proxy.engine.planner import window_reaches
from proxy.engine.timing import StepTimer


class Speculation:
    def __init__(self, parts: Parts, timer: StepTimer) -> None:
        self.p = parts
        self.timer = timer
        sc = parts.cfg.speculative
        # prompt lookup drafts cost nothing to make, so they may run longer than a draft
        # model's, except where the lane's n_rs_seq snapshots hold draft_max + 1 tokens
        self.lookup_max = sc.draft_max if parts.rs_snapshots else \
            max(sc.draft_max, sc.lookup_draft_max)
        self.history = History(sc.history_sessions, sc.history_tokens)
        self.lookup_on = sc.source in ("lookup", "auto")  # "draft": the draft model only
        self.policy = DraftLength(parts, timer, self.lookup, lookup_on=self.lookup_on,
                                  lookup_max=self.lookup_max)
        self.model_s, self.model_asked = 0.0, 0  # the draft model's, this step

    @property
    def lanes_decoding(self) -> int:
        """Decoding lanes in the step being planned (plan_step sets it)."""
        return self.policy.lanes_decoding

    @lanes_decoding.setter
    def lanes_decoding(self, n: int) -> None:
        self.policy.lanes_decoding = n

    @property
    def accepted(self) -> list[float]:
        """Every lane's record of drafts accepted, by source (the policy's)."""
        return self.policy.accepted

    @property
    def rejected(self) -> list[float]:
        return self.policy.rejected

    def room(self, job: Job, n: int, budget: int) -> int:
        """Drafts a decoding job may carry this step (``propose`` decides how many it
        does): none while it rests, else within the longest a source drafts, the step's
        budget, the lane's context and the tokens the request may still produce."""
        assert job.lane is not None
        if not self.wants_step(job):
            return 0
        left = job.req.sampling.max_tokens - len(job.out.generated) - 1
        ctx_left = self.p.ctx.n_ctx_seq - job.lane.n - n
        top = max(self.lookup_max if self.lookup_on else 0,
                  self.p.cfg.speculative.draft_max if self.p.draft is not None else 0)
        return max(0, min(top, budget - n, left, ctx_left))

    def wants_step(self, job: Job) -> bool:
        """Whether ``job`` drafts at its next step (``DraftLength.wants_step``)."""
        return self.policy.wants_step(job)

    def quiet_probe(self, job: Job) -> bool:
        """A lone lane's due probe, checked in its fast path (``DraftLength.quiet_probe``)."""
        return self.policy.quiet_probe(job)

    def decoded(self, job: Job, n: int = 1) -> None:
        """``n`` tokens decoded without drafts on ``job``'s lane."""
        self.policy.decoded(job, n)

    def remember(self, job: Job) -> None:
        """A request's reply, for later requests of its conversation to draft from, and
        where its lane rested, for the next request to go on resting from
        (``_rests_from_start``)."""
        spec = job.spec
        if spec.on:
            self.history.add(job.req.tenant, job.req.session, job.out.generated)
            self.policy.ended(spec)

    def propose(self, works: list[Work]) -> None:
        """Fill in each decoding lane's drafts (and keep a draft model's lanes in step)."""
        p = self.p
        asks: list[DraftAsk] = []
        self.model_s, self.model_asked = 0.0, 0
        for w in works:
            job, lane = w.job, w.job.lane
            assert lane is not None
            job.spec.drafts = NONE
            if not job.spec.on or (not job.prefilling and not w.room):
                continue
            # what the lane holds once this step's tokens (drafts aside) are in: a prompt
            # chunk, or the replayed tokens and ``pending``
            step = w.tokens()
            known = np.concatenate([lane.tokens, step])
            if job.prefilling:
                if p.draft is not None:  # the draft model follows the prompt
                    asks.append(DraftAsk(lane.id, known, 0, lane.tenant, step=len(step)))
                continue
            want = self.policy.choose(w, known)
            if want:
                asks.append(DraftAsk(lane.id, known, want, lane.tenant, step=len(step)))
                self.model_asked += want
        if asks:
            assert p.draft is not None
            t0 = time.perf_counter()
            drafted = p.draft.propose(asks)
            self.model_s = self.timer.took_model(time.perf_counter() - t0,
                                                 p.draft.followed + self.model_asked)
            if p.draft.followed > sum(a.step for a in asks):
                self.model_asked = 0  # a lane caught up from far behind: not a sample
                self.timer.followed(self.model_s, p.draft.followed)  # ...but of this
            else:  # drafts or none: what asking the model costs a token
                self.timer.asked(self.model_s, self.model_asked)
            for w in works:
                lane, spec = w.job.lane, w.job.spec
                assert lane is not None
                if not w.job.prefilling and w.room and spec.source == DRAFT:
                    spec.drafts = drafted.get(lane.id, NONE)[: w.room]
                    self.policy.answered(spec)
        for w in works:
            if not w.job.prefilling:
                w.n = len(w.job.spec.replay) + 1 + len(w.job.spec.drafts)

    def lookup(self, job: Job, known: np.ndarray, k: int) -> tuple[np.ndarray, int, int]:
        """Prompt lookup's drafts for ``job`` whose lane will hold ``known``, where they
        start (``drafting.lookup``), and their source: ``COPY`` where the copy the last
        drafts came from holds, ``LONG`` from a new match longer than ``lookup_min``
        tokens, else ``LOOKUP``."""
        sc = self.p.cfg.speculative
        t0 = time.perf_counter()
        found, start, matched = lookup(known, k, sc.lookup_max, sc.lookup_min,
                                       self.history.get(job.req.tenant, job.req.session),
                                       job.spec.cursor)
        self.timer.looked(self.timer.took_lookup(time.perf_counter() - t0))
        if 0 <= job.spec.cursor == start:
            return found, start, COPY
        return found, start, LONG if matched > sc.lookup_min else LOOKUP

    def stage(self, job: Job, one_ubatch: bool) -> None:
        """Before a verification of a lane without rollback: its partial state, to undo
        what is rejected. A window-sized SWA cache needs none when the step is one
        ubatch: a decode overwrites only cells masked for the ubatch's first position,
        which no token after it sees, so seq_rm undoes the drafts (docs/design.md fact
        25)."""
        assert job.lane is not None
        if len(job.spec.drafts) and self.p.staging and not (
                one_ubatch and self.p.memory.swa_window):
            job.spec.staged = bytes(self.p.ctx.save(job.lane.id, FLAGS_PARTIAL))

    def verify(self, w: Work, take: Callable[[Job, int], None]) -> None:
        """Commit a decoding lane's step: its replayed tokens and ``pending``, then each
        draft while the token sampled before it equals it; roll back the rest.
        ``take`` samples the token after a row of logits."""
        job, lane, spec = w.job, w.job.lane, w.job.spec
        assert lane is not None
        drafts = spec.drafts
        if len(spec.replay):
            lane.extend(spec.replay)
            spec.replay = NONE
        lane.push(job.out.pending)
        take(job, w.row)
        if not len(drafts):
            self.decoded(job)
            return
        accepted = 0
        for i, d in enumerate(drafts.tolist()):
            if job.done or job.out.pending != d:
                break
            lane.push(d)
            accepted += 1
            take(job, w.row + 1 + i)
        spec.drafts = NONE
        self.policy.verified(spec, spec.source, accepted, len(drafts))
        job.stats.drafted += len(drafts)
        job.stats.accepted += accepted
        m = self.p.meter
        m.spec_tokens.inc("drafted", by=len(drafts))
        m.spec_tokens.inc("accepted", by=accepted)
        m.spec_verifications.inc()
        if accepted == len(drafts):
            spec.staged = None
            return
        self._reject(job, w.pos0)

    def _reject(self, job: Job, pos0: int) -> None:
        """Remove the rejected drafts from the lane's state (it holds ``lane.n`` accepted
        tokens; the step decoded more from ``pos0``)."""
        ctx, lane, spec = self.p.ctx, job.lane, job.spec
        assert lane is not None
        if not self.p.staging:
            # attention, full-size SWA (every cell kept), hybrid with n_rs_seq snapshots of
            # this step's ubatch (docs/design.md fact 11: llama.cpp keeps a lane's last
            # n_rs_seq + 1 tokens in one ubatch, and the rollback keeps its first token,
            # ``pending``)
            if not ctx.seq_rm(lane.id, lane.n, -1):
                raise RuntimeError(f"lane {lane.id}: seq_rm refused to remove rejected drafts")
            return
        staged, spec.staged = spec.staged, None
        if self.p.memory.swa_window and window_reaches(self.p.memory, lane, lane.n,
                                                       ctx.pos_min):
            # the window-sized SWA cache still reaches a window back from lane.n: cut the
            # drafts alone, nothing to decode again
            if not ctx.seq_rm(lane.id, lane.n, -1):
                raise RuntimeError(f"lane {lane.id}: seq_rm refused to remove rejected drafts")
            return
        if staged is None:
            raise RuntimeError(f"lane {lane.id}: the window rule refuses to cut the drafts "
                               "and no partial state was staged")
        kept = lane.tokens[pos0:].copy()
        # docs/design.md fact 7: restore the partial state first, then cut the attention
        # cells
        if not (ctx.restore(lane.id, staged, FLAGS_PARTIAL) and ctx.seq_rm(lane.id, pos0, -1)):
            raise RuntimeError(f"lane {lane.id}: restoring the staged state failed")
        lane.truncate(pos0)
        self.p.meter.spec_replays.inc()
        spec.replay = kept  # decoded again in the next step (or at the end), without logits
