"""What to checkpoint and when: saving a lane's state, handing it to the pool before the
lane is cut back or replaced, idle saves (where a prefill publishes: points.py).

Checkpoint policy by memory kind (docs/design.md facts 5-9):

- hybrid / recurrent: the recurrent state cannot roll back, so prefill publishes
  small PARTIAL checkpoints in the lane (replay, periodic) and the reply's end gets
  one too; a later turn rolls the lane back by restoring one, then ``seq_rm``
  (docs/design.md fact 7, in that order). FULL states are saved when the lane is
  handed to another prompt, when it has been idle a while, and at shutdown; the lane's
  replay points become FULL ones on hand-off too.
- SWA (Gemma 3, gpt-oss), by default a window-sized SWA cache as llama-server keeps
  (``model.swa_full`` false): the SWA cache is rolled back like a hybrid's recurrent
  state (a PARTIAL state is the SWA cache alone, docs/design.md fact 25), so the policy
  is the hybrid's; ``seq_rm`` alone only where the lane's cells still reach a window
  back (``planner.can_truncate``). A prefill ends no step early: its share points and
  breakpoints are saved behind the steps that pass them (``save_behind``, where the
  window is at least a step; else they stay where they cost no step, or go down onto
  the step grid), and the history's end and breakpoints inside its last step are owed
  by the lane, as with every cell kept, while its cells reach them (points.py).
- SWA keeping every cell (``model.swa_full`` true, as exact mode has it): ``seq_rm``
  rolls a live lane back; partial states would be most of the KV anyway (docs/design.md
  fact 4). FULL states at the replay point and on hand-off; a restored one is never
  cut below its own position (docs/design.md fact 8).
- plain attention: ``seq_rm`` rolls back anywhere; FULL states at the replay point
  and on hand-off.
- every kind: a BRANCH point (where this prompt leaves a prefix that another
  conversation holds, or that another request being admitted shares) is FULL, so
  any lane can start from it: an agent's subagents share the system prompt. So are the
  share points of a prompt's first turn, a client's cache breakpoints (kept for their
  ttl) and the end of a pre-warm's prompt.
"""

from __future__ import annotations

import logging
import mmap
import time

from proxy.engine.binding import FLAGS_FULL, FLAGS_PARTIAL, StateBuffer
from proxy.engine.build import Parts
from proxy.engine.job import Job
from proxy.engine.lanes import Lane
from proxy.engine.planner import can_truncate, window_reaches
from proxy.engine.points import PointPicker
from statecache.kvpages.cut import state_at
from statecache.kvpages.layout import Unparsed
from statecache.records import Kind, Owner, Role

log = logging.getLogger(__name__)

PREVIEW_TOKENS = 24


