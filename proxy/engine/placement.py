"""Which lane a request runs in, so that the lanes decoding together stay one run of
ids: llama.cpp (kv_unified off) puts separate lanes in one ubatch only while their ids
follow each other, so lanes 0 and 2 decode in two passes over the weights a step where
0 and 1 take one (``lane_gap`` in ``python -m bench.batching``).
"""

from __future__ import annotations

import logging

from proxy.engine.binding import FLAGS_FULL, MemoryKind
from proxy.engine.build import Parts
from proxy.engine.job import Job
from proxy.engine.lanes import Lane
from proxy.engine.planner import Plan, Source
from proxy.engine.publishing import Publisher
from statecache.costs import RESTORE_BPS

log = logging.getLogger(__name__)

MIN_TOKENS_TO_MOVE = 16  # a request may reply with fewer: not worth copying its lane


class Placement:
    def __init__(self, parts: Parts, publisher: Publisher) -> None:
        self.p = parts
        self.publisher = publisher

    def in_line(self, plan: Plan, free: list[Lane], job: Job) -> None:
        """Keep the lanes that decode together in one run of ids. llama.cpp puts separate
        lanes (kv_unified off) in one ubatch only while their ids follow each other:
        lanes 0 and 2 decode in two passes over the weights a step, where 0 and 1 take
        one (``lane_gap`` in ``python -m bench.batching``). When the plan's lane would
        leave such a gap among the busy lanes and another free lane would not, the
        request runs in that one (an empty lane first, then one whose state is saved,
        then the least recently used); a live state the plan reuses is copied there
        (FULL save and restore: milliseconds, against a pass over the weights every step
        of the reply), and the lane it came from keeps it. A request of a few tokens
        stays where the plan put it: the other lane's state may need saving first, and
        its first token is most of what it waits for."""
        busy = [ln.id for ln in self.p.lanes if ln.busy]
        if self.p.exact:  # one lane a step: no gaps to close, and no copy to prove exact
            return
        if not busy or job.req.sampling.max_tokens < MIN_TOKENS_TO_MOVE:
            return  # a short reply: its first token first (the other lane may need a save)
        src = plan.lane
        better = _closing([ln for ln in free if ln is not src], busy, _runs(busy + [src.id]))
        if not better:
            return
        copy = plan.source == Source.LANE and src.n > 0
        if copy and self.p.memory.kind is MemoryKind.SWA and plan.truncate:
            # a restored SWA state is never cut below its own position (docs/design.md
            return  # fact 8)
        dst = _target(better)
        if copy:
            self.publisher.hand_off_timed(dst, job)
            if not self.copy(src, dst):
                return
            self.p.meter.lane_copies.inc()
        plan.lane = dst
        self.p.meter.lanes_kept_in_line.inc()

    def close_gap(self, jobs: list[Job], pass_s: float) -> None:
        """A request that ended may leave a gap among the lanes that decode: move one
        decoding request into a free lane that closes it, when copying its state takes
        less time than the extra passes over the weights (``pass_s`` each) of the next
        tokens it may produce (at most 64 counted). Its old lane keeps the state."""
        busy = [ln.id for ln in self.p.lanes if ln.busy]
        gaps = _runs(busy)
        if gaps < 2 or pass_s <= 0 or self.p.exact:
            return
        free = self.p.lanes.free()
        best: tuple[int, Job, list[Lane]] | None = None  # the cheapest copy
        for job in jobs:
            src = job.lane
            left = job.req.sampling.max_tokens - len(job.out.generated)
            if (src is None or job.done or job.prefilling or len(job.spec.replay)
                    or left < MIN_TOKENS_TO_MOVE):
                continue
            better = _closing(free, [i for i in busy if i != src.id], gaps)
            if not better:
                continue
            size = self.p.ctx.state_size(src.id)
            if 2 * size / RESTORE_BPS >= pass_s * min(left, 64):  # a save, a restore
                continue  # the copy costs more than the gap would
            if best is None or size < best[0]:
                best = (size, job, better)
        if best is None:
            return
        _, job, better = best
        src, dst = job.lane, _target(better)
        assert src is not None
        self.publisher.hand_off(dst)
        if not self.copy(src, dst):
            return
        dst.busy = True
        src.busy = False
        src.history_n = min(job.history, src.n)  # it holds the job's turn, in part
        src.last_used = self.p.clock()
        job.lane = dst
        job.stats.lane = dst.id
        self.p.meter.lane_moves.inc()

    def copy(self, src: Lane, dst: Lane) -> bool:
        """Make ``dst`` hold ``src``'s live state (FULL save and restore)."""
        self.publisher.clear(dst)
        if not self.p.ctx.restore(dst.id, self.p.ctx.save(src.id, FLAGS_FULL), FLAGS_FULL):
            log.warning("lane %d: copying lane %d's state failed", dst.id, src.id)
            self.publisher.clear(dst)
            return False
        dst.set_tokens(src.tokens, src.tenant)
        dst.saved_full = src.saved_full
        dst.history_n = src.history_n
        # a restored SWA state is never cut below its own position (docs/design.md fact 8)
        dst.floor = src.n if self.p.memory.kind is MemoryKind.SWA else src.floor
        return True


def _target(lanes: list[Lane]) -> Lane:
    """Of free lanes, the one to take over: an empty one, then one whose state is
    saved, then the least recently used."""
    return max(lanes, key=lambda ln: (ln.n == 0, ln.saved_full, -ln.last_used))


def _closing(free: list[Lane], others: list[int], than: int) -> list[Lane]:
    """The free lanes that, beside the busy lanes ``others``, make fewer than ``than``
    runs of ids."""
    return [ln for ln in free if _runs([*others, ln.id]) < than]


def _runs(ids: list[int]) -> int:
    """How many runs of consecutive ids ``ids`` make: the ubatches a decode step of
    those lanes takes (llama.cpp, kv_unified off)."""
    xs = sorted(set(ids))
    return sum(1 for i, x in enumerate(xs) if i == 0 or x != xs[i - 1] + 1)
