"""Where and what to checkpoint: the points a prefill publishes, saving a lane's state,
handing a lane's state to the pool before it is cut back or replaced, idle saves.

Checkpoint policy by memory kind (docs/design.md facts 5-9):

- hybrid / recurrent: the recurrent state cannot roll back, so prefill publishes
  small PARTIAL checkpoints in the lane (replay, periodic) and the reply's end gets
  one too; a later turn rolls the lane back by restoring one, then ``seq_rm``
  (docs/design.md fact 7, in that order). FULL states are saved when the lane is
  handed to another prompt, when it has been idle a while, and at shutdown; the lane's
  replay points become FULL ones on hand-off too.
- SWA (Gemma 3): the context keeps every SWA cell of a live lane (``swa_full``), so
  ``seq_rm`` rolls a live lane back; partial states would be most of the KV anyway
  (docs/design.md fact 4). FULL states at the replay point and on hand-off; a restored
  one is never cut below its own position (docs/design.md fact 8).
- plain attention: ``seq_rm`` rolls back anywhere; FULL states at the replay point
  and on hand-off.
- every kind: a BRANCH point (where this prompt leaves a prefix that another
  conversation holds, or that another request being admitted shares) is FULL, so
  any lane can start from it: an agent's subagents share the system prompt. So are the
  share points of a prompt's first turn, a client's cache breakpoints (kept for their
  ttl) and the end of a pre-warm's prompt.
"""

from __future__ import annotations

import mmap
import time

import numpy as np

from proxy.engine.binding import FLAGS_FULL, FLAGS_PARTIAL, MemoryKind
from proxy.engine.build import Parts
from proxy.engine.job import Job
from proxy.engine.lanes import Lane
from proxy.engine.planner import (
    can_truncate,
    choose_share_points,
    onto_grid,
    periodic_points,
    publish_points,
)
from statecache.pages import PageChain
from statecache.records import Kind, Owner, Role

PREVIEW_TOKENS = 24
Points = list[tuple[int, Role, Kind]]


