"""The engine's invariants, checked between steps when ``engine.sanity_checks`` is on
(the tests turn it on; it costs a pass over every lane's tokens a step):

- every lane's tokens are exactly what its llama.cpp sequence holds (its last position
  is its token count less one; an empty lane holds none), and the checkpoints it owes
  lie within them, in order (only where a live lane can be cut back: anywhere, or a
  window-sized SWA lane within its last step);
- the busy lanes are the lanes of the running requests, one each;
- nothing rejected was committed: a prefilling request's lane holds its prompt so far;
  a decoding one's holds its prompt and every generated token but the one not yet
  decoded (less the accepted tokens a staged rollback will decode again), and no
  drafts are left over;
- a running request holds no lease on a checkpoint (its plan's were released);
- the checkpoint pool's own invariants (``CheckpointPool.sanity_check``).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from proxy.engine.build import Parts
from proxy.engine.job import Job


def sanity_check(p: Parts, active: Sequence[Job]) -> None:
    """Raise RuntimeError naming the first broken invariant."""
    for lane in p.lanes:
        if p.ctx.pos_max(lane.id) != lane.n - 1:
            raise RuntimeError(f"lane {lane.id} holds {lane.n} tokens but its sequence ends "
                               f"at position {p.ctx.pos_max(lane.id)}")
        owed = [n for n, _, _ in lane.owed]
        if owed != sorted(owed) or (owed and not (owed[0] > 0 and owed[-1] <= lane.n)) or \
                (owed and p.memory.partial_rollback and not p.memory.swa_window):
            raise RuntimeError(f"lane {lane.id} ({lane.n} tokens) owes checkpoints at "
                               f"{owed}: not within it, not in order, or on a memory that "
                               "cannot cut a live lane back")
    running = [job for job in active if not job.done]
    lanes = [job.lane.id for job in running if job.lane is not None]
    if len(lanes) != len(set(lanes)):
        raise RuntimeError(f"two running requests share a lane: {sorted(lanes)}")
    busy = {lane.id for lane in p.lanes if lane.busy}
    if set(lanes) != busy:
        raise RuntimeError(f"running requests in lanes {sorted(lanes)}, busy {sorted(busy)}")
    for job in running:
        _check_job(job)
    if p.pool is not None:
        p.pool.sanity_check()


def _check_job(job: Job) -> None:
    lane, rid = job.lane, job.req.request_id
    if lane is None:
        raise RuntimeError(f"request {rid} runs without a lane")
    if job.wait.prefetched is not None:
        raise RuntimeError(f"request {rid} runs holding a checkpoint it read")
    if len(job.spec.drafts):
        raise RuntimeError(f"request {rid} has drafts left over after its step")
    if job.prefilling:
        want = job.prompt[: job.pos]
    else:
        gen = np.asarray(job.out.generated[:-1], dtype=np.int32)
        held = np.concatenate([job.prompt, gen])
        want = held[: len(held) - len(job.spec.replay)]
        if len(job.spec.replay) and not np.array_equal(job.spec.replay,
                                                       held[len(want):]):
            raise RuntimeError(f"request {rid}: its replayed tokens are not its last ones")
    if not np.array_equal(lane.tokens, want):
        raise RuntimeError(f"request {rid}: lane {lane.id} holds other tokens than its "
                           "prompt and accepted reply")
