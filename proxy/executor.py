"""Carrying out requests on the llama context: restore, prefill, decode, publish.

Runs on the engine thread only; nothing here is thread-safe. Checkpoint policy by
memory kind (DESIGN.md facts 5-9):

- hybrid / recurrent: the recurrent state cannot roll back, so prefill publishes
  small PARTIAL checkpoints in the lane (replay, branch, periodic) and the reply's
  end gets one too; a later turn rolls the lane back by restoring one, then
  ``seq_rm`` (fact 7). FULL states are saved when the lane is handed to another
  prompt and at shutdown.
- SWA (Gemma 3): the context keeps every SWA cell of a live lane (``swa_full``), so
  ``seq_rm`` rolls a live lane back; partial states would be most of the KV anyway
  (fact 4). FULL states are saved at the replay point and on hand-off; a restored
  one is never cut below its own position (fact 8).
- plain attention: ``seq_rm`` rolls back anywhere; FULL states at the replay point
  and on hand-off.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from proxy.binding import FLAGS_FULL, FLAGS_PARTIAL, Context, MemoryInfo, MemoryKind
from proxy.detok import TextStream
from proxy.lanes import Lane, LaneSet
from proxy.planner import Plan, Source, make_plan, publish_points
from proxy.sampling import Sampler
from proxy.types import GenerationRequest, RequestStats, TokenLogprob
from statecache.config import Config
from statecache.pool import CheckpointPool
from statecache.records import Kind, Owner, Role

log = logging.getLogger(__name__)

PREVIEW_TOKENS = 24


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
    publish: list[tuple[int, Role]] = field(default_factory=list)
    sampler: Sampler | None = None
    stream: TextStream | None = None
    generated: list[int] = field(default_factory=list)
    pending: int = -1  # sampled token not yet decoded
    finish_reason: str = ""
    stats: RequestStats = field(default_factory=RequestStats)
    t_first: float = 0.0
    cancelled: bool = False
    logprobs: list[TokenLogprob] = field(default_factory=list)  # not yet sent


class Executor:
    def __init__(self, ctx: Context, memory: MemoryInfo, pool: CheckpointPool | None,
                 cfg: Config, counters: dict[str, int]) -> None:
        self.ctx = ctx
        self.model = ctx.model
        self.memory = memory
        self.pool = pool
        self.cfg = cfg
        self.lanes = LaneSet(ctx.n_lanes)
        self.counters = counters
        self.page = cfg.cache.page_size

    # -- admission ------------------------------------------------------------------

    def start(self, job: Job) -> None:
        """Pick a lane and bring it to the longest reusable prefix of the prompt."""
        free = self.lanes.free()
        assert free, "start() needs a free lane"
        tenant = job.req.tenant
        chain = None
        if job.use_cache and self.pool is not None:
            chain = self.pool.chain(job.prompt, tenant)
            plan = make_plan(job.prompt, chain, free, tenant=tenant, memory=self.memory,
                             pool=self.pool, pos_min=self.ctx.pos_min, all_lanes=self.lanes.lanes)
            plan.match_depth = max(plan.match_depth, self.pool.match_depth(chain))
        else:
            plan = Plan(min(free, key=lambda ln: ln.last_used), Source.COLD, 0)
        lane = plan.lane
        lane.busy = True
        job.lane = lane
        t0 = time.perf_counter()
        try:
            self._carry_out(plan, job)
        finally:
            plan.release()
        job.stats.restore_s = time.perf_counter() - t0 - job.stats.handoff_s
        job.stats.lane = lane.id
        job.reuse = job.pos = lane.n
        assert np.array_equal(lane.tokens, job.prompt[: lane.n]), "lane does not hold the prefix"
        if job.use_cache and self.pool is not None:
            limit = len(job.prompt) - 1
            replay_at = job.req.history_tokens if job.req.history_tokens is not None else limit
            job.publish = publish_points(
                reuse=job.reuse, limit=limit, replay_at=replay_at,
                match_depth=plan.match_depth, page=self.page,
                every_pages=self.cfg.cache.periodic_pages)
            if self._publish_kind() is Kind.FULL:
                # full states grow with the prompt: only the points a later turn needs
                job.publish = [(n, r) for n, r in job.publish if r is not Role.PERIODIC]
            elif limit > job.reuse and (not job.publish or job.publish[-1][0] < limit):
                # a lane that cannot roll back keeps the state one token short of the
                # prompt too, so a repeated or regenerated request reuses all of it
                job.publish.append((limit, Role.REPLAY))
        job.sampler = Sampler(job.req.sampling)
        job.stream = TextStream(job.req.sampling.stop)
        self.counters[f"plan_{job.stats.source}"] += 1

    def _carry_out(self, plan: Plan, job: Job) -> None:
        lane, prompt, tenant = plan.lane, job.prompt, job.req.tenant
        job.stats.source, job.stats.role = plan.source.value, plan.role
        if plan.source is Source.LANE:
            if plan.partial is not None or plan.truncate:
                self._hand_off_timed(lane, job, convert_replay=False)
            if plan.partial is not None and not self.ctx.restore(
                    lane.id, plan.partial.data, FLAGS_PARTIAL):
                self._fall_back_cold(lane, job, "partial restore failed")
                return
            if plan.partial is not None or plan.truncate:
                if not self.ctx.seq_rm(lane.id, plan.reuse, -1):
                    self._fall_back_cold(lane, job, "seq_rm refused")
                    return
                lane.truncate(plan.reuse)
                if self.pool is not None:
                    self.pool.drop_lane(lane.id, above=plan.reuse)
            return
        self._hand_off_timed(lane, job)
        self._clear(lane)
        if plan.full is not None:
            if not self.ctx.restore(lane.id, plan.full.data, FLAGS_FULL):
                assert self.pool is not None
                self.pool.remove(plan.full.record.id)
                self._fall_back_cold(lane, job, "full restore failed")
                return
            lane.set_tokens(prompt[: plan.reuse], tenant)
            lane.saved_full = True
            if self.memory.kind is MemoryKind.SWA:
                lane.floor = plan.reuse
        else:
            lane.tenant = tenant

    def _fall_back_cold(self, lane: Lane, job: Job, why: str) -> None:
        log.warning("lane %d: %s; starting cold", lane.id, why)
        self.counters["restore_failures"] += 1
        self._clear(lane)
        lane.tenant = job.req.tenant
        job.stats.source, job.stats.role = Source.COLD.value, ""

    def _clear(self, lane: Lane) -> None:
        self.ctx.clear_lane(lane.id)
        lane.clear()
        if self.pool is not None:
            self.pool.drop_lane(lane.id)

    # -- checkpoints ----------------------------------------------------------------

    def save(self, lane: Lane, role: Role, kind: Kind) -> int:
        """Publish the lane's current state; returns the bytes stored (0 if refused)."""
        if self.pool is None or lane.n == 0:
            return 0
        data = self.ctx.save(lane.id, FLAGS_PARTIAL if kind is Kind.PARTIAL else FLAGS_FULL)
        preview = self.model.detokenize(lane.tokens[-PREVIEW_TOKENS:].tolist())
        rec = self.pool.insert(kind=kind, owner=Owner.TARGET,
                               lane=lane.id if kind is Kind.PARTIAL else None,
                               tokens=lane.tokens, role=role, data=data, tenant=lane.tenant,
                               preview=preview)
        if rec is None:
            return 0
        self.counters["checkpoints_saved"] += 1
        self.counters["checkpoint_bytes_saved"] += rec.nbytes
        if kind is Kind.FULL:
            lane.saved_full = True
        return rec.nbytes

    def _publish_kind(self) -> Kind:
        return Kind.PARTIAL if self.memory.needs_partial and \
            self.memory.kind is not MemoryKind.SWA else Kind.FULL

    def _hand_off_timed(self, lane: Lane, job: Job, *, convert_replay: bool = True) -> None:
        t0 = time.perf_counter()
        self.hand_off(lane, convert_replay=convert_replay)
        job.stats.handoff_s += time.perf_counter() - t0

    def hand_off(self, lane: Lane, *, convert_replay: bool = True) -> None:
        """Before a lane's state is cut back or replaced, keep it as a FULL checkpoint.

        On a hybrid, the lane's deepest partial checkpoint before its end (usually the
        replay point) becomes a FULL one too: restore it, cut the tail, save.
        """
        if self.pool is None or lane.n == 0 or lane.saved_full:
            return
        self.counters["handoffs"] += 1
        # a lane ends where its last request's reply ended
        self.save(lane, Role.END_OF_REPLY, Kind.FULL)
        if not convert_replay or self._publish_kind() is not Kind.PARTIAL:
            return
        chain = self.pool.chain(lane.tokens, lane.tenant)
        lease = self.pool.lookup(lane.tokens, chain, kind=Kind.PARTIAL, lane=lane.id,
                                 max_n=lane.n - 1, tenant=lane.tenant)
        if lease is None:
            return
        with lease:
            n, role = lease.record.n, lease.record.role
            if not (self.ctx.restore(lane.id, lease.data, FLAGS_PARTIAL)
                    and self.ctx.seq_rm(lane.id, n, -1)):
                self._clear(lane)
                return
        lane.truncate(n)
        self.pool.drop_lane(lane.id, above=n)
        self.save(lane, role, Kind.FULL)

    # -- running --------------------------------------------------------------------

    def step(self, job: Job) -> list[tuple[str, tuple[int, ...]]]:
        """One unit of work: a prefill chunk or one decoded token. Returns text deltas."""
        if job.pos < len(job.prompt):
            return self._prefill_chunk(job)
        return self._decode_one(job)

    def _prefill_chunk(self, job: Job) -> list[tuple[str, tuple[int, ...]]]:
        lane = job.lane
        assert lane is not None
        end = min(job.pos + self.ctx.n_batch, len(job.prompt))
        if job.publish and job.publish[0][0] < end:
            end = job.publish[0][0]
        last = end == len(job.prompt)
        chunk = job.prompt[job.pos:end]
        self.ctx.batch.clear()
        row = self.ctx.batch.add(lane.id, chunk, job.pos, logits_last=last)
        self.ctx.decode()
        lane.tokens = job.prompt[:end].copy()
        lane.saved_full = False
        job.stats.prefilled += end - job.pos
        job.pos = end
        while job.publish and job.publish[0][0] == end:
            _, role = job.publish.pop(0)
            self._publish(job, role)
        if not last:
            return []
        job.t_first = time.perf_counter()
        return self._take(job, self.ctx.logits(row))

    def _publish(self, job: Job, role: Role) -> None:
        assert job.lane is not None
        nbytes = self.save(job.lane, role, self._publish_kind())
        if nbytes:
            job.stats.checkpoints_added += 1
            job.stats.checkpoint_bytes += nbytes

    def _decode_one(self, job: Job) -> list[tuple[str, tuple[int, ...]]]:
        lane = job.lane
        assert lane is not None and job.pending >= 0
        pos = lane.n
        self.ctx.batch.clear()
        row = self.ctx.batch.add(lane.id, [job.pending], pos, logits_last=True)
        self.ctx.decode()
        lane.tokens = np.append(lane.tokens, np.int32(job.pending))
        lane.saved_full = False
        return self._take(job, self.ctx.logits(row))

    def _take(self, job: Job, logits: np.ndarray) -> list[tuple[str, tuple[int, ...]]]:
        """Sample the next token and decide whether the request is done."""
        assert job.sampler is not None and job.stream is not None
        tok = job.sampler(logits)
        if job.req.sampling.logprobs is not None:
            job.logprobs.append(self._logprob(logits, tok, job.req.sampling.logprobs))
        job.generated.append(tok)
        job.pending = tok
        if self.model.is_eog(tok):
            job.finish_reason = "stop"
            tail = job.stream.finish()
            return [(tail, ())] if tail else []
        text = job.stream.feed(self.model.token_bytes(tok))
        out: list[tuple[str, tuple[int, ...]]] = [(text, (tok,))] if text else []
        if job.stream.stopped:
            job.finish_reason = "stop"
        elif len(job.generated) >= job.req.sampling.max_tokens:
            job.finish_reason = "length"
            tail = job.stream.finish()
            if tail:
                out.append((tail, ()))
        return out

    def _logprob(self, logits: np.ndarray, tok: int, k: int) -> TokenLogprob:
        x = logits.astype(np.float64)
        lse = float(np.logaddexp.reduce(x))
        top: tuple[tuple[str, float], ...] = ()
        if k > 0:
            idx = np.argpartition(-x, k - 1)[:k]
            idx = idx[np.argsort(-x[idx], kind="stable")]
            top = tuple((self.model.detokenize([int(i)]), float(x[i] - lse)) for i in idx)
        return TokenLogprob(self.model.detokenize([tok]), float(x[tok] - lse), top)

    def finish(self, job: Job) -> None:
        """Publish the end-of-reply state and free the lane."""
        lane = job.lane
        assert lane is not None
        if (job.use_cache and lane.n > job.reuse and job.finish_reason != "cancelled"
                and self._publish_kind() is Kind.PARTIAL):
            self._publish(job, Role.END_OF_REPLY)
        elif not job.use_cache:
            # a cold-only request leaves nothing reusable behind
            self._clear(lane)
        lane.busy = False
        lane.last_used = time.monotonic()

    def shutdown(self) -> None:
        """Keep every lane's state as a FULL checkpoint (the pool writes them to disk)."""
        for lane in self.lanes:
            if not lane.busy:
                self.hand_off(lane)
