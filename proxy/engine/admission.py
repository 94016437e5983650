"""Who starts next: the queue of requests waiting for a lane, the order they start in,
waiting for another request's checkpoint of a prefix they share, and reading a state
from disk or the shared store on a thread of its own while the streams decode.

- Admission follows lane availability, not strict arrival order: a waiting request
  whose conversation a free lane holds goes before others, and a request passed over
  twice goes next.
- A request that shares a prefix with one being prefilled waits for that one's FULL
  checkpoint there instead of prefilling it side by side (and starts at once from it if
  that one's lane is exactly there).
- A pre-warm runs only in a lane that holds no live conversation, and a request that
  generates takes the queue slot of a waiting pre-warm rather than being refused.
- A request is planned once, with reads from disk or the store deferred while others
  run, and outside the lock that the event loop takes (``generate``, ``metrics``):
  planning, reading and saving never hold the HTTP side up.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass, field

from proxy.engine.accounting import Accounting
from proxy.engine.build import Parts
from proxy.engine.job import Job
from proxy.engine.lanes import Lane
from proxy.engine.outbox import Outbox
from proxy.engine.planner import Plan
from proxy.engine.publishing import Publisher
from proxy.engine.restore import Restorer
from proxy.engine.types import QueueFull, StartEvent
from statecache.pages import common_prefix
from statecache.pool import Offer

log = logging.getLogger("statecache")

MAX_SKIPS = 2  # admissions that may pass a waiting request over
Entry = tuple[Job, Outbox]


@dataclass(eq=False)
class Board:
    """The requests the engine holds, behind one condition: those waiting for a lane and
    those running. The event loop takes ``cv`` to queue a request and to read counts;
    only the engine thread changes ``active`` and the jobs themselves."""

    cv: threading.Condition = field(default_factory=threading.Condition)
    waiting: collections.deque[Entry] = field(default_factory=collections.deque)
    active: list[Entry] = field(default_factory=list)
    stopping: bool = False


class Admission:
    def __init__(self, parts: Parts, board: Board, restorer: Restorer, publisher: Publisher,
                 accounting: Accounting) -> None:
        self.p = parts
        self.board = board
        self.restorer = restorer
        self.publisher = publisher
        self.accounting = accounting
        # reads from disk or the shared store for a waiting request, off the engine thread
        self._fetcher = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="statecache-fetch")

    def close(self) -> None:
        self._fetcher.shutdown(wait=True)  # no read of the pool outlives it

    # -- the queue (with the lock held) ----------------------------------------------

    def ready(self) -> bool:
        return any(self._may_start(job) for job, _ in self.board.waiting)

    def _may_start(self, job: Job) -> bool:
        w = job.wait
        if w.fetching:
            return False
        if job.req.prewarm and not self.restorer.vacant_lanes(job):
            return False  # a pre-warm never takes a lane that holds a live conversation
        k = w.waiting_for
        if k is None:
            return True
        if k.done or k.cancelled or k.pos >= w.wait_point:
            w.waiting_for = None
            return True
        return False

    def drop_a_prewarm(self) -> bool:
        """Make room in a full queue for a request that generates: the newest waiting
        pre-warm is dropped (503). False when none waits."""
        for job, box in reversed(self.board.waiting):
            if job.req.prewarm and not job.wait.fetching:
                self.board.waiting.remove((job, box))
                job.wait.drop_prefetched()
                box.put(QueueFull(retry_after=5.0))
                self.p.meter.prewarms_dropped.inc()
                return True
        return False

    def drop_cancelled(self) -> None:
        b = self.board
        if any(job.cancelled for job, _ in b.waiting):
            for job, _ in [w for w in b.waiting if w[0].cancelled]:
                job.wait.drop_prefetched()
                self.p.meter.cancelled_queued.inc()
                log.info("request %s left while queued", job.req.request_id)
            b.waiting = collections.deque(w for w in b.waiting if not w[0].cancelled)

    def choose(self) -> list[Entry]:
        """Which waiting requests start now."""
        b = self.board
        if b.stopping or not b.waiting:
            return []
        free = self.p.lanes.free()
        out: list[Entry] = []
        while free and b.waiting:
            ready = [w for w in b.waiting if self._may_start(w[0])]
            if not ready:
                break
            pick = self._pick(ready, free)
            job = pick[0]
            for other, _ in ready:
                if other is not job and other.t_submit < job.t_submit:
                    other.wait.skipped += 1
            b.waiting.remove(pick)
            out.append(pick)
            free.pop()  # which lane it takes is the planner's choice
        return out

    def _pick(self, ready: list[Entry], free: list[Lane]) -> Entry:
        oldest = ready[0]
        if oldest[0].wait.skipped >= MAX_SKIPS:
            return oldest

        def held(w: Entry) -> int:  # prompt tokens a free lane holds
            job = w[0]
            return max((ln.common(job.prompt, job.req.tenant) for ln in free), default=0)

        best = max(ready, key=held)
        return best if held(best) >= self.p.page else oldest

    # -- starting (engine thread, without the lock) ----------------------------------

    def admit(self, job: Job, box: Outbox) -> None:
        """Start ``job`` in a lane, or put it back in the queue: to wait for a shared
        prefix, for its state to be read, or (a pre-warm) for a vacant lane."""
        if job.cancelled:
            job.wait.drop_prefetched()
            return
        if job.req.prewarm and not self.restorer.vacant_lanes(job):
            self._requeue(job, box)  # its lane went to another request of this round
            return
        held, job.wait.prefetched = job.wait.prefetched, None
        # while others run, a read from disk or the store goes to the fetch thread
        defer = not job.wait.fetched and any(not k.done for k, _ in self.board.active)
        plan: Plan | Offer | None = None
        started = False
        try:
            job.stats.queue_s = time.perf_counter() - job.t_submit
            plan = self.restorer.plan(job, held=held, defer_reads=defer)
            reuse = plan.n if isinstance(plan, Offer) else plan.reuse
            if self._should_wait(job, reuse):
                if isinstance(plan, Plan):
                    if plan.full is not None and plan.full is held:  # keep what was read
                        job.wait.prefetched, plan.full = held, None
                    plan.release()
                self._requeue(job, box)
                return
            if isinstance(plan, Offer):
                self._fetch(job, box, plan)
                return
            started = True  # start releases the plan, however it ends
            self.restorer.start(job, plan)
        except Exception as exc:
            log.exception("request %s could not start", job.req.request_id)
            if isinstance(plan, Plan) and not started:
                plan.release()
            if job.lane is not None:
                try:
                    self.publisher.clear(job.lane)
                finally:
                    job.lane.busy = False
            box.put(exc)
            return
        with self.board.cv:
            self.board.active.append((job, box))
        box.put(StartEvent(len(job.prompt), job.reuse))  # before the prefill
        self.accounting.started(job)

    def _requeue(self, job: Job, box: Outbox) -> None:
        with self.board.cv:
            self.board.waiting.appendleft((job, box))

    def _should_wait(self, job: Job, reuse: int) -> bool:
        """Whether ``job``, which could start from ``reuse`` tokens now, waits for an
        active request that is prefilling a prefix they share further: that one
        publishes a FULL checkpoint where they meet, and ``job`` starts there."""
        if not job.use_cache or self.p.pool is None:
            return False
        exact = self.p.exact  # its points are the grid's and the prompt's end (points.py)
        page = self.p.grid if exact else self.p.page
        best: tuple[Job, int] | None = None
        for k, _ in self.board.active:
            if k.done or not k.use_cache or k.req.tenant != job.req.tenant:
                continue
            shared = common_prefix(k.prompt, job.prompt)
            at = (min(shared, len(k.prompt) - 1) // page) * page
            if at >= 2 * page and at >= k.pos and (best is None or at > best[1]):
                best = (k, at)
        if best is None:
            return False
        k, at = best
        if reuse + page > at:
            return False
        if k.pos == at:  # its lane holds exactly the shared prefix now
            if not exact or (k.lane is not None and k.lane.grid_n == at):
                self.publisher.ensure_full(k)
            return False
        if exact:
            if all(n != at for n, _, _ in k.publish):
                return False
        elif self.publisher.where.share_point(k, at) != at:
            return False
        job.wait.waiting_for, job.wait.wait_point = k, at
        self.p.meter.waits_for_shared_prefix.inc()
        return True

    def _fetch(self, job: Job, box: Outbox, offer: Offer) -> None:
        """Read ``offer`` on the fetch thread; ``job`` waits in the queue meanwhile and
        starts from it when the read is done (or plans anew if it failed)."""
        b, w = self.board, job.wait
        w.fetching = w.fetched = True
        self.p.meter.fetches_in_background.inc()
        self._requeue(job, box)

        def read() -> None:
            lease = None
            try:
                lease = self.restorer.fetch(job, offer)
            except Exception:
                log.exception("reading a checkpoint for %s failed", job.req.request_id)
            with b.cv:
                w.fetching = False
                if job.cancelled or b.stopping or (job, box) not in b.waiting:
                    if lease is not None:
                        lease.close()
                else:
                    w.prefetched = lease
                b.cv.notify_all()

        try:
            self._fetcher.submit(read)
        except RuntimeError:  # shutting down: it plans (and reads) in the engine thread
            w.fetching = False
