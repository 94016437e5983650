"""One batched step on the llama context, and the end of a request's lane.

Runs on the engine thread only; nothing here is thread-safe. A step is one
``llama_decode`` for every lane with work: each lane's share is a ``Work`` (these
tokens at these positions, logits for the last row): one token for a decoding lane
(with its drafts, proxy/engine/speculation.py), a chunk for a prefilling one, which
ends where a checkpoint is published (proxy/engine/publishing.py). After the step each
lane is committed on its own, so a lane whose sampling fails ends alone and the others
go on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from proxy.engine.build import Parts
from proxy.engine.emit import Emitter
from proxy.engine.job import NONE, Job, StepDrafts, Work
from proxy.engine.lanes import Lane, LaneSet
from proxy.engine.layout import first_step
from proxy.engine.publishing import Publisher
from proxy.engine.speculation import Speculation
from proxy.engine.types import BATCHED, DRAFTED, OFF_GRID, STEP_LOG_MAX
from statecache.records import Kind, Role

log = logging.getLogger(__name__)


class Executor:
    def __init__(self, parts: Parts, publisher: Publisher, speculation: Speculation,
                 emitter: Emitter) -> None:
        self.p = parts
        self.publisher = publisher
        self.speculation = speculation
        self.emitter = emitter
        self._alone = True  # the step being committed carried one lane

    @property
    def lanes(self) -> LaneSet:
        return self.p.lanes

    @property
    def page(self) -> int:
        return self.p.page

    def work_for(self, job: Job, budget: int) -> Work | None:
        """The job's share of the next step, at most ``budget`` tokens."""
        lane = job.lane
        assert lane is not None
        if not job.prefilling:
            assert job.out.pending >= 0
            n = len(job.spec.replay) + 1
            room = self.speculation.room(job, n, budget) if job.spec.on else 0
            return Work(job, n + room, lane.n, room=room)
        if self.p.exact:  # the rest of the grid's ubatch, whole or not at all
            end = min((job.pos // self.p.grid + 1) * self.p.grid, len(job.prompt))
            return Work(job, end - job.pos, job.pos) if end - job.pos <= budget else None
        stop = len(job.prompt)
        if job.publish and job.publish[0][0] < stop:
            stop = job.publish[0][0]  # a chunk ends where a checkpoint is published
        n = min(budget, first_step(job.pos, stop, self.p.chunk, last=stop == len(job.prompt)))
        if n <= 0:
            return None
        return Work(job, n, job.pos)

    def run_step(self, works: list[Work]) -> StepDrafts:
        """One llama_decode for every work; then commit each lane on its own. Returns what
        the step drafted.

        A failed decode raises (the caller fails those lanes); a lane whose commit
        fails gets ``job.error`` and the others go on.
        """
        spec = self.speculation
        if self.p.speculation != "off":
            spec.propose(works)
        drafted = [len(w.job.spec.drafts) for w in works if not w.job.prefilling]
        out = StepDrafts(sum(drafted), sum(1 for d in drafted if d), spec.model_asked,
                         spec.model_s) if any(drafted) or spec.model_asked else StepDrafts()
        batch = self.p.ctx.batch
        batch.clear()
        # llama.cpp splits a batch of separate lanes into ubatches of consecutive lane
        # ids (kv_unified off): in lane order, one ubatch takes every decoding lane.
        works.sort(key=lambda w: w.job.lane.id if w.job.lane is not None else -1)
        one_ubatch = sum(w.n for w in works) <= self.p.params.n_ubatch
        for w in works:
            job, lane = w.job, w.job.lane
            assert lane is not None
            toks = w.tokens()
            if job.prefilling:
                if job.behind and job.behind[0][0] < w.pos0 + w.n:  # saved behind it
                    t0 = time.perf_counter()
                    job.before = self.publisher.before_step(lane, job.behind[0][0])
                    job.stats.publish_s += time.perf_counter() - t0
                # the prompt's last row: its logits give the first token, and they are
                # kept with the lane (and with a checkpoint saved there); a pre-warm's too
                last = w.pos0 + w.n == len(job.prompt)
                row = batch.add(lane.id, toks, w.pos0, logits_last=last)
                w.row = row if last else -1
            else:
                self.speculation.stage(job, one_ubatch)
                first = len(job.spec.replay)
                row = batch.add(lane.id, toks, w.pos0, logits_last=True, logits_from=first)
                w.row = row - (len(toks) - 1 - first)
        t0 = time.perf_counter()
        self.p.ctx.decode()
        dt = time.perf_counter() - t0
        for w in works:  # what the requests before their first token waited in llama_decode
            if not w.job.out.t_first:
                st = w.job.stats
                st.decode_s += dt
                if w.job.prefilling and len(st.step_log) < STEP_LOG_MAX:
                    st.step_log.append((w.pos0, w.n, dt))
        alone = self._alone = len(works) == 1
        for w in works:
            if not alone:
                w.job.stats.not_exact(BATCHED)
            try:
                self._commit(w)
            except Exception as exc:  # this lane alone
                log.exception("request %s failed", w.job.req.request_id)
                w.job.fail(exc)
        return out

    def decodes_alone(self, job: Job) -> bool:
        """Whether a step of ``job`` alone is one token and its logits: a decoding lane
        that drafts nothing (it does not draft, or rests) and has nothing to replay
        (``decode_alone`` may run it)."""
        return not (job.prefilling or job.done or len(job.spec.replay)
                    or self.speculation.wants_step(job))

    def decode_alone(self, job: Job, more: Callable[[], bool]) -> int:
        """Decode ``job``'s lane by itself, a token per ``llama_decode``, while the job
        goes on and ``more()`` says so; returns the steps run (at least one).

        The common case of the engine (one stream, nothing else to do) without planning
        a step each time: what a step of ``run_step`` would do for this one ``Work``, so
        the tokens are the same. A failed decode raises; a failed commit sets
        ``job.error`` as in ``run_step``."""
        lane, out = job.lane, job.out
        assert lane is not None and self.decodes_alone(job)
        ctx, spec = self.p.ctx, self.speculation
        batch, decode, take, push = ctx.batch, ctx.decode, self.emitter.take, lane.push
        drafting = job.spec.on  # it rests: it counts the tokens to its next probe
        steps = 0
        while True:
            batch.clear()
            batch.add(lane.id, (out.pending,), lane.n, logits_last=True)
            decode()
            steps += 1
            try:
                push(out.pending)
                take(job, 0)
            except Exception as exc:  # as run_step's commit
                log.exception("request %s failed", job.req.request_id)
                job.fail(exc)
            if drafting:
                spec.decoded(job)
                if spec.wants_step(job) and not spec.quiet_probe(job):
                    return steps  # a probe that may draft is due
            if job.finish_reason or not more():
                return steps

    def _commit(self, w: Work) -> None:
        job, lane = w.job, w.job.lane
        assert lane is not None
        if job.prefilling:
            self._grid(w, lane)
            lane.extend(job.prompt[w.pos0: w.pos0 + w.n])
            job.stats.prefilled += w.n
            job.stats.prefill_steps += 1
            job.pos += w.n
            if w.pos0 == job.reuse:  # its first step: what the lane owed from before
                self.publisher.forget_unreachable(lane)
            while job.owed and job.owed[0][0] <= job.pos:  # passed: the lane owes them
                lane.owed.append(job.owed.pop(0))
            if not job.prefilling:  # 1 MiB at Gemma 3's vocabulary: a copy is cheap
                lane.keep_logits(self.p.ctx.logits_view(w.row).copy())
            if job.behind and job.behind[0][0] < job.pos and (job.prefilling or job.prewarm):
                t0 = time.perf_counter()  # (those in the last step: after the first token)
                self.publisher.save_behind(job)
                job.stats.publish_s += time.perf_counter() - t0
            if job.publish and job.publish[0][0] == job.pos:
                t0 = time.perf_counter()
                while job.publish and job.publish[0][0] == job.pos:
                    _, role, kind = job.publish.pop(0)
                    if kind is Kind.PARTIAL and not job.prefilling and not job.prewarm:
                        job.after_first.append((role, kind))
                    else:
                        self.publisher.publish(job, role, kind)
                job.stats.publish_s += time.perf_counter() - t0
            if job.prefilling:
                return
            self.emitter.first(job, w.row)
            return
        self.speculation.verify(w, self.emitter.take)

    def publish_after_first(self, job: Job) -> None:
        """The lane's PARTIAL checkpoint at the prompt's end, saved once the first token
        is written to the client (``Stepper._after_step``): the lane still stands there
        (that token is decoded at the next step), and a lane's own PARTIAL state is for
        its next turn, not for a request waiting now. So the save is not in the TTFT: a
        follow-up's one step is all of it (docs/cache.md)."""
        todo, job.after_first = job.after_first, []
        if job.lane is None or job.lane.n != len(job.prompt) or job.error is not None \
                or job.finish_reason in ("error", "cancelled"):
            job.behind, job.before = [], None
            return
        if job.behind:  # a share point in the last step, saved behind it
            self.publisher.save_behind(job)
        for role, kind in todo:
            self.publisher.publish(job, role, kind)

    def _grid(self, w: Work, lane: Lane) -> None:
        """Whether this prefill chunk writes the state a cold prefill writes: the lane's
        state so far was (``Lane.grid_n``), and the chunk starts on the grid of n_ubatch
        and ends on it or at the prompt's end; ``run_step`` said whether it ran alone."""
        end, grid = w.pos0 + w.n, self.p.grid
        if lane.grid_n == w.pos0 and w.pos0 % grid == 0 and \
                (end % grid == 0 or end == len(w.job.prompt)) and self._alone:
            lane.grid_n = end
        elif lane.grid_n == w.pos0 and self._alone:  # else its start or step said why
            w.job.stats.not_exact(OFF_GRID)

    def finish(self, job: Job) -> None:
        """Publish the end-of-reply state and free the lane.

        Nothing is published from a request that failed: its lane is cleared.
        """
        lane, spec, publisher = job.lane, job.spec, self.publisher
        if lane is None:
            return
        if job.stats.drafted:
            job.stats.not_exact(DRAFTED)
        try:
            if len(spec.replay) and job.finish_reason in ("stop", "length"):
                # accepted tokens a rollback took out of the state: back in, so the
                # reply's end is where the next turn starts
                self.p.ctx.prefill(lane.id, spec.replay, lane.n, logits_last=False)
                lane.extend(spec.replay)
                spec.replay = NONE
            if job.finish_reason == "error":
                publisher.clear(lane)
            elif (job.use_cache and lane.n > job.reuse and job.finish_reason != "cancelled"
                    and publisher.kind() is Kind.PARTIAL and not self.p.exact):
                publisher.publish(job, Role.END_OF_REPLY, Kind.PARTIAL)
            elif not job.use_cache:
                # a cold-only request leaves nothing reusable behind
                publisher.clear(lane)
        finally:
            if lane.n:  # this request's own turn starts there
                lane.history_n = min(job.history, lane.n)
            lane.busy = False
            lane.last_used = self.p.clock()
