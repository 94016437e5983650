"""Carrying out requests on the llama context: restore, one batched step, publish.

Runs on the engine thread only; nothing here is thread-safe. A step is one
``llama_decode`` for every lane with work: each lane's share is a ``Work`` (these
tokens at these positions, logits for the last row): one token for a decoding lane,
a chunk for a prefilling one. After the step each lane is committed on its own, so
a lane whose sampling fails ends alone and the others go on.

Checkpoint policy by memory kind (docs/design.md facts 5-9):

- hybrid / recurrent: the recurrent state cannot roll back, so prefill publishes
  small PARTIAL checkpoints in the lane (replay, periodic) and the reply's end gets
  one too; a later turn rolls the lane back by restoring one, then ``seq_rm``
  (docs/design.md fact 7, in that order). FULL states are saved when the lane is handed to
  another prompt, when it has been idle a while, and at shutdown; the lane's
  replay points become FULL ones on hand-off too.
- SWA (Gemma 3): the context keeps every SWA cell of a live lane (``swa_full``), so
  ``seq_rm`` rolls a live lane back; partial states would be most of the KV anyway
  (docs/design.md fact 4). FULL states at the replay point and on hand-off; a restored one is
  never cut below its own position (docs/design.md fact 8).
- plain attention: ``seq_rm`` rolls back anywhere; FULL states at the replay point
  and on hand-off.
- every kind: a BRANCH point (where this prompt leaves a prefix that another
  conversation holds, or that another request being admitted shares) is FULL, so
  any lane can start from it: an agent's subagents share the system prompt.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from proxy.engine.binding import FLAGS_FULL, FLAGS_PARTIAL, Context, MemoryInfo, MemoryKind
from proxy.engine.detok import TextStream
from proxy.engine.drafting import DraftAsk, DraftModel, lookup_draft
from proxy.engine.lanes import Lane, LaneSet
from proxy.engine.planner import Plan, Source, cold_lane, make_plan, publish_points
from proxy.engine.sampling import Sampler, make_sampler
from proxy.engine.types import GenerationRequest, RequestStats, TokenLogprob
from statecache.config import Config
from statecache.costs import RESTORE_BPS
from statecache.lease import Lease
from statecache.pages import PageChain
from statecache.pool import CheckpointPool, Offer
from statecache.records import Kind, Owner, Role

log = logging.getLogger(__name__)

PREVIEW_TOKENS = 24
MIN_TOKENS_TO_MOVE = 16  # a request may reply with fewer: not worth copying its lane

Delta = tuple[str, tuple[int, ...]]
_NONE: np.ndarray = np.empty(0, dtype=np.int32)


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
    publish: list[tuple[int, Role, Kind]] = field(default_factory=list)
    sampler: Sampler | None = None
    stream: TextStream | None = None
    generated: list[int] = field(default_factory=list)
    pending: int = -1  # sampled token not yet decoded
    finish_reason: str = ""
    error: BaseException | None = None
    stats: RequestStats = field(default_factory=RequestStats)
    t_first: float = 0.0
    t_admitted: float = 0.0
    cancelled: bool = False
    stopping: bool = False  # the server is shutting down: end at the next step
    logprobs: list[TokenLogprob] = field(default_factory=list)  # not yet sent
    deltas: list[Delta] = field(default_factory=list)  # text produced and not yet sent
    written: bool = False  # the engine has handed this stream's tokens on before
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
    # speculative decoding (proxy/engine/drafting.py)
    speculate: bool = False  # drafts are verified for this request
    drafts: np.ndarray = field(default_factory=lambda: _NONE)  # this step's drafts
    # tokens accepted by a verification that a lane without rollback (restored to its
    # staged state) decodes again in its next step, before ``pending``
    replay: np.ndarray = field(default_factory=lambda: _NONE)
    staged: bytes | None = None  # the lane's partial state before this step's verification
    # seconds a FULL checkpoint published at a position is kept above ordinary ones
    # (a client's cache breakpoint there)
    keep: dict[int, float] = field(default_factory=dict)

    @property
    def prefilling(self) -> bool:
        return self.pos < len(self.prompt)

    @property
    def prewarm(self) -> bool:
        return self.req.prewarm

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def fail(self, exc: BaseException) -> None:
        """This request ends with ``exc``; the others go on."""
        self.error = exc
        self.finish_reason = "error"


@dataclass(slots=True)
class Work:
    """One lane's share of a step: ``n`` tokens from ``pos0``. A decoding lane's work is
    its replayed tokens, ``pending`` and its drafts; logits from ``pending`` on."""

    job: Job
    n: int
    pos0: int
    row: int = -1  # batch row of the first token whose logits are kept (-1: none)
    room: int = 0  # drafts this work may carry (counted in ``n`` until they are known)


class Executor:
    def __init__(self, ctx: Context, memory: MemoryInfo, pool: CheckpointPool | None,
                 cfg: Config, counters: dict[str, int], draft: DraftModel | None = None
                 ) -> None:
        self.ctx = ctx
        self.model = ctx.model
        self.memory = memory
        self.pool = pool
        self.cfg = cfg
        self.lanes = LaneSet(ctx.n_lanes)
        self.counters = counters
        self.page = cfg.cache.page_size
        # end-of-turn tokens: the first one in a prompt ends its system prompt
        self._eog = np.array([t for t in range(self.model.n_vocab) if self.model.is_eog(t)],
                             dtype=np.int32)
        sc = cfg.speculative
        self.draft = draft
        self.speculation = "off" if sc.source == "off" else (
            "draft" if draft is not None else "lookup")
        # how rejected drafts leave the target lane: seq_rm where the memory can cut its
        # tail back (attention, SWA kept whole, a hybrid's n_rs_seq snapshots); else the
        # lane's partial state is staged before a verification and restored after
        self.rs_snapshots = memory.needs_partial and memory.n_rs_seq > sc.draft_max \
            and sc.rollback != "staged"
        self.staging = memory.needs_partial and memory.kind is not MemoryKind.SWA \
            and not self.rs_snapshots

    # -- admission ------------------------------------------------------------------

    def start(self, job: Job, *, held: Lease | None = None, defer_reads: bool = False
              ) -> Offer | None:
        """Pick a lane and bring it to the longest reusable prefix of the prompt.

        ``held``: a state fetched for this job in the background (taken over). With
        ``defer_reads``, a plan that would read from disk or the shared store starts
        nothing and returns what to fetch; else None: the job has started."""
        t_plan = time.perf_counter()
        free = self.vacant_lanes(job) if job.prewarm else self.lanes.free()
        assert free, "start() needs a free lane"
        tenant = job.req.tenant
        chain = None
        if job.use_cache and self.pool is not None:
            chain = self.pool.chain(job.prompt, tenant)
            plan = make_plan(job.prompt, chain, free, tenant=tenant, memory=self.memory,
                             pool=self.pool, pos_min=self.ctx.pos_min, all_lanes=self.lanes.lanes,
                             held=held, defer_reads=defer_reads, session=job.req.session)
            if plan.fetch is not None:
                plan.release()
                return plan.fetch
            plan.match_depth = max(plan.match_depth, self.pool.match_depth(chain))
        else:
            if held is not None:
                held.close()
            plan = Plan(cold_lane(free, job.req.session), Source.COLD, 0)
        t0 = time.perf_counter()
        try:
            self._in_line(plan, free, job)
            lane = plan.lane
            lane.busy = True
            job.lane = lane
            self._carry_out(plan, job)
        finally:
            plan.release()
        job.stats.restore_s = time.perf_counter() - t0 - job.stats.handoff_s
        job.t_admitted = t0
        job.stats.lane = lane.id
        lane.session = job.req.session
        job.reuse = job.pos = lane.n
        if not np.array_equal(lane.tokens, job.prompt[: lane.n]):
            raise RuntimeError("lane does not hold the prefix it was planned to")
        if job.use_cache and self.pool is not None:
            job.publish = self._publish_plan(job, plan.match_depth, chain)
        job.sampler = make_sampler(self.model, job.req.sampling, self.cfg.sampling, job.prompt)
        job.stream = TextStream(job.req.sampling.stop)
        # a grammar would have to pass every drafted token: such a request drafts nothing
        job.speculate = (self.speculation != "off" and job.req.sampling.speculative is not False
                         and not job.sampler.constrained)
        self.counters[f"plan_{job.stats.source}"] += 1
        job.stats.plan_s = time.perf_counter() - t_plan
        return None

    def vacant_lanes(self, job: Job) -> list[Lane]:
        """The free lanes a pre-warm may take without evicting a live conversation: an
        empty lane, its own conversation's, or one idle for ``engine.idle_save_s`` and
        saved in full (``engine.idle_save_s`` = 0: only the first two)."""
        idle_s = self.cfg.engine.idle_save_s
        since = time.monotonic() - idle_s if idle_s else -math.inf
        return [ln for ln in self.lanes.free()
                if ln.vacant_for(job.prompt, job.req.tenant, since)]

    def fetch(self, job: Job, offer: Offer) -> Lease | None:
        """Read ``offer`` for ``job`` (any thread): the state its next plan starts from."""
        assert self.pool is not None
        chain = self.pool.chain(job.prompt, job.req.tenant)
        return self.pool.take(offer, job.prompt, chain, tenant=job.req.tenant)

    def _publish_plan(self, job: Job, match_depth: int, chain: PageChain | None
                      ) -> list[tuple[int, Role, Kind]]:
        limit = len(job.prompt) - 1
        replay_at = job.req.history_tokens if job.req.history_tokens is not None else limit
        d = job.req.divergence
        if d is not None and d.replayed:
            # this client sent the last reply back as generated: its next turn continues
            # from the reply's end, not from before the generation prompt. No cut there
            # (a cut costs a step, about a pass over the weights)
            replay_at = 0
        points = publish_points(reuse=job.reuse, limit=limit, replay_at=replay_at,
                                match_depth=match_depth, page=self.page,
                                every_pages=self.cfg.cache.periodic_pages)
        kind = self.publish_kind()
        first = self._first_turn_end(job)
        out: list[tuple[int, Role, Kind]] = []
        for n, r in points:
            if r is Role.PERIODIC and n <= first:
                # inside the first turn (an agent's system prompt), periodic points are
                # FULL: a prompt edited further on starts here in any lane
                if not self._pool_has_full(job, chain, n):
                    out.append((n, r, Kind.FULL))
            elif r is Role.BRANCH:
                out.append((n, r, Kind.FULL))
            elif not (kind is Kind.FULL and r is Role.PERIODIC):  # full states grow: skip
                out.append((n, r, kind))
        if kind is Kind.PARTIAL and limit > job.reuse and (not out or out[-1][0] < limit):
            # a lane that cannot roll back keeps the state one token short of the
            # prompt too, so a repeated or regenerated request reuses all of it
            out.append((limit, Role.REPLAY, Kind.PARTIAL))
        # the first turn's end in FULL: every subagent starts there, in any lane
        at = (first // self.page) * self.page
        if at > job.reuse and at >= 2 * self.page and not self._pool_has_full(job, chain, at):
            self.share_point(job, at, out)
        self._client_breakpoints(job, chain, out)
        for n in self._share_points(job, chain, out):
            self._full_at(out, n)
        if job.prewarm and len(job.prompt) > job.reuse:
            self._full_at(out, len(job.prompt))  # what comes next starts from the prompt
        return out

    @staticmethod
    def _full_at(points: list[tuple[int, Role, Kind]], n: int) -> None:
        """A FULL checkpoint at ``n`` in ``points`` (kept sorted)."""
        for i, (m, _role, kind) in enumerate(points):
            if m == n:
                if kind is not Kind.FULL:
                    points[i] = (n, Role.BRANCH, Kind.FULL)
                return
        points.append((n, Role.BRANCH, Kind.FULL))
        points.sort(key=lambda p: p[0])

    def _client_breakpoints(self, job: Job, chain: PageChain | None,
                            points: list[tuple[int, Role, Kind]]) -> None:
        """A client's cache breakpoints: a FULL checkpoint at each one this request
        prefills, kept for its ttl; one the pool holds already is kept longer."""
        assert self.pool is not None and chain is not None
        for n, ttl in job.req.breakpoints:
            if n > len(job.prompt) or n < 1:
                continue
            if n > job.reuse and (n < len(job.prompt) or job.prewarm):
                self._full_at(points, n)
                job.keep[n] = max(job.keep.get(n, 0.0), ttl)
            else:
                self.pool.keep(chain, n, ttl, tenant=job.req.tenant)

    def _share_points(self, job: Job, chain: PageChain | None,
                      points: list[tuple[int, Role, Kind]]) -> list[int]:
        """Where new conversations may share this prompt (its first turn's message and
        part starts, ``GenerationRequest.share_points``): at most ``cache.share_points``
        of them get a FULL checkpoint, largest gaps first. The gap of a point is how far
        it lies past the nearest FULL state at or before it (this request's start, its
        other FULL checkpoints, the pool's): what a conversation that parts there would
        prefill again without it. Points within a page of such a state are skipped."""
        k = self.cfg.cache.share_points
        limit = len(job.prompt) - 1
        cands = sorted({n for n in job.req.share_points
                        if job.reuse < n <= limit and n >= 2 * self.page})
        if not k or not cands:
            return []
        anchors = [job.reuse] + [n for n, _, kind in points if kind is Kind.FULL]
        todo: list[int] = []
        for n in cands:
            (anchors if self._pool_has_full(job, chain, n) else todo).append(n)
        chosen: list[int] = []
        while todo and len(chosen) < k:
            def gap(n: int) -> int:
                return n - max(a for a in anchors if a <= n)
            best = max(todo, key=gap)
            if gap(best) < self.page:
                break
            todo.remove(best)
            anchors.append(best)
            chosen.append(best)
        self.counters["share_points"] += len(chosen)
        return chosen

    def reusable_now(self, job: Job) -> int:
        """Prompt tokens ``job`` would start from if it were admitted now."""
        free = self.lanes.free()
        if not free or self.pool is None:
            return 0
        chain = self.pool.chain(job.prompt, job.req.tenant)
        plan = make_plan(job.prompt, chain, free, tenant=job.req.tenant, memory=self.memory,
                         pool=self.pool, pos_min=self.ctx.pos_min)
        plan.release()
        return plan.reuse

    def ensure_full(self, job: Job) -> None:
        """Save the job's lane in FULL now (it holds a prefix another request waits for),
        unless the pool has that state already."""
        assert job.lane is not None and self.pool is not None
        # the lane holds the first job.pos tokens of the prompt (it is prefilling)
        chain = self.pool.chain(job.prompt, job.req.tenant)
        if not self._pool_has_full(job, chain, job.lane.n):
            self._publish(job, Role.BRANCH, Kind.FULL)

    def _first_turn_end(self, job: Job) -> int:
        """Tokens of the prompt's first turn, up to its first end-of-turn token (0: none)."""
        hits = np.flatnonzero(np.isin(job.prompt[: len(job.prompt) - 1], self._eog))
        return int(hits[0]) + 1 if hits.size else 0

    def _pool_has_full(self, job: Job, chain: PageChain | None, n: int) -> bool:
        """Whether the pool holds the FULL state after the prompt's first ``n`` tokens."""
        assert self.pool is not None and chain is not None
        lease = self.pool.lookup(job.prompt, chain, kind=Kind.FULL, max_n=n,
                                 tenant=job.req.tenant)
        if lease is None:
            return False
        lease.close()
        return lease.record.n == n

    def share_point(self, job: Job, shared: int,
                    points: list[tuple[int, Role, Kind]] | None = None) -> int:
        """Make ``job`` publish a FULL checkpoint at the last whole page of ``shared``
        tokens, for another request that starts the same way; returns that position
        (0 when there is none to wait for)."""
        pts = job.publish if points is None else points
        at = (min(shared, len(job.prompt) - 1) // self.page) * self.page
        if at <= job.pos or self.pool is None or not job.use_cache:
            return 0
        self._full_at(pts, at)
        return at

    def _in_line(self, plan: Plan, free: list[Lane], job: Job) -> None:
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
        busy = [ln.id for ln in self.lanes if ln.busy]
        if not busy or job.req.sampling.max_tokens < MIN_TOKENS_TO_MOVE:
            return  # a short reply: its first token first (the other lane may need a save)
        src = plan.lane
        better = _closing([ln for ln in free if ln is not src], busy, _runs(busy + [src.id]))
        if not better:
            return
        copy = plan.source is Source.LANE and src.n > 0
        if copy and self.memory.kind is MemoryKind.SWA and plan.truncate:
            # a restored SWA state is never cut below its own position (docs/design.md
            return  # fact 8)
        dst = _target(better)
        if copy:
            self._hand_off_timed(dst, job)
            if not self._copy(src, dst):
                return
            self.counters["lane_copies"] += 1
        plan.lane = dst
        self.counters["lanes_kept_in_line"] += 1

    def close_gap(self, jobs: list[Job], pass_s: float) -> None:
        """A request that ended may leave a gap among the lanes that decode: move one
        decoding request into a free lane that closes it, when copying its state takes
        less time than the extra passes over the weights (``pass_s`` each) of the next
        tokens it may produce (at most 64 counted). Its old lane keeps the state."""
        busy = [ln.id for ln in self.lanes if ln.busy]
        gaps = _runs(busy)
        if gaps < 2 or pass_s <= 0:
            return
        free = self.lanes.free()
        best: tuple[int, Job, list[Lane]] | None = None  # the cheapest copy
        for job in jobs:
            src = job.lane
            left = job.req.sampling.max_tokens - len(job.generated)
            if (src is None or job.done or job.prefilling or len(job.replay)
                    or left < MIN_TOKENS_TO_MOVE):
                continue
            better = _closing(free, [i for i in busy if i != src.id], gaps)
            if not better:
                continue
            size = self.ctx.state_size(src.id)
            if 2 * size / RESTORE_BPS >= pass_s * min(left, 64):  # a save, a restore
                continue  # the copy costs more than the gap would
            if best is None or size < best[0]:
                best = (size, job, better)
        if best is None:
            return
        _, job, better = best
        src, dst = job.lane, _target(better)
        assert src is not None
        self.hand_off(dst)
        if not self._copy(src, dst):
            return
        dst.busy = True
        src.busy = False
        src.history_n = min(_history(job), src.n)  # it holds the job's turn, in part
        src.last_used = time.monotonic()
        job.lane = dst
        job.stats.lane = dst.id
        self.counters["lane_moves"] += 1

    def _copy(self, src: Lane, dst: Lane) -> bool:
        """Make ``dst`` hold ``src``'s live state (FULL save and restore)."""
        self.clear(dst)
        if not self.ctx.restore(dst.id, self.ctx.save(src.id, FLAGS_FULL), FLAGS_FULL):
            log.warning("lane %d: copying lane %d's state failed", dst.id, src.id)
            self.clear(dst)
            return False
        dst.set_tokens(src.tokens, src.tenant)
        dst.saved_full = src.saved_full
        dst.history_n = src.history_n
        # a restored SWA state is never cut below its own position (docs/design.md fact 8)
        dst.floor = src.n if self.memory.kind is MemoryKind.SWA else src.floor
        return True

    def _carry_out(self, plan: Plan, job: Job) -> None:
        lane, prompt, tenant = plan.lane, job.prompt, job.req.tenant
        job.stats.source, job.stats.role = plan.source.value, plan.role
        if plan.source is Source.LANE:
            if plan.partial is not None or plan.truncate:
                self._hand_off_unless_replaced(lane, job, convert_replay=False)
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
        self._hand_off_unless_replaced(lane, job)
        self.clear(lane)
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
        self.clear(lane)
        lane.tenant = job.req.tenant
        job.stats.source, job.stats.role = Source.COLD.value, ""

    def clear(self, lane: Lane) -> None:
        """Forget the lane's state and its partial checkpoints."""
        self.ctx.clear_lane(lane.id)
        lane.clear()
        if self.pool is not None:
            self.pool.drop_lane(lane.id)

    # -- checkpoints ----------------------------------------------------------------

    def save(self, lane: Lane, role: Role, kind: Kind, keep_s: float = 0.0) -> int:
        """Publish the lane's current state; returns the bytes stored (0 if refused).
        ``keep_s``: a client asked to keep it that long (a cache breakpoint)."""
        if self.pool is None or lane.n == 0:
            return 0
        data = self.ctx.save(lane.id, FLAGS_PARTIAL if kind is Kind.PARTIAL else FLAGS_FULL)
        preview = self.model.detokenize(lane.tokens[-PREVIEW_TOKENS:].tolist())
        rec = self.pool.insert(kind=kind, owner=Owner.TARGET,
                               lane=lane.id if kind is Kind.PARTIAL else None,
                               tokens=lane.tokens, role=role, data=data, tenant=lane.tenant,
                               preview=preview, keep_s=keep_s)
        if rec is None:
            return 0
        self.counters["checkpoints_saved"] += 1
        self.counters["checkpoint_bytes_saved"] += rec.nbytes
        if kind is Kind.FULL:
            lane.saved_full = True
        if self.draft is not None:  # the draft's partial state where it stands the same
            self.draft.checkpoint(lane.id, lane.tokens, lane.tenant, role)
        return rec.nbytes

    def publish_kind(self) -> Kind:
        return Kind.PARTIAL if self.memory.needs_partial and \
            self.memory.kind is not MemoryKind.SWA else Kind.FULL

    def _hand_off_unless_replaced(self, lane: Lane, job: Job, *,
                                  convert_replay: bool = True) -> None:
        """Keep the state ``job`` cuts back or replaces, unless all it loses is the turn
        of the lane's last request (its generation prompt and reply) and ``job`` holds
        that request's history whole: the client replaced that turn or renders it
        anew (a retry, a regenerate, a client that strips the reasoning from replies)
        and will not go on from it. The FULL save of a lane grows with its context
        (the KV of every token) and comes before this request's first token. A
        request served without the cache keeps nothing of its own: it replaces
        nothing."""
        if job.use_cache and lane.replaced_by(job.prompt, job.req.tenant):
            self.counters["replaced_replies"] += 1
            return
        self._hand_off_timed(lane, job, convert_replay=convert_replay)

    def _hand_off_timed(self, lane: Lane, job: Job, *, convert_replay: bool = True) -> None:
        t0 = time.perf_counter()
        self.hand_off(lane, convert_replay=convert_replay)
        job.stats.handoff_s += time.perf_counter() - t0

    def hand_off(self, lane: Lane, *, convert_replay: bool = True) -> None:
        """Before a lane's state is cut back or replaced, keep it as a FULL checkpoint.

        On a hybrid, the lane's replay points (partial checkpoints: the history's end
        and the state one token short of the prompt) become FULL ones too: restore
        each, deepest first, cut the tail, save. The lane ends cut back.
        """
        if self.pool is None or lane.n == 0:
            return
        if not lane.saved_full:
            self.counters["handoffs"] += 1
            # a lane ends where its last request's reply ended
            self.save(lane, Role.END_OF_REPLY, Kind.FULL)
        if not convert_replay or lane.replay_saved or self.publish_kind() is not Kind.PARTIAL:
            return
        limit, converted = lane.n - 1, 0
        while limit > 0 and converted < 2:  # the prompt's end and the history's end
            chain = self.pool.chain(lane.tokens, lane.tenant)
            lease = self.pool.lookup(lane.tokens, chain, kind=Kind.PARTIAL, lane=lane.id,
                                     max_n=limit, tenant=lane.tenant)
            if lease is None:
                break
            with lease:
                n, role = lease.record.n, lease.record.role
                ok = (self.ctx.restore(lane.id, lease.data, FLAGS_PARTIAL)
                      and self.ctx.seq_rm(lane.id, n, -1))
            if not ok:
                self.clear(lane)
                return
            lane.truncate(n)
            self.pool.drop_lane(lane.id, above=n)
            if role is Role.REPLAY:
                self.save(lane, role, Kind.FULL)
                converted += 1
            limit = n - 1
        lane.replay_saved = True

    def idle_save(self, lane: Lane) -> None:
        """Keep an idle lane's live state as a FULL checkpoint without cutting it back,
        so a crash loses no conversation (the pool writes full states to disk)."""
        if not lane.saved_full and lane.n and self.pool is not None:
            self.counters["idle_saves"] += 1
            self.save(lane, Role.END_OF_REPLY, Kind.FULL)

    # -- one step -------------------------------------------------------------------

    def work_for(self, job: Job, budget: int) -> Work | None:
        """The job's share of the next step, at most ``budget`` tokens."""
        lane = job.lane
        assert lane is not None
        if not job.prefilling:
            assert job.pending >= 0
            n = len(job.replay) + 1
            room = self._draft_room(job, n, budget) if job.speculate else 0
            return Work(job, n + room, lane.n, room=room)
        end = min(job.pos + budget, len(job.prompt))
        if job.publish and job.publish[0][0] < end:
            end = job.publish[0][0]  # a chunk ends where a checkpoint is published
        if end <= job.pos:
            return None
        return Work(job, end - job.pos, job.pos)

    def _draft_room(self, job: Job, n: int, budget: int) -> int:
        """Drafts a decoding job may carry: the configured length, within the step's
        budget, the lane's context and the tokens the request may still produce."""
        assert job.lane is not None
        left = job.req.sampling.max_tokens - len(job.generated) - 1
        ctx_left = self.ctx.n_ctx_seq - job.lane.n - n
        return max(0, min(self.cfg.speculative.draft_max, budget - n, left, ctx_left))

    def _tokens(self, w: Work) -> np.ndarray | list[int]:
        job = w.job
        if job.prefilling:
            return job.prompt[w.pos0: w.pos0 + w.n]
        if not len(job.replay) and not len(job.drafts):
            return [job.pending]  # a plain decode: one token
        return np.concatenate([job.replay, np.array([job.pending], dtype=np.int32),
                               job.drafts])

    def _propose(self, works: list[Work]) -> None:
        """Fill in each decoding lane's drafts (and keep a draft model's lanes in step)."""
        sc = self.cfg.speculative
        asks: list[DraftAsk] = []
        for w in works:
            job, lane = w.job, w.job.lane
            assert lane is not None
            job.drafts = _NONE
            if not job.speculate:
                continue
            # what the lane holds once this step's tokens (drafts aside) are in: a prompt
            # chunk, or the replayed tokens and ``pending``
            step = self._tokens(w)
            known = np.concatenate([lane.tokens, step])
            want = 0 if job.prefilling else w.room  # while prefilling the draft follows
            if self.draft is not None:
                asks.append(DraftAsk(lane.id, known, want, lane.tenant, step=len(step)))
            elif want:
                job.drafts = lookup_draft(known, want, sc.lookup_max, sc.lookup_min)
        if asks:
            assert self.draft is not None
            drafted = self.draft.propose(asks)
            for w in works:
                lane = w.job.lane
                assert lane is not None
                if not w.job.prefilling and lane.id in drafted:
                    w.job.drafts = drafted[lane.id][: w.room]
        for w in works:
            if not w.job.prefilling:
                w.n = len(w.job.replay) + 1 + len(w.job.drafts)

    def run_step(self, works: list[Work]) -> None:
        """One llama_decode for every work; then commit each lane on its own.

        A failed decode raises (the caller fails those lanes); a lane whose commit
        fails gets ``job.error`` and the others go on.
        """
        if self.speculation != "off":
            self._propose(works)
        batch = self.ctx.batch
        batch.clear()
        # llama.cpp splits a batch of separate lanes into ubatches of consecutive lane
        # ids (kv_unified off): in lane order, one ubatch takes every decoding lane.
        works.sort(key=lambda w: w.job.lane.id if w.job.lane is not None else -1)
        for w in works:
            job, lane = w.job, w.job.lane
            assert lane is not None
            toks = self._tokens(w)
            if job.prefilling:
                last = w.pos0 + w.n == len(job.prompt) and not job.prewarm
                row = batch.add(lane.id, toks, w.pos0, logits_last=last)
                w.row = row if last else -1
            else:
                if len(job.drafts) and self.staging:  # to undo what is rejected
                    job.staged = bytes(self.ctx.save(lane.id, FLAGS_PARTIAL))
                first = len(job.replay)
                row = batch.add(lane.id, toks, w.pos0, logits_last=True, logits_from=first)
                w.row = row - (len(toks) - 1 - first)
        self.ctx.decode()
        for w in works:
            try:
                self._commit(w)
            except Exception as exc:  # this lane alone
                log.exception("request %s failed", w.job.req.request_id)
                w.job.fail(exc)

    @staticmethod
    def decodes_alone(job: Job) -> bool:
        """Whether a step of ``job`` alone is one token and its logits: a decoding lane
        with no drafts to verify and nothing to replay (``decode_alone`` may run it)."""
        return not (job.prefilling or job.done or job.speculate or len(job.replay))

    def decode_alone(self, job: Job, more: Callable[[], bool]) -> int:
        """Decode ``job``'s lane by itself, a token per ``llama_decode``, while the job
        goes on and ``more()`` says so; returns the steps run (at least one).

        The common case of the engine (one stream, nothing else to do) without planning
        a step each time: what a step of ``run_step`` would do for this one ``Work``, so
        the tokens are the same. A failed decode raises; a failed commit sets
        ``job.error`` as in ``run_step``."""
        lane = job.lane
        assert lane is not None and self.decodes_alone(job)
        batch, decode, take, push = self.ctx.batch, self.ctx.decode, self._take, lane.push
        steps = 0
        while True:
            batch.clear()
            batch.add(lane.id, (job.pending,), lane.n, logits_last=True)
            decode()
            steps += 1
            try:
                push(job.pending)
                take(job, 0)
            except Exception as exc:  # as run_step's commit
                log.exception("request %s failed", job.req.request_id)
                job.fail(exc)
            if job.finish_reason or not more():
                return steps

    def _commit(self, w: Work) -> None:
        job, lane = w.job, w.job.lane
        assert lane is not None
        if job.prefilling:
            lane.extend(job.prompt[w.pos0: w.pos0 + w.n])
            job.stats.prefilled += w.n
            job.stats.prefill_steps += 1
            job.pos += w.n
            if job.publish and job.publish[0][0] == job.pos:
                t0 = time.perf_counter()
                while job.publish and job.publish[0][0] == job.pos:
                    _, role, kind = job.publish.pop(0)
                    self._publish(job, role, kind)
                job.stats.publish_s += time.perf_counter() - t0
            if job.prefilling:
                return
            job.t_first = time.perf_counter()
            job.stats.prefill_s = job.t_first - job.t_admitted
            if job.prewarm:  # cached, and nothing to generate
                job.finish_reason = "length"
                return
            self._take(job, w.row)
            return
        self._verify(w)

    def _verify(self, w: Work) -> None:
        """Commit a decoding lane's step: its replayed tokens and ``pending``, then each
        draft while the token sampled before it equals it; roll back the rest."""
        job, lane = w.job, w.job.lane
        assert lane is not None
        drafts = job.drafts
        if len(job.replay):
            lane.extend(job.replay)
            job.replay = _NONE
        lane.push(job.pending)
        self._take(job, w.row)
        if not len(drafts):
            return
        accepted = 0
        for i, d in enumerate(drafts.tolist()):
            if job.done or job.pending != d:
                break
            lane.push(d)
            accepted += 1
            self._take(job, w.row + 1 + i)
        job.drafts = _NONE
        job.stats.drafted += len(drafts)
        job.stats.accepted += accepted
        self.counters["spec_drafted"] += len(drafts)
        self.counters["spec_accepted"] += accepted
        self.counters["spec_verifications"] += 1
        if accepted == len(drafts):
            job.staged = None
            return
        self._reject(job, w.pos0)

    def _reject(self, job: Job, pos0: int) -> None:
        """Remove the rejected drafts from the lane's state (it holds ``lane.n`` accepted
        tokens; the step decoded more from ``pos0``)."""
        lane = job.lane
        assert lane is not None
        if not self.staging:
            # attention, SWA (every cell kept), hybrid with n_rs_seq snapshots of this
            # step's ubatch (docs/design.md fact 11: llama.cpp keeps a lane's last
            # n_rs_seq + 1 tokens in one ubatch, and the rollback keeps its first token,
            # ``pending``)
            if not self.ctx.seq_rm(lane.id, lane.n, -1):
                raise RuntimeError(f"lane {lane.id}: seq_rm refused to remove rejected drafts")
            return
        staged, job.staged = job.staged, None
        assert staged is not None
        kept = lane.tokens[pos0:].copy()
        # docs/design.md fact 7: restore the partial state first, then cut the attention cells
        if not (self.ctx.restore(lane.id, staged, FLAGS_PARTIAL)
                and self.ctx.seq_rm(lane.id, pos0, -1)):
            raise RuntimeError(f"lane {lane.id}: restoring the staged state failed")
        lane.truncate(pos0)
        self.counters["spec_replays"] += 1
        job.replay = kept  # decoded again in the next step (or at the end), without logits

    def _publish(self, job: Job, role: Role, kind: Kind) -> None:
        assert job.lane is not None
        keep = job.keep.get(job.lane.n, 0.0) if kind is Kind.FULL else 0.0
        nbytes = self.save(job.lane, role, kind, keep)
        if nbytes:
            job.stats.checkpoints_added += 1
            job.stats.checkpoint_bytes += nbytes

    def _take(self, job: Job, row: int) -> None:
        """Sample the next token and decide whether the request is done."""
        assert job.sampler is not None and job.stream is not None
        k = job.req.sampling.logprobs
        tok = job.sampler.sample(self.ctx, row)
        if k is not None:  # of the model's own distribution, before the sampler's changes
            job.logprobs.append(self._logprob(self.ctx.logits_view(row), tok, k))
        job.generated.append(tok)
        job.pending = tok
        if self.model.is_eog(tok):
            job.finish_reason = "stop"
            job.sampler.close()
            tail = job.stream.finish()
            if tail:
                job.deltas.append((tail, ()))
            return
        text = job.stream.feed(self.model.token_bytes(tok))
        if text:
            job.deltas.append((text, (tok,)))
        if job.stream.stopped:
            job.finish_reason = "stop"
        elif len(job.generated) >= job.req.sampling.max_tokens or job.stopping:
            job.finish_reason = "length"
            tail = job.stream.finish()
            if tail:
                job.deltas.append((tail, ()))
        if job.finish_reason:
            job.sampler.close()  # its chain is freed with the request (or when collected)

    def _logprob(self, logits: np.ndarray, tok: int, k: int) -> TokenLogprob:
        x = logits.astype(np.float64)
        top_logit = float(x.max())
        lse = top_logit + float(np.log(np.exp(x - top_logit).sum()))
        top: tuple[tuple[str, float], ...] = ()
        if k > 0:
            idx = np.argpartition(-x, k - 1)[:k]
            idx = idx[np.argsort(-x[idx], kind="stable")]
            top = tuple((self.model.detokenize([int(i)]), float(x[i] - lse)) for i in idx)
        return TokenLogprob(self.model.detokenize([tok]), float(x[tok] - lse), top)

    # -- the end of a request -------------------------------------------------------

    def finish(self, job: Job) -> None:
        """Publish the end-of-reply state and free the lane.

        Nothing is published from a request that failed: its lane is cleared.
        """
        lane = job.lane
        if lane is None:
            return
        try:
            if len(job.replay) and job.finish_reason in ("stop", "length"):
                # accepted tokens a rollback took out of the state: back in, so the
                # reply's end is where the next turn starts
                self.ctx.prefill(lane.id, job.replay, lane.n, logits_last=False)
                lane.extend(job.replay)
                job.replay = _NONE
            if job.finish_reason == "error":
                self.clear(lane)
            elif (job.use_cache and lane.n > job.reuse and job.finish_reason != "cancelled"
                    and self.publish_kind() is Kind.PARTIAL):
                self._publish(job, Role.END_OF_REPLY, Kind.PARTIAL)
            elif not job.use_cache:
                # a cold-only request leaves nothing reusable behind
                self.clear(lane)
        finally:
            if lane.n:  # this request's own turn starts there
                lane.history_n = min(_history(job), lane.n)
            lane.busy = False
            lane.last_used = time.monotonic()

    def shutdown(self) -> None:
        """Keep every lane's state as a FULL checkpoint (the pool writes them to disk)."""
        for lane in self.lanes:
            if not lane.busy:
                self.hand_off(lane)


def _history(job: Job) -> int:
    """The prompt's tokens before its generation prompt (all of them where unknown)."""
    h = job.req.history_tokens
    return len(job.prompt) if h is None else min(h, len(job.prompt))


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