class Publisher:
    def __init__(self, parts: Parts) -> None:
        self.p = parts

    # -- where a prefill publishes ---------------------------------------------------

    def points(self, job: Job, match_depth: int, chain: PageChain | None) -> Points:
        """Where ``job``'s prefill publishes, and what (after it started from
        ``job.reuse`` tokens; ``match_depth``: the deepest prefix cached anywhere)."""
        p = self.p
        limit = len(job.prompt) - 1
        replay_at = job.req.history_tokens if job.req.history_tokens is not None else limit
        d = job.req.divergence
        if d is not None and d.replayed:
            # this client sent the last reply back as generated: its next turn continues
            # from the reply's end, not from before the generation prompt. No cut there
            # (a cut costs a step, about a pass over the weights)
            replay_at = 0
        points = publish_points(reuse=job.reuse, limit=limit, replay_at=replay_at,
                                match_depth=match_depth, page=p.page)
        kind = self.kind()
        first = self._first_turn_end(job)
        out: Points = [(n, r, Kind.FULL if r is Role.BRANCH else kind) for n, r in points]
        end = len(job.prompt)
        if kind is Kind.PARTIAL and end > job.reuse and (not out or out[-1][0] < end):
            # a lane that cannot roll back keeps the state at the prompt's end too, with
            # the logits of its last row, so a repeated or regenerated request reuses all
            # of it and decodes nothing again (the prompt's last chunk ends there anyway)
            out.append((end, Role.REPLAY, Kind.PARTIAL))
        # the first turn's end in FULL: every subagent starts there, in any lane
        at = (first // p.page) * p.page
        ours = [m for m, _, _ in out]
        if at > job.reuse and at >= 2 * p.page and not self.has_full(job, chain, at):
            self.share_point(job, at, out)
        self._client_breakpoints(job, chain, out)
        ours += [n for n, _ in job.req.breakpoints]
        for n in self._share_points(job, chain, out):
            full_at(out, n)
        if kind is Kind.PARTIAL:
            self._onto_grid(job, out, [m for m, _, _ in out if m not in ours])
        self._periodic(job, chain, out, first)
        if kind is Kind.FULL:
            # a live lane is cut back with seq_rm (attention; SWA, whose live lane keeps
            # every cell): the prefill stops nowhere (its steps stay whole), and the lane
            # owes these checkpoints until it is cut back or replaced
            job.owed = [(n, r, job.keep.get(n, 0.0)) for n, r, _ in out]
            out = []
        if job.prewarm and len(job.prompt) > job.reuse:
            full_at(out, len(job.prompt))  # what comes next starts from the prompt
        return out

    def _periodic(self, job: Job, chain: PageChain | None, points: Points,
                  first: int) -> None:
        """Every ``cache.periodic_pages`` pages of a long prefill, on the grid its steps
        make (``planner.periodic_points``): inside the first turn (an agent's system
        prompt) FULL, so a prompt edited further on starts there in any lane; beyond it
        in the lane's kind, and none where that kind is FULL (full states grow)."""
        p = self.p
        kind = self.kind()
        every = p.cfg.cache.periodic_pages * p.page
        chunk = self.chunk()
        taken = {m for m, _, _ in points}
        for n in periodic_points(sorted(taken), reuse=job.reuse, limit=len(job.prompt) - 1,
                                 every=every, chunk=chunk):
            if n in taken:
                continue
            if n <= first:
                if not self.has_full(job, chain, n):
                    points.append((n, Role.PERIODIC, Kind.FULL))
            elif kind is not Kind.FULL:
                points.append((n, Role.PERIODIC, kind))
        points.sort(key=lambda pt: pt[0])

    def _onto_grid(self, job: Job, points: Points, movable: list[int]) -> None:
        """``cache.share_grid_tokens``: on a hybrid, each of ``movable`` (the first turn's
        end, its share points) at most that far past the end of the step it falls in goes
        down to that end, where it cuts no step short (bench.share_grid measures the steps
        saved and the reuse given up)."""
        within = self.p.cfg.cache.share_grid_tokens
        if not within or not movable:
            return
        kept = [n for n, _, _ in points if n not in movable]
        moved = onto_grid(movable, kept, reuse=job.reuse, chunk=self.chunk(), within=within)
        points[:] = [pt for pt in points if pt[0] not in moved]
        for g in moved.values():
            if g:
                full_at(points, g)
        self.p.meter.count("share_points_on_grid", len(moved))

    def chunk(self) -> int:
        """Prompt tokens of one lane per step: where a prefill's steps end."""
        cfg = self.p.cfg
        return min(cfg.engine.prefill_chunk or self.p.step_tokens, self.p.step_tokens)

    def _client_breakpoints(self, job: Job, chain: PageChain | None, points: Points) -> None:
        """A client's cache breakpoints: a FULL checkpoint at each one this request
        prefills, kept for its ttl; one the pool holds already is kept longer."""
        pool = self.p.pool
        assert pool is not None and chain is not None
        for n, ttl in job.req.breakpoints:
            if n > len(job.prompt) or n < 1:
                continue
            if n > job.reuse and (n < len(job.prompt) or job.prewarm):
                full_at(points, n)
                job.keep[n] = max(job.keep.get(n, 0.0), ttl)
            else:
                pool.keep(chain, n, ttl, tenant=job.req.tenant)

    def _share_points(self, job: Job, chain: PageChain | None, points: Points) -> list[int]:
        """Where new conversations may share this prompt (its first turn's message and
        part starts, ``GenerationRequest.share_points``): at most ``cache.share_points``
        of them get a FULL checkpoint, largest gaps first. The gap of a point is how far
        it lies past the nearest FULL state at or before it (this request's start, its
        other FULL checkpoints, the pool's): what a conversation that parts there would
        prefill again without it. Points within a page of such a state are skipped."""
        p = self.p
        k = p.cfg.cache.share_points
        limit = len(job.prompt) - 1
        cands = sorted({n for n in job.req.share_points
                        if job.reuse < n <= limit and n >= 2 * p.page})
        if not k or not cands:
            return []
        anchors = [job.reuse] + [n for n, _, kind in points if kind is Kind.FULL]
        todo: list[int] = []
        for n in cands:
            (anchors if self.has_full(job, chain, n) else todo).append(n)
        chosen = choose_share_points(todo, anchors, k=k, page=p.page)
        p.meter.share_points.inc(by=len(chosen))
        return chosen

    def _first_turn_end(self, job: Job) -> int:
        """Tokens of the prompt's first turn, up to its first end-of-turn token (0: none)."""
        hits = np.flatnonzero(np.isin(job.prompt[: len(job.prompt) - 1], self.p.eog))
        return int(hits[0]) + 1 if hits.size else 0

    def has_full(self, job: Job, chain: PageChain | None, n: int) -> bool:
        """Whether the pool holds the FULL state after the prompt's first ``n`` tokens
        (its index only: nothing is read)."""
        assert self.p.pool is not None and chain is not None
        return self.p.pool.holds(chain, n, tenant=job.req.tenant)

    def share_point(self, job: Job, shared: int, points: Points | None = None) -> int:
        """Make ``job`` publish a FULL checkpoint at the last whole page of ``shared``
        tokens, for another request that starts the same way; returns that position
        (0 when there is none to wait for)."""
        page = self.p.page
        pts = job.publish if points is None else points
        at = (min(shared, len(job.prompt) - 1) // page) * page
        if at <= job.pos or self.p.pool is None or not job.use_cache:
            return 0
        full_at(pts, at)
        return at

    def ensure_full(self, job: Job) -> None:
        """Save the job's lane in FULL now (it holds a prefix another request waits for),
        unless the pool has that state already."""
        pool = self.p.pool
        assert job.lane is not None and pool is not None
        # the lane holds the first job.pos tokens of the prompt (it is prefilling)
        chain = pool.chain(job.prompt, job.req.tenant)
        if not self.has_full(job, chain, job.lane.n):
            self.publish(job, Role.BRANCH, Kind.FULL)

    # -- saving ----------------------------------------------------------------------

    def kind(self) -> Kind:
        """What a prefill publishes in the lane: PARTIAL where the memory cannot roll
        back by itself (recurrent, hybrid), else FULL."""
        m = self.p.memory
        return Kind.PARTIAL if m.needs_partial and m.kind is not MemoryKind.SWA else Kind.FULL

    def publish(self, job: Job, role: Role, kind: Kind) -> None:
        """Save ``job``'s lane as it stands, counted in the request's stats."""
        assert job.lane is not None
        keep = job.keep.get(job.lane.n, 0.0) if kind is Kind.FULL else 0.0
        nbytes = self.save(job.lane, role, kind, keep)
        if nbytes:
            job.stats.checkpoints_added += 1
            job.stats.checkpoint_bytes += nbytes

    def save(self, lane: Lane, role: Role, kind: Kind, keep_s: float = 0.0,
             older: bool = False) -> int:
        """Publish the lane's current state (with the logits of its last row where the
        lane kept them: a prompt's end); returns the bytes stored (0 if refused).
        ``keep_s``: a client asked to keep it that long (a cache breakpoint). A FULL
        state is written into a buffer the pool keeps as it is (RAM keeps the newest
        state of a conversation whole), unless it is ``older`` than one just saved."""
        p = self.p
        if p.pool is None or lane.n == 0:
            return 0
        flags = FLAGS_PARTIAL if kind is Kind.PARTIAL else FLAGS_FULL
        owned = kind is Kind.FULL and not older and p.pool.keeps_whole
        data: memoryview | mmap.mmap
        if owned:
            data = p.pool.state_buffer(p.ctx.state_size(lane.id, flags))
            p.ctx.save_into(lane.id, data, flags)
        else:
            data = p.ctx.save(lane.id, flags)
        preview = p.model.detokenize(lane.tokens[-PREVIEW_TOKENS:].tolist())
        rec = p.pool.insert(kind=kind, owner=Owner.TARGET,
                            lane=lane.id if kind is Kind.PARTIAL else None,
                            tokens=lane.tokens, role=role, data=data, tenant=lane.tenant,
                            preview=preview, keep_s=keep_s, logits=lane.logits_at(lane.n),
                            owned=owned)
        if rec is None:
            return 0
        p.meter.count("checkpoints_saved")
        p.meter.count("checkpoint_bytes_saved", rec.nbytes)
        if kind is Kind.FULL:
            lane.saved_full = True
        if p.draft is not None:  # the draft's partial state where it stands the same
            p.draft.checkpoint(lane.id, lane.tokens, lane.tenant, role)
        return rec.nbytes

    def clear(self, lane: Lane) -> None:
        """Forget the lane's state and its partial checkpoints."""
        self.p.ctx.clear_lane(lane.id)
        lane.clear()
        if self.p.pool is not None:
            self.p.pool.drop_lane(lane.id)

    # -- hand-off --------------------------------------------------------------------

    def hand_off_unless_replaced(self, lane: Lane, job: Job, *, cut: int = 0,
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
            self.p.meter.count("replaced_replies")
            return
        self.hand_off_timed(lane, job, cut=cut, convert_replay=convert_replay)

    def hand_off_timed(self, lane: Lane, job: Job, *, cut: int = 0,
                       convert_replay: bool = True) -> None:
        t0 = time.perf_counter()
        self.hand_off(lane, cut=cut, convert_replay=convert_replay)
        job.stats.handoff_s += time.perf_counter() - t0

    def hand_off(self, lane: Lane, *, cut: int = 0, convert_replay: bool = True) -> None:
        """Before a lane's state is cut back to ``cut`` tokens or replaced (0), keep it as
        a FULL checkpoint, and take the checkpoints it owes above ``cut``.

        On a hybrid, the lane's replay points (partial checkpoints: the history's end
        and the prompt's end, with its logits) become FULL ones too: restore each,
        deepest first, cut the tail, save. The lane ends cut back.
        """
        p = self.p
        if p.pool is None or lane.n == 0:
            return
        if not lane.saved_full:
            p.meter.count("handoffs")
            # a lane ends where its last request's reply ended
            self.save(lane, Role.END_OF_REPLY, Kind.FULL)
        self._pay_owed(lane, cut)
        if not convert_replay or lane.replay_saved or self.kind() is not Kind.PARTIAL:
            return
        limit, converted = lane.n - 1, 0
        while limit > 0 and converted < 2:  # the prompt's end and the history's end
            chain = p.pool.chain(lane.tokens, lane.tenant)
            lease = p.pool.lookup(lane.tokens, chain, kind=Kind.PARTIAL, lane=lane.id,
                                  max_n=limit, tenant=lane.tenant)
            if lease is None:
                break
            with lease:
                n, role = lease.record.n, lease.record.role
                ok = (p.ctx.restore(lane.id, lease.data, FLAGS_PARTIAL)
                      and p.ctx.seq_rm(lane.id, n, -1))
            if not ok:
                self.clear(lane)
                return
            lane.truncate(n)
            if lease.logits is not None:
                lane.keep_logits(lease.logits)
            p.pool.drop_lane(lane.id, above=n)
            if role is Role.REPLAY:
                self.save(lane, role, Kind.FULL, older=True)
                converted += 1
            limit = n - 1
        lane.replay_saved = True

    def _pay_owed(self, lane: Lane, cut: int) -> None:
        """The FULL checkpoints the lane owes above ``cut`` (Lane.owed), deepest first:
        the live lane cut back to each and saved there. Nothing is prefilled again; the
        lane ends cut back to the shallowest of them. One within a page above the cut is
        left: the lane keeps the state at the cut live, a page short of it."""
        p = self.p
        due = [o for o in lane.owed if cut + (p.page if cut else 0) <= o[0] < lane.n]
        if not due or p.pool is None:
            return
        chain = p.pool.chain(lane.tokens, lane.tenant)
        for n, role, keep_s in reversed(due):
            if p.pool.holds(chain, n, tenant=lane.tenant) or \
                    not can_truncate(p.memory, lane, n, p.ctx.pos_min):
                continue
            if not p.ctx.seq_rm(lane.id, n, -1):
                self.clear(lane)  # the lane no longer holds what it says: nothing of it
                return
            lane.truncate(n)
            self.save(lane, role, Kind.FULL, keep_s, older=True)
            p.meter.count("owed_checkpoints")

    def idle_save(self, lane: Lane) -> None:
        """Keep an idle lane's live state as a FULL checkpoint without cutting it back,
        so a crash loses no conversation (the pool writes full states to disk)."""
        if not lane.saved_full and lane.n and self.p.pool is not None:
            self.p.meter.count("idle_saves")
            self.save(lane, Role.END_OF_REPLY, Kind.FULL)

    def shutdown(self) -> None:
        """Keep every lane's state as a FULL checkpoint (the pool writes them to disk)."""
        for lane in self.p.lanes:
            if not lane.busy:
                self.hand_off(lane)


def full_at(points: Points, n: int) -> None:
    """A FULL checkpoint at ``n`` in ``points`` (kept sorted)."""
    for i, (m, _role, kind) in enumerate(points):
        if m == n:
            if kind is not Kind.FULL:
                points[i] = (n, Role.BRANCH, Kind.FULL)
            return
    points.append((n, Role.BRANCH, Kind.FULL))
    points.sort(key=lambda p: p[0])