class Publisher:
    def __init__(self, parts: Parts) -> None:
        self.p = parts
        self.where = PointPicker(parts, self.kind)  # where a prefill publishes
        self._before: dict[int, StateBuffer] = {}  # each lane's save before a step


    def ensure_full(self, job: Job) -> None:
        """Save the job's lane in FULL now (it holds a prefix another request waits for),
        unless the pool has that state already."""
        pool = self.p.pool
        assert job.lane is not None and pool is not None
        # the lane holds the first job.pos tokens of the prompt (it is prefilling)
        chain = pool.chain(job.prompt, job.req.tenant)
        if not self.where.has_full(job, chain, job.lane.n):
            self.publish(job, Role.BRANCH, Kind.FULL)

    # -- saving ----------------------------------------------------------------------

    def kind(self) -> Kind:
        """What a prefill publishes in the lane: PARTIAL where the memory cannot roll
        back by itself (recurrent, hybrid, a window-sized SWA cache), else FULL."""
        return Kind.PARTIAL if self.p.memory.partial_rollback else Kind.FULL

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
        nbytes = self._insert(lane, lane.n, role, kind, data, keep_s, owned)
        if nbytes and kind is Kind.FULL:
            lane.saved_full = True
        if nbytes and p.draft is not None:  # the draft's partial state where it stands
            p.draft.checkpoint(lane.id, lane.tokens, lane.tenant, role)
        return nbytes

    def _insert(self, lane: Lane, n: int, role: Role, kind: Kind,
                data: memoryview | mmap.mmap | bytearray, keep_s: float, owned: bool) -> int:
        """Hand the pool ``data``, the state after the lane's first ``n`` tokens (with
        the logits the lane kept there); the bytes it stored (0 if refused)."""
        p = self.p
        assert p.pool is not None
        tokens = lane.tokens[:n]
        preview = p.model.detokenize(tokens[-PREVIEW_TOKENS:].tolist())
        rec = p.pool.insert(kind=kind, owner=Owner.TARGET,
                            lane=lane.id if kind is Kind.PARTIAL else None,
                            tokens=tokens, role=role, data=data, tenant=lane.tenant,
                            preview=preview, keep_s=keep_s, logits=lane.logits_at(n),
                            owned=owned)
        if rec is None:
            return 0
        p.meter.checkpoints_saved.inc()
        p.meter.checkpoint_bytes_saved.inc(by=rec.nbytes)
        return rec.nbytes

    # -- behind a step (a window-sized SWA cache) ----------------------------------------

    def before_step(self, lane: Lane, first: int) -> memoryview | None:
        """The lane's SWA cache (its PARTIAL state) before a step that passes checkpoints
        saved behind it, the first at ``first``: ``save_behind`` takes the first cells of
        their windows from it. None where the lane's cells do not reach a window back
        from ``first`` (a restored state's floor): those are lost."""
        p = self.p
        if not window_reaches(p.memory, lane, first, p.ctx.pos_min):
            return None
        buf = self._before.setdefault(lane.id, StateBuffer())
        return p.ctx.save(lane.id, FLAGS_PARTIAL, buf)

    def save_behind(self, job: Job) -> None:
        """The checkpoints ``job``'s last step passed (``Job.behind`` below ``job.pos``),
        each the lane's state at its position as a step ending there would have left
        it: the cells before it from a save after the step, the first cells of its
        window from the save before it (``Job.before``; statecache/kvpages/cut.py,
        ``state_at``). So the prefill ends no step early for them; the saves cost what
        a checkpoint there costs, and a copy of the state more."""
        p, lane, before = self.p, job.lane, job.before
        assert lane is not None
        due = []
        while job.behind and job.behind[0][0] < job.pos:
            due.append(job.behind.pop(0))
        job.before = None
        if p.pool is None:
            return
        for kind, flags, sections in ((Kind.FULL, FLAGS_FULL, 2), (Kind.PARTIAL, FLAGS_PARTIAL, 1)):
            mine = [(n, role) for n, role, k in due if k is kind]
            if not mine:
                continue
            after = p.ctx.save(lane.id, flags)  # iSWA: the base cache, then the SWA cache
            for n, role in mine:
                try:
                    if before is None:
                        raise ValueError("no save before the step")
                    parts = state_at(after, before, n, sections=sections, n_swa=p.memory.n_swa)
                except (Unparsed, ValueError) as e:
                    log.warning("no checkpoint at %d behind the step: %s", n, e)
                    p.meter.behind_checkpoints_lost.inc()
                    continue
                size = sum(memoryview(x).nbytes for x in parts)
                owned = kind is Kind.FULL and p.pool.keeps_whole
                data: mmap.mmap | bytearray = p.pool.state_buffer(size) if owned \
                    else bytearray(size)
                at = 0
                for x in parts:
                    m = memoryview(x).cast("B")
                    data[at:at + m.nbytes] = m
                    at += m.nbytes
                keep = job.keep.get(n, 0.0) if kind is Kind.FULL else 0.0
                nbytes = self._insert(lane, n, role, kind, data, keep, owned)
                if nbytes:
                    job.stats.checkpoints_added += 1
                    job.stats.checkpoint_bytes += nbytes
                    p.meter.behind_checkpoints.inc()

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
            self.p.meter.replaced_replies.inc()
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
        if p.pool is None or lane.n == 0 or p.exact:  # exact: only what prefill wrote
            return
        if not lane.saved_full:
            p.meter.handoffs.inc()
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
            if p.pool.holds(chain, n, tenant=lane.tenant):
                continue
            if not can_truncate(p.memory, lane, n, p.ctx.pos_min):
                p.meter.owed_checkpoints_lost.inc()
                continue
            if not p.ctx.seq_rm(lane.id, n, -1):
                self.clear(lane)  # the lane no longer holds what it says: nothing of it
                return
            lane.truncate(n)
            self.save(lane, role, Kind.FULL, keep_s, older=True)
            p.meter.owed_checkpoints.inc()

    def forget_unreachable(self, lane: Lane) -> None:
        """A window-sized SWA lane forgets what it owes below the reach of its cells: it
        has gone on too far to be cut back there (counted as lost)."""
        p = self.p
        if not p.memory.swa_window or not lane.owed:
            return
        kept = [o for o in lane.owed if can_truncate(p.memory, lane, o[0], p.ctx.pos_min)]
        p.meter.owed_checkpoints_lost.inc(by=len(lane.owed) - len(kept))
        lane.owed = kept

    def idle_save(self, lane: Lane) -> None:
        """Keep an idle lane's live state as a FULL checkpoint without cutting it back,
        so a crash loses no conversation (the pool writes full states to disk)."""
        if not lane.saved_full and lane.n and self.p.pool is not None and not self.p.exact:
            self.save(lane, Role.END_OF_REPLY, Kind.FULL)
            # counted once the pool holds it and has handed it to its stores: a count
            # seen to rise means the save is queued for the shared tier or written there
            self.p.meter.idle_saves.inc()

    def shutdown(self) -> None:
        """Keep every lane's state as a FULL checkpoint (the pool writes them to disk)."""
        for lane in self.p.lanes:
            if not lane.busy:
                self.hand_off(lane)

