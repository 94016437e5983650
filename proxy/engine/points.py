"""Where a prefill publishes its checkpoints: the replay point, the first turn's end and
its share points, a client's cache breakpoints, periodic points on the grid the steps
make, and (on a hybrid, ``cache.share_grid_tokens``) share points moved onto that grid;
on a window-sized SWA cache, the points saved behind a step (``Job.behind``) and those
its lane owes (``Job.owed``). proxy/engine/publishing.py saves them; the policy by
memory kind is written there."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from proxy.engine.build import Parts
from proxy.engine.job import Job
from proxy.engine.layout import free_cuts, last_step_start, onto_grid, periodic_points
from proxy.engine.planner import choose_share_points, publish_points
from statecache.pages import PageChain
from statecache.records import Kind, Role

Points = list[tuple[int, Role, Kind]]


class PointPicker:
    def __init__(self, parts: Parts, kind: Callable[[], Kind]) -> None:
        self.p = parts
        self.kind = kind  # what a prefill publishes in the lane (Publisher.kind)

    def points(self, job: Job, match_depth: int, chain: PageChain | None) -> Points:
        """Where ``job``'s prefill publishes, and what (after it started from
        ``job.reuse`` tokens; ``match_depth``: the deepest prefix cached anywhere)."""
        p = self.p
        if p.exact:
            return self._exact(job)
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
        if not p.memory.swa_window:  # there a breakpoint goes onto the grid too
            ours += [n for n, _ in job.req.breakpoints]
        for n in self._share_points(job, chain, out):
            full_at(out, n)
        behind = p.memory.swa_window and p.chunk <= p.memory.n_swa
        if kind is Kind.PARTIAL:
            movable = [m for m, _, _ in out if m not in ours]
            if p.memory.swa_window:  # a breakpoint in the last step is owed (_owe_last_step)
                start = last_step_start([] if behind else ours, reuse=job.reuse, end=end,
                                        chunk=self.p.chunk)
                marks = {n for n, _ in job.req.breakpoints}
                movable = [m for m in movable if m <= start or m not in marks]
            if behind:
                self._behind(job, out, movable)
            else:
                self._onto_grid(job, out, movable)
        if kind is Kind.PARTIAL and p.memory.swa_window:
            self._owe_last_step(job, out)  # before the periodic points: owed, not cut
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

    def _exact(self, job: Job) -> Points:
        """cache.exact: FULL states on the grid, where the prefill's steps end anyway, and
        at the prompt's end with its logits (a regenerated reply starts there): the
        states a cold prefill passes through, saved as they stand (docs/exact.md)."""
        grid, end = self.p.grid, len(job.prompt)
        out: Points = [(n, Role.PERIODIC, Kind.FULL)
                       for n in range((job.reuse // grid + 1) * grid, end, grid)]
        if end > job.reuse:
            out.append((end, Role.REPLAY, Kind.FULL))
        return out

    def _periodic(self, job: Job, chain: PageChain | None, points: Points,
                  first: int) -> None:
        """Every ``cache.periodic_pages`` pages of a long prefill, on the grid its steps
        make (``layout.periodic_points``): inside the first turn (an agent's system
        prompt) FULL, so a prompt edited further on starts there in any lane; beyond it
        in the lane's kind, and none where that kind is FULL (full states grow)."""
        p = self.p
        kind = self.kind()
        every = p.cfg.cache.periodic_pages * p.page
        chunk = self.p.chunk
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

    def _owe_last_step(self, job: Job, points: Points) -> None:
        """A window-sized SWA cache: the points inside the prefill's last step (a client's
        breakpoint, the history's end) would each cut a step short. The lane owes them
        instead (a share point there went down to the step's start: it is for other
        conversations, in other lanes, which a lane's debt does not reach): cut back
        less than a step, its cells still reach a window (``planner.window_reaches``),
        so it serves them live, and it is cut back to each and saved FULL when it is
        handed off (``Publisher._pay_owed``), while it still reaches them. The prompt's
        end keeps its PARTIAL checkpoint (no step ends early there)."""
        end = len(job.prompt)
        start = last_step_start([n for n, _, _ in points], reuse=job.reuse, end=end,
                                chunk=self.p.chunk)
        tail = [(n, r) for n, r, _ in points if start < n < end]
        if not tail:
            return
        points[:] = [pt for pt in points if not start < pt[0] < end]
        job.owed = sorted(job.owed + [(n, r, job.keep.get(n, 0.0)) for n, r in tail],
                          key=lambda o: o[0])

    def _behind(self, job: Job, points: Points, shared: list[int]) -> None:
        """A window-sized SWA cache whose window is at least a step: the points before
        the last step that no whole step from ``job.reuse`` ends at are saved behind the
        step that passes them (``Publisher.save_behind``: its cells reach a window back
        from each), not cut there and not moved. So the prefill goes in whole steps, as
        llama-server's ubatches, and gives up no reuse. In the last step, the points
        for other conversations (``shared``: the first turn's end, share points) are
        saved behind it once the first token is written; the lane owes the others
        (``_owe_last_step``). Those on the grid end a step anyway."""
        chunk, end = self.p.chunk, len(job.prompt)
        start = last_step_start([], reuse=job.reuse, end=end, chunk=chunk)
        off = [pt for pt in points if job.reuse < pt[0] <= start and (pt[0] - job.reuse) % chunk
               or start < pt[0] < end and pt[0] in shared]
        if off:
            points[:] = [pt for pt in points if pt not in off]
            job.behind = sorted(job.behind + off, key=lambda pt: pt[0])

    def _onto_grid(self, job: Job, points: Points, movable: list[int]) -> None:
        """``cache.share_grid_tokens``: on a hybrid, each of ``movable`` (the first turn's
        end, its share points) at most that far past the end of the step it falls in goes
        down to that end, where it cuts no step short (bench.share_grid measures the steps
        saved and the reuse given up). A window-sized SWA cache moves every one, and a
        client's breakpoints too (kept for their ttl where they went): its points in the
        last step are owed instead (``_owe_last_step``), and a cut anywhere else costs a
        step of llama_decode that llama-server does not take, unless the prefill's steps
        had room for it (``free_cuts``): those stay where they are."""
        within = self.p.cfg.cache.share_grid_tokens
        kept = [n for n, _, _ in points if n not in movable]
        if self.p.memory.swa_window:
            within = max(within, self.p.chunk)
            free = free_cuts(movable, kept, reuse=job.reuse, end=len(job.prompt),
                             chunk=self.p.chunk)
            kept += free
            movable = [n for n in movable if n not in free]
        if not within or not movable:
            return
        moved = onto_grid(movable, kept, reuse=job.reuse, chunk=self.p.chunk, within=within)
        points[:] = [pt for pt in points if pt[0] not in moved]
        for n, g in moved.items():
            ttl = job.keep.pop(n, 0.0)  # a breakpoint's: kept where it went
            if g:
                full_at(points, g)
                if ttl:
                    job.keep[g] = max(job.keep.get(g, 0.0), ttl)
        self.p.meter.share_points_on_grid.inc(by=len(moved))

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
        if points is None:  # a step ends there now: not saved behind one as well
            job.behind = [b for b in job.behind if b[0] != at]
        return at


def full_at(points: Points, n: int) -> None:
    """A FULL checkpoint at ``n`` in ``points`` (kept sorted)."""
    for i, (m, _role, kind) in enumerate(points):
        if m == n:
            if kind is not Kind.FULL:
                points[i] = (n, Role.BRANCH, Kind.FULL)
            return
    points.append((n, Role.BRANCH, Kind.FULL))
    points.sort(key=lambda p: p[0])
