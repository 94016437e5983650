"""What goes into one engine step, measured step times to size it, and running the steps
(``Stepper``: plan a step, have the executor run it, write the streams, end what is done).

A step costs about ``a(d) + b * p`` (proxy/engine/timing.py measures both).

While streams decode, a long prompt prefills in bursts: one step carries as many of
its tokens as fit in ``pause_s`` (whole chunks of ``timing.CHUNK`` tokens once it is that
large), then the streams get steps of their own for as long as the burst took, times
``share / (1 - share)`` (a prompt whose rest fits in one burst does not wait). Small
slices in every step would cost more for both sides on a CPU: ``python -m bench.chunks``
measures a Gated DeltaNet hybrid (Qwen3.5's kind) at about a decode step per token for
slices under 64 tokens of a lane, and half that for whole chunks of 64; the outcome for
the streams is ``python -m bench.batching``'s.
"""

from __future__ import annotations

import logging
import time

from proxy.engine.accounting import Accounting
from proxy.engine.admission import Board, Entry
from proxy.engine.build import Parts
from proxy.engine.executor import Executor
from proxy.engine.job import Job, Work
from proxy.engine.outbox import Outbox
from proxy.engine.placement import Placement
from proxy.engine.streams import Streams
from proxy.engine.timing import StepTimer
from proxy.engine.tokens import Tokenizer

log = logging.getLogger("statecache")

MAX_STARVED = 2  # steps a prefill may get nothing (beyond what the streams are owed)
SHORT_PREFILL = 256  # prompt tokens left that count as close to the first token


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
                  key=lambda j: (j.wait.starved < MAX_STARVED, len(j.prompt) - j.pos))
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
                job.wait.starved += 1
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
        job.wait.starved += 1
        return 0
    job.wait.starved = 0
    works.append(w)
    return w.n


