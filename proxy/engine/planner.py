"""The plan for one request: which lane, what state to start from, where to save.

Pure decisions over lanes and the pool; the engine carries them out. The rules:

- Reuse at most ``len(prompt) - 1`` tokens: the state holds no logits, so at least
  one prompt token must be decoded to sample the first output token.
- A live lane is reused as is when its tokens are a prefix of the prompt. Cutting
  it back needs a memory that can roll back there: plain attention always can; an
  SWA lane can while its cells reach back a window (never below a restored full
  state's own position, fact 8); a recurrent or hybrid lane only by restoring one of
  its partial checkpoints and then removing the tail (fact 7, in that order).
- Otherwise a full checkpoint from the pool (RAM first, then disk) goes into an
  empty free lane, else the session's own lane, else the least recently used one;
  else that lane starts cold.
- The longest reuse wins; at equal length a live lane beats RAM beats disk.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from proxy.engine.binding import MemoryInfo, MemoryKind
from proxy.engine.lanes import Lane
from statecache.lease import Lease
from statecache.pages import PageChain
from statecache.pool import CheckpointPool
from statecache.records import Kind, Role


class Source(enum.Enum):
    COLD = "cold"
    LANE = "lane"
    RAM = "ram"
    DISK = "disk"


@dataclass(slots=True)
class Plan:
    lane: Lane
    source: Source
    reuse: int  # prompt tokens the lane holds once the plan's restore/truncate is done
    truncate: bool = False  # seq_rm(lane, reuse, -1) on the live state
    partial: Lease | None = None  # restore into the lane, then seq_rm(reuse, -1)
    full: Lease | None = None  # restore into the (cleared) lane
    role: str = ""  # role of the checkpoint used
    publish: list[tuple[int, Role]] = field(default_factory=list)
    match_depth: int = 0  # deepest prefix shared with anything cached

    def release(self) -> None:
        for lease in (self.partial, self.full):
            if lease is not None:
                lease.close()


def can_truncate(memory: MemoryInfo, lane: Lane, n: int, pos_min: Callable[[int], int]) -> bool:
    """Whether the live state of ``lane`` can be cut back to ``n`` tokens with seq_rm."""
    if n >= lane.n:
        return True
    if memory.kind is MemoryKind.ATTENTION:
        return True
    if memory.kind is MemoryKind.SWA:
        # llama-server's rule: the cells the window of token n needs must still be there
        return n >= lane.floor and pos_min(lane.id) <= max(0, n - memory.n_swa)
    return False


def _lane_option(
    lane: Lane, prompt: np.ndarray, limit: int, tenant: str, memory: MemoryInfo,
    pool: CheckpointPool | None, chain: PageChain | None, pos_min: Callable[[int], int],
) -> Plan | None:
    common = min(lane.common(prompt, tenant), limit)
    if common == 0:
        return None
    if common == lane.n:
        return Plan(lane, Source.LANE, common, role="live")
    if can_truncate(memory, lane, common, pos_min):
        return Plan(lane, Source.LANE, common, truncate=True, role="live")
    if pool is None or chain is None or not memory.needs_partial:
        return None
    lease = pool.lookup(prompt, chain, kind=Kind.PARTIAL, lane=lane.id, max_n=common,
                        tenant=tenant)
    if lease is None:
        return None
    n = lease.record.n
    if n < lane.floor:
        lease.close()
        return None
    return Plan(lane, Source.LANE, n, partial=lease, role=lease.record.role.value)


def make_plan(
    prompt: np.ndarray,
    chain: PageChain | None,
    free: Sequence[Lane],
    *,
    tenant: str,
    memory: MemoryInfo,
    pool: CheckpointPool | None,
    pos_min: Callable[[int], int],
    all_lanes: Sequence[Lane] = (),
) -> Plan:
    """Choose where a prompt starts from. ``free`` must not be empty."""
    assert free, "make_plan needs a free lane"
    limit = max(len(prompt) - 1, 0)
    best: Plan | None = None
    for lane in free:
        option = _lane_option(lane, prompt, limit, tenant, memory, pool, chain, pos_min)
        if option is not None and (best is None or option.reuse > best.reuse):
            if best is not None:
                best.release()
            best = option
        elif option is not None:
            option.release()
    if pool is not None and chain is not None and limit > (best.reuse if best else 0):
        lease = pool.lookup(prompt, chain, kind=Kind.FULL, max_n=limit, tenant=tenant)
        if lease is not None and lease.record.n > (best.reuse if best else 0):
            if best is not None:
                best.release()
            # an empty lane keeps every live state; else the session's own lane (its
            # state is stale anyway), else the least recently used
            target = max(free, key=lambda ln: (ln.n == 0, ln.common(prompt, tenant),
                                               -ln.last_used))
            source = Source.RAM if lease.tier == "ram" else Source.DISK
            best = Plan(target, source, lease.record.n, full=lease,
                        role=lease.record.role.value)
        elif lease is not None:
            lease.close()
    if best is None:
        best = Plan(min(free, key=lambda ln: ln.last_used), Source.COLD, 0)
    others = all_lanes or free
    best.match_depth = max([best.reuse] + [min(ln.common(prompt, tenant), limit) for ln in others])
    return best


def publish_points(
    *, reuse: int, limit: int, replay_at: int, match_depth: int, page: int, every_pages: int,
) -> list[tuple[int, Role]]:
    """Positions (after ``reuse``, at most ``limit``) where prefill saves a checkpoint.

    The replay point is the last whole page at or before the generation prompt; the
    branch point the last whole page before this prompt left the deepest cached
    match; periodic ones every ``every_pages`` pages of a long prompt.
    """
    points: dict[int, Role] = {}
    if every_pages > 0:
        step = every_pages * page
        for n in range((reuse // step + 1) * step, limit + 1, step):
            points[n] = Role.PERIODIC
    branch = (match_depth // page) * page
    if reuse < branch <= limit and match_depth < limit:
        points[branch] = Role.BRANCH
    replay = (min(replay_at, limit) // page) * page
    if reuse < replay <= limit:
        points[replay] = Role.REPLAY
    return sorted(points.items())
