"""Where a request starts from, and getting its lane there: plan (proxy/engine/planner.py
decides), then carry the plan out: keep the lanes in line, hand the lane's old state to
the pool, restore a checkpoint or cut the live state back, and set the request up to
prefill the rest.

A failed restore leaves the lane cleared and the request starting cold, never a lane
half-written.
"""

from __future__ import annotations

import logging
import math
import time

import numpy as np

from proxy.engine.binding import FLAGS_FULL, FLAGS_PARTIAL, MemoryKind
from proxy.engine.build import Parts
from proxy.engine.emit import Emitter
from proxy.engine.job import Job
from proxy.engine.lanes import Lane
from proxy.engine.placement import Placement
from proxy.engine.planner import Plan, Source, cold_lane, make_plan
from proxy.engine.publishing import Publisher
from proxy.engine.types import FROM_DECODE, RESTORED
from statecache.pages import PageChain, common_prefix
from statecache.pool import Offer
from statecache.pool.lease import Lease

log = logging.getLogger(__name__)


class Restorer:
    def __init__(self, parts: Parts, publisher: Publisher, placement: Placement,
                 emitter: Emitter) -> None:
        self.p = parts
        self.publisher = publisher
        self.placement = placement
        self.emitter = emitter
        self._chains: list[PageChain] = []  # recent prompts' page hashes, newest first

    def plan(self, job: Job, *, held: Lease | None = None, defer_reads: bool = False
             ) -> Plan | Offer:
        """Where ``job`` would start from now (it needs a free lane: a vacant one for a
        pre-warm). ``held``: a state fetched for it in the background (taken over). With
        ``defer_reads``, a plan that would read from disk or the shared store reads
        nothing and returns what to fetch instead. Nothing is changed: ``start`` carries
        a plan out, ``Plan.release`` drops one."""
        t0 = time.perf_counter()
        p = self.p
        free = self.vacant_lanes(job) if job.prewarm else p.lanes.free()
        assert free, "plan() needs a free lane"
        tenant = job.req.tenant
        if not (job.use_cache and p.pool is not None):
            if held is not None:
                held.close()
            plan = Plan(cold_lane(free, job.req.session), Source.COLD, 0)
        else:
            chain = self._chain(job.prompt, tenant)
            plan = make_plan(job.prompt, chain, free, tenant=tenant, memory=p.memory,
                             pool=p.pool, pos_min=p.ctx.pos_min, all_lanes=p.lanes.lanes,
                             held=held, defer_reads=defer_reads, session=job.req.session,
                             grid=p.grid if p.exact else 0)
            if plan.fetch is not None:
                plan.release()
                return plan.fetch
            plan.chain = chain
            plan.match_depth = max(plan.match_depth, p.pool.match_depth(chain))
        plan.plan_s = time.perf_counter() - t0
        return plan

    def _chain(self, prompt: np.ndarray, tenant: str) -> PageChain:
        """The prompt's page hashes, from the recent chain that shares most with it: a
        follow-up hashes only its new pages."""
        pool = self.p.pool
        assert pool is not None
        prev = max(self._chains, key=lambda c: common_prefix(c.tokens, prompt), default=None)
        chain = pool.chain(prompt, tenant, prev)
        if prev is not None and common_prefix(prev.tokens, prompt) == len(prev):
            self._chains.remove(prev)  # the prompt goes on from it: it stands for both
        self._chains.insert(0, chain)
        del self._chains[len(self.p.lanes) + 2:]
        return chain

    def start(self, job: Job, plan: Plan) -> None:
        """Carry ``plan`` out: the job's lane holds the prefix it starts from, its
        checkpoints are planned and it is ready to prefill the rest."""
        p = self.p
        t0 = time.perf_counter()
        free = self.vacant_lanes(job) if job.prewarm else p.lanes.free()
        try:
            self.placement.in_line(plan, free, job)
            lane = plan.lane
            lane.busy = True
            job.lane = lane
            self.carry_out(plan, job)
            if plan.logits is not None and lane.n == plan.reuse:
                lane.keep_logits(plan.logits)  # the state's own, from its lane or checkpoint
        finally:
            plan.release()
        job.stats.restore_s = time.perf_counter() - t0 - job.stats.handoff_s
        job.t_admitted = t0
        job.stats.lane = lane.id
        job.estimate = plan.estimate
        lane.session = job.req.session
        job.reuse = job.pos = lane.n
        if lane.grid_n < lane.n:  # what it starts from is not what a cold prefill writes
            job.stats.not_exact(RESTORED if plan.full is not None or plan.partial is not None
                                else FROM_DECODE)
        if not np.array_equal(lane.tokens, job.prompt[: lane.n]):
            raise RuntimeError("lane does not hold the prefix it was planned to")
        if job.use_cache and p.pool is not None:
            job.publish = self.publisher.where.points(job, plan.match_depth, plan.chain)
        self.emitter.prepare(job)
        p.meter.by_source.inc(job.stats.source)
        job.stats.plan_s = plan.plan_s + time.perf_counter() - t0
        if not job.prefilling:  # the whole prompt is there: its first token, nothing decoded
            logits = lane.logits_at(lane.n)
            if logits is None:
                raise RuntimeError("lane holds the whole prompt without its logits")
            self.emitter.first(job, -1, logits)

    def vacant_lanes(self, job: Job) -> list[Lane]:
        """The free lanes a pre-warm may take without evicting a live conversation: an
        empty lane, its own conversation's, or one idle for ``engine.idle_save_s`` and
        saved in full (``engine.idle_save_s`` = 0: only the first two)."""
        idle_s = self.p.cfg.engine.idle_save_s
        since = self.p.clock() - idle_s if idle_s else -math.inf
        return [ln for ln in self.p.lanes.free()
                if ln.vacant_for(job.prompt, job.req.tenant, since)]

    def fetch(self, job: Job, offer: Offer) -> Lease | None:
        """Read ``offer`` for ``job`` (any thread): the state its next plan starts from."""
        pool = self.p.pool
        assert pool is not None
        chain = pool.chain(job.prompt, job.req.tenant)
        return pool.take(offer, job.prompt, chain, tenant=job.req.tenant)

    def carry_out(self, plan: Plan, job: Job) -> None:
        p, publisher = self.p, self.publisher
        lane, prompt, tenant = plan.lane, job.prompt, job.req.tenant
        job.stats.source, job.stats.role = plan.source, plan.role
        if plan.source == Source.LANE:
            if plan.partial is not None or plan.truncate:
                publisher.hand_off_unless_replaced(lane, job, cut=plan.reuse,
                                                   convert_replay=False)
            if plan.partial is not None and not p.ctx.restore(
                    lane.id, plan.partial.data, FLAGS_PARTIAL):
                self._fall_back_cold(lane, job, "partial restore failed")
                return
            if plan.partial is not None or plan.truncate:
                if not p.ctx.seq_rm(lane.id, plan.reuse, -1):
                    self._fall_back_cold(lane, job, "seq_rm refused")
                    return
                lane.truncate(plan.reuse)
                if p.pool is not None:
                    p.pool.drop_lane(lane.id, above=plan.reuse)
            return
        publisher.hand_off_unless_replaced(lane, job)
        publisher.clear(lane)
        if plan.full is not None:
            if not p.ctx.restore(lane.id, plan.full.data, FLAGS_FULL):
                assert p.pool is not None
                p.pool.remove(plan.full.record.id)
                self._fall_back_cold(lane, job, "full restore failed")
                return
            lane.set_tokens(prompt[: plan.reuse], tenant)
            lane.saved_full = True
            if p.exact:  # an exact-mode pool holds states that grid prefills wrote alone
                lane.grid_n = plan.reuse
            if p.memory.kind is MemoryKind.SWA:
                lane.floor = plan.reuse
        else:
            lane.tenant = tenant

    def _fall_back_cold(self, lane: Lane, job: Job, why: str) -> None:
        log.warning("lane %d: %s; starting cold", lane.id, why)
        self.p.meter.restore_failures.inc()
        self.publisher.clear(lane)
        lane.tenant = job.req.tenant
        job.stats.source, job.stats.role = Source.COLD, ""