class Stepper:
    """Runs the steps: plans one (``plan_step``), has the executor run it, times it,
    writes the streams and ends the requests that are done. One stream decoding with
    nothing else to do runs steps of its own (``_decode_alone``)."""

    def __init__(self, parts: Parts, board: Board, executor: Executor, placement: Placement,
                 accounting: Accounting, tokenizer: Tokenizer, timer: StepTimer,
                 streams: Streams) -> None:
        self.p = parts
        self.board = board
        self.exec = executor
        self.placement = placement
        self.accounting = accounting
        self.tokenizer = tokenizer
        self.timer = timer
        self.streams = streams
        self.alone_s = parts.cfg.engine.lone_run_ms / 1000
        self.prefill_chunk = parts.chunk
        self._turn = 0  # cache.exact: whose step is next

    def run(self, active: list[Entry]) -> None:
        """One step of the active requests (or a lone stream's run of them)."""
        if self.p.pool is not None:  # checkpoints are written once no prompt is prefilling
            self.p.pool.hold_writes(any(job.prefilling and not job.done for job, _ in active))
        if len(active) == 1 and self._alone(active[0][0]):
            self._decode_alone(*active[0])
        elif active:
            self._step(active)

    def _step(self, active: list[Entry]) -> None:
        for job, _ in active:
            if job.cancelled and not job.done:
                job.finish_reason = "cancelled"
            elif job.stopping and not job.done and job.prefilling:
                job.finish_reason = "length"  # shutting down: nothing more to prefill
        ec = self.p.cfg.engine
        # drafts weigh against what the step yields without them (proxy/engine/draftlength.py)
        self.exec.speculation.lanes_decoding = max(
            sum(1 for job, _ in active if not job.done and not job.prefilling), 1)
        jobs = [job for job, _ in active if not job.done]
        if self.p.exact:
            works = self._exact_step(jobs)
        else:
            works = plan_step(jobs, self.exec, self.timer, step_tokens=self.p.step_tokens,
                              prefill_chunk=self.prefill_chunk,
                              pause_s=ec.prefill_pause_ms / 1000,
                              min_chunk=ec.min_prefill_chunk)
        n_decode = n_prefill = 0  # lanes that decode; prompt tokens this step prefills
        for w in works:
            if w.job.prefilling:
                n_prefill += w.n
            else:
                n_decode += 1
        if n_prefill:
            self.write(active, flush=True)  # a prefill makes the step long
        if works:
            made = sum(len(w.job.out.generated) for w in works if not w.job.prefilling)
            t0 = time.perf_counter()
            try:
                drafts = self.exec.run_step(works)
            except Exception as exc:
                log.exception("llama_decode failed; failing the %d lanes of this step",
                              len(works))
                for w in works:
                    w.job.fail(exc)
            else:
                dt = self.timer.took(time.perf_counter() - t0, n_decode, n_prefill,
                                     drafts=drafts)
                yielded = sum(len(w.job.out.generated) for w in works
                              if not w.job.prefilling) - made
                self.timer.record(dt, n_decode, n_prefill, drafts=drafts, yielded=yielded)
                if self.p.pool is not None and not n_decode:  # the planner's prefill rate
                    self.p.pool.costs.note_prefill(n_prefill, dt)
                m = self.p.meter
                m.steps.inc()
                m.step_tokens.inc(by=sum(w.n for w in works))  # with the drafts it carried
                m.step_lane_work.inc(by=len(works))
                if len(works) > 1:
                    m.steps_multi_lane.inc()
        self._after_step(active)

    def _exact_step(self, jobs: list[Job]) -> list[Work]:
        """cache.exact: one lane a step, in turn: a decoding lane's token, or a prefilling
        lane's ubatch of the grid, as a cold server alone computes them (a row batched
        with another lane's is other arithmetic: tests/model/test_exact_batches.py)."""
        for i in range(len(jobs)):
            job = jobs[(self._turn + i) % len(jobs)]
            w = self.exec.work_for(job, self.p.step_tokens)
            if w is not None:
                self._turn += i + 1
                return [w]
        return []

    def _alone(self, job: Job) -> bool:
        """Whether ``job``, the only active one, may run steps of its own: it decodes a
        token a step, and nobody waits."""
        return self.alone_s > 0 and not (self.board.waiting or job.cancelled) and \
            self.exec.decodes_alone(job)

    def _decode_alone(self, job: Job, box: Outbox) -> None:
        """One stream and nothing else to do, the most common case: its steps without
        planning each one (``Executor.decode_alone``) until a request arrives, the stream
        ends, is cancelled or the server stops, or ``engine.lone_run_ms`` have passed
        (the loop's own work between steps, as an idle lane's save, then gets its turn)."""
        pair = [(job, box)]
        write, board = self.streams.write, self.board
        t0 = time.perf_counter()
        until = t0 + self.alone_s

        def more() -> bool:
            write(pair)
            return not (board.waiting or job.cancelled or job.stopping) and \
                time.perf_counter() < until

        try:
            steps = self.exec.decode_alone(job, more)
        except Exception as exc:
            log.exception("a lone run of request %s failed", job.req.request_id)
            job.fail(exc)
        else:
            dt = self.timer.took(time.perf_counter() - t0, 1, 0, steps=steps)
            self.timer.record(dt, 1, 0, steps=steps, alone=True)
            m = self.p.meter
            for counter in (m.steps, m.step_tokens, m.step_lane_work, m.steps_alone):
                counter.inc(by=steps)
        self._after_step(pair)

    def _after_step(self, active: list[Entry]) -> None:
        # every stream's tokens first, with one wake-up of the loop for all of them;
        # a request that ends here saves its state next: nothing waits through that
        ended = any(job.done for job, _ in active)
        self.write(active, flush=ended)
        for job, _ in active:
            if job.after_first or (job.behind and not job.prefilling):
                self.exec.publish_after_first(job)  # its first token is written
        for job, box in active:
            if job.done:
                self._end(job, box)
        if ended:  # the lanes that decode together stay one run of ids (placement.py)
            pass_s = min((s for s in self.timer.decode_s.values() if s > 0), default=0.0)
            self.placement.close_gap([job for job, _ in active if not job.done],
                                              pass_s)

    def write(self, active: list[Entry] | None = None, *, flush: bool = False) -> None:
        if active is None:
            with self.board.cv:
                active = list(self.board.active)
        self.streams.write(active, flush=flush)

    def _end(self, job: Job, box: Outbox) -> None:
        try:
            self.exec.finish(job)
        except Exception:
            log.exception("finishing request %s failed", job.req.request_id)
        with self.board.cv:
            self.board.active.remove((job, box))
        if job.finish_reason in ("stop", "length"):
            self.tokenizer.remember_reply(job.req.tenant, job.out.generated)
            self.exec.speculation.remember(job)
        self.accounting.finish(job, box)
