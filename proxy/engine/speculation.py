"""Speculative decoding inside the batched step: drafts for each decoding lane (a draft
model's or prompt lookup's, proxy/engine/drafting.py), verified by the same
``llama_decode``, and rejected drafts taken back out of the lane's state.

Nothing rejected is ever committed: a lane's tokens grow only by the tokens the target
sampled. How a rejection leaves the lane depends on its memory (chosen once in
proxy/engine/build.py): ``seq_rm`` where the memory cuts its tail back (attention, SWA
kept whole, a hybrid's n_rs_seq snapshots of the step's ubatch), else the lane's
partial state staged before the step is restored, then the attention cells cut
(docs/design.md fact 7), and the accepted tokens are decoded again next step.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from proxy.engine.binding import FLAGS_PARTIAL
from proxy.engine.build import Parts
from proxy.engine.drafting import DraftAsk, lookup_draft
from proxy.engine.job import NONE, Job, Work


class Speculation:
    def __init__(self, parts: Parts) -> None:
        self.p = parts

    def room(self, job: Job, n: int, budget: int) -> int:
        """Drafts a decoding job may carry: the configured length, within the step's
        budget, the lane's context and the tokens the request may still produce."""
        assert job.lane is not None
        left = job.req.sampling.max_tokens - len(job.out.generated) - 1
        ctx_left = self.p.ctx.n_ctx_seq - job.lane.n - n
        return max(0, min(self.p.cfg.speculative.draft_max, budget - n, left, ctx_left))

    def propose(self, works: list[Work]) -> None:
        """Fill in each decoding lane's drafts (and keep a draft model's lanes in step)."""
        p = self.p
        sc = p.cfg.speculative
        asks: list[DraftAsk] = []
        for w in works:
            job, lane = w.job, w.job.lane
            assert lane is not None
            job.spec.drafts = NONE
            if not job.spec.on:
                continue
            # what the lane holds once this step's tokens (drafts aside) are in: a prompt
            # chunk, or the replayed tokens and ``pending``
            step = w.tokens()
            known = np.concatenate([lane.tokens, step])
            want = 0 if job.prefilling else w.room  # while prefilling the draft follows
            if p.draft is not None:
                asks.append(DraftAsk(lane.id, known, want, lane.tenant, step=len(step)))
            elif want:
                job.spec.drafts = lookup_draft(known, want, sc.lookup_max, sc.lookup_min)
        if asks:
            assert p.draft is not None
            drafted = p.draft.propose(asks)
            for w in works:
                lane = w.job.lane
                assert lane is not None
                if not w.job.prefilling and lane.id in drafted:
                    w.job.spec.drafts = drafted[lane.id][: w.room]
        for w in works:
            if not w.job.prefilling:
                w.n = len(w.job.spec.replay) + 1 + len(w.job.spec.drafts)

    def stage(self, job: Job) -> None:
        """Before a verification of a lane without rollback: its partial state, to undo
        what is rejected."""
        assert job.lane is not None
        if len(job.spec.drafts) and self.p.staging:
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
            return
        accepted = 0
        for i, d in enumerate(drafts.tolist()):
            if job.done or job.out.pending != d:
                break
            lane.push(d)
            accepted += 1
            take(job, w.row + 1 + i)
        spec.drafts = NONE
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
            # attention, SWA (every cell kept), hybrid with n_rs_seq snapshots of this
            # step's ubatch (docs/design.md fact 11: llama.cpp keeps a lane's last
            # n_rs_seq + 1 tokens in one ubatch, and the rollback keeps its first token,
            # ``pending``)
            if not ctx.seq_rm(lane.id, lane.n, -1):
                raise RuntimeError(f"lane {lane.id}: seq_rm refused to remove rejected drafts")
            return
        staged, spec.staged = spec.staged, None
        assert staged is not None
        kept = lane.tokens[pos0:].copy()
        # docs/design.md fact 7: restore the partial state first, then cut the attention
        # cells
        if not (ctx.restore(lane.id, staged, FLAGS_PARTIAL) and ctx.seq_rm(lane.id, pos0, -1)):
            raise RuntimeError(f"lane {lane.id}: restoring the staged state failed")
        lane.truncate(pos0)
        self.p.meter.spec_replays.inc()
        spec.replay = kept  # decoded again in the next step (or at the end), without logits
