"""The plan for one request: which lane, what state to start from, where to save.

Pure decisions over lanes and the pool; the engine carries them out. The rules:

- Reuse the whole prompt only from a state that kept the logits of its last row (a
  live lane whose last prefill ended there, a checkpoint saved at a prompt's end): the
  first output token is sampled from them and nothing is decoded again. Any other
  state is reused up to ``len(prompt) - 1`` tokens: one prompt token is decoded to
  sample the first output token.
- A live lane is reused as is when its tokens are a prefix of the prompt. Cutting
  it back needs a memory that can roll back there: plain attention always can; an
  SWA lane can while its cells reach back a window (never below a restored full
  state's own position, docs/design.md fact 8); a recurrent or hybrid lane only by
  restoring one of its partial checkpoints and then removing the tail (docs/design.md
  fact 7, in that order).
- Otherwise a full checkpoint from the pool (RAM, disk, or the shared store of
  ``[cache.remote]``) goes into the lane of the request's conversation when the
  client names it (``session``), else an empty free lane, else the lane whose state
  shares most with the prompt, else the least recently used one; a cold start takes the
  conversation's lane, else the least recently used one.
- Each option costs its fetch plus the prefill of the tokens after it
  (``statecache.costs``: measured read bandwidth per tier, measured prefill rate);
  the cheapest wins. A RAM copy and a live lane fetch nothing, so among them the
  longest reuse wins; a disk or remote copy is read only when fetching it is cheaper
  than prefilling the tokens it saves. At equal cost a live lane beats RAM beats the
  tier read faster (disk before the store, by their priors). The plan's ``estimate``
  says what was chosen and why.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from proxy.engine.binding import MemoryInfo, MemoryKind
from proxy.engine.grid import exact_at, exact_offers
from proxy.engine.lanes import Lane
from statecache.costs import Costs, Estimate
from statecache.pages import PageChain
from statecache.pool import CheckpointPool, Offer
from statecache.pool.lease import Lease
from statecache.records import Kind, Role


class Source:
    """Where a plan's state comes from: ``COLD``, a live ``LANE``, or the name of the
    tier its checkpoint was read from (``Lease.tier``)."""

    COLD = "cold"
    LANE = "lane"


@dataclass(slots=True)
class Plan:
    lane: Lane
    source: str  # a Source, or a tier's name
    reuse: int  # prompt tokens the lane holds once the plan's restore/truncate is done
    truncate: bool = False  # seq_rm(lane, reuse, -1) on the live state
    partial: Lease | None = None  # restore into the lane, then seq_rm(reuse, -1)
    full: Lease | None = None  # restore into the (cleared) lane
    # the logits after the whole prompt (``reuse == len(prompt)``): the first token's
    logits: np.ndarray | None = None
    role: str = ""  # role of the checkpoint used
    publish: list[tuple[int, Role]] = field(default_factory=list)
    match_depth: int = 0  # deepest prefix shared with anything cached
    estimate: str = ""  # the cost estimate behind a restore (for the Started line)
    # with ``defer_reads``: the disk or remote state this plan would read; the engine
    # fetches it on another thread and plans again, so the streams that are decoding
    # never wait for a read
    fetch: Offer | None = None
    chain: PageChain | None = None  # the prompt's page hashes (None without the cache)
    plan_s: float = 0.0  # how long planning took

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
        return window_reaches(memory, lane, n, pos_min)
    return False


def window_reaches(memory: MemoryInfo, lane: Lane, n: int, pos_min: Callable[[int], int]) -> bool:
    """Whether an SWA lane's sequence, cut back to ``n`` with seq_rm, still holds the
    cells the window of token ``n`` needs (llama-server's rule; a window-sized SWA cache
    overwrites the oldest ones), and ``n`` is not below a restored state's own position
    (docs/design.md fact 8)."""
    return n >= lane.floor and pos_min(lane.id) <= max(0, n - memory.n_swa)


def _lane_option(
    lane: Lane, prompt: np.ndarray, limit: int, tenant: str, memory: MemoryInfo,
    pool: CheckpointPool | None, chain: PageChain | None, pos_min: Callable[[int], int],
) -> Plan | None:
    reach = lane.common(prompt, tenant)
    end = len(prompt)
    if reach >= end > 0:  # the lane holds the whole prompt: with its logits, all of it
        logits = lane.logits_at(end)
        if logits is not None and (end == lane.n or can_truncate(memory, lane, end, pos_min)):
            return Plan(lane, Source.LANE, end, truncate=end < lane.n, logits=logits,
                        role="live")
    common = min(reach, limit)
    if common == 0:
        return None
    if common == lane.n:
        return Plan(lane, Source.LANE, common, role="live")
    if can_truncate(memory, lane, common, pos_min):
        return Plan(lane, Source.LANE, common, truncate=True, role="live")
    if pool is None or chain is None or not memory.needs_partial:
        return None
    lease = _with_logits(pool.lookup(prompt, chain, kind=Kind.PARTIAL, lane=lane.id,
                                     max_n=min(reach, end), tenant=tenant), end)
    if lease is None and reach >= end:  # the prompt's end kept no logits: one short
        lease = pool.lookup(prompt, chain, kind=Kind.PARTIAL, lane=lane.id, max_n=limit,
                            tenant=tenant)
    if lease is None:
        return None
    n = lease.record.n
    if n < lane.floor:
        lease.close()
        return None
    return Plan(lane, Source.LANE, n, partial=lease, role=lease.record.role.value,
                logits=lease.logits if n == end else None)


def _exact_lane_option(lane: Lane, prompt: np.ndarray, limit: int, tenant: str,
                       memory: MemoryInfo, grid: int) -> Plan | None:
    """cache.exact: the live lane as a cold prefill would have left it, or nothing. It
    holds that state for its first ``Lane.grid_n`` tokens; the prompt starts there on the
    grid, or is all there with the logits of its last row (a regenerated reply). Only
    plain attention is cut back in place (docs/exact.md)."""
    reach, end = min(lane.common(prompt, tenant), lane.grid_n), len(prompt)
    cut_ok = memory.kind is MemoryKind.ATTENTION
    if reach >= end > 0 and lane.logits_at(end) is not None and (end == lane.n or cut_ok):
        return Plan(lane, Source.LANE, end, truncate=end < lane.n, logits=lane.logits_at(end),
                    role="live")
    n = min(reach, limit) // grid * grid
    if n == 0 or (n < lane.n and not cut_ok):
        return None
    return Plan(lane, Source.LANE, n, truncate=n < lane.n, role="live")


def _with_logits(lease: Lease | None, end: int) -> Lease | None:
    """``lease``, unless it holds the whole prompt (``end`` tokens) without the logits
    that sample its first token (closed then)."""
    if lease is not None and lease.record.n >= end and lease.logits is None:
        lease.close()
        return None
    return lease


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
    held: Lease | None = None,
    defer_reads: bool = False,
    session: str | None = None,
    grid: int = 0,
) -> Plan:
    """Choose where a prompt starts from. ``free`` must not be empty.

    ``held``: a FULL state already read for this prompt (fetched in the background); it
    counts as a copy in memory, and the plan takes it over (uses or closes it).
    ``defer_reads``: a plan that would read from disk or the shared store says so in
    ``fetch`` instead of reading (its lane and source are then what it would do now).
    ``session``: the client's name for the conversation; its lane is taken first.
    ``grid`` (cache.exact: model.n_ubatch): only states a cold prefill writes, at points
    where it would be (``exact_at``)."""
    assert free, "make_plan needs a free lane"
    end = len(prompt)  # a state there needs its logits (Plan.logits)
    limit = max(end - 1, 0)
    best: Plan | None = None
    for lane in free:
        option = _exact_lane_option(lane, prompt, limit, tenant, memory, grid) if grid else \
            _lane_option(lane, prompt, limit, tenant, memory, pool, chain, pos_min)
        if option is not None and (best is None or option.reuse > best.reuse):
            if best is not None:
                best.release()
            best = option
        elif option is not None:
            option.release()
    if held is not None:
        n = held.record.n
        usable = (n <= limit or (n == end and held.logits is not None)) and \
            (not grid or exact_at(n, end, grid))
        if n > (best.reuse if best else 0) and usable and held.record.matches(prompt):
            if best is not None:
                best.release()
            best = Plan(_lane_for_restore(free, prompt, tenant, session), held.tier, n,
                        full=held, role=held.record.role.value,
                        logits=held.logits if n == end else None,
                        estimate=f"read in the background ({held.tier})")
        else:
            held.close()
    if pool is not None and chain is not None and end > (best.reuse if best else 0):
        have = best.reuse if best else 0
        offers = exact_offers(pool, prompt, chain, have, grid, tenant) if grid else \
            [o for o in pool.full_offers(prompt, chain, max_n=end, tenant=tenant) if o.n > have]
        current = pool.costs.estimate(best.source if best else Source.COLD, have, 0,
                                      len(prompt))
        for est, offer in rank(offers, pool.costs, len(prompt)):
            if est.total_s >= current.total_s:
                break  # prefilling what this one saves is cheaper than fetching it
            if defer_reads and offer.read:
                if best is None:
                    best = Plan(cold_lane(free, session), Source.COLD, 0)
                best.fetch = offer
                break
            lease = _with_logits(pool.take(offer, prompt, chain, tenant=tenant), end)
            if lease is None and offer.n == end and offer.hit is None and not grid:
                # the state at the prompt's end kept no logits: the deepest one short of it
                lease = pool.take(dataclasses.replace(offer, n=limit), prompt, chain,
                                  tenant=tenant)
            if lease is not None and grid and not exact_at(lease.record.n, end, grid):
                lease.close()  # the offer was evicted since: a shallower state came instead
                lease = None
            if lease is None:
                continue  # gone, or refused by its checks: the next option
            if lease.record.n <= have:
                lease.close()
                continue
            if best is not None:
                best.release()
            target = _lane_for_restore(free, prompt, tenant, session)
            got = pool.costs.estimate(lease.tier, lease.record.n, lease.record.nbytes,
                                      len(prompt))
            best = Plan(target, lease.tier, lease.record.n, full=lease,
                        role=lease.record.role.value,
                        logits=lease.logits if lease.record.n == end else None,
                        estimate=got.describe(pool.costs.estimate(Source.COLD, 0, 0,
                                                                  len(prompt)).total_s))
            break
    if best is None:
        best = Plan(cold_lane(free, session), Source.COLD, 0)
    others = all_lanes or free
    best.match_depth = max([best.reuse] + [min(ln.common(prompt, tenant), limit) for ln in others])
    return best


def _own(lane: Lane, session: str | None) -> bool:
    return session is not None and lane.session == session


def _lane_for_restore(free: Sequence[Lane], prompt: np.ndarray, tenant: str,
                      session: str | None = None) -> Lane:
    # the conversation's own lane (its state is stale anyway); an empty lane keeps every
    # live state; else the lane that shares most, else the least recently used
    return max(free, key=lambda ln: (_own(ln, session), ln.n == 0, ln.common(prompt, tenant),
                                     -ln.last_used))


def cold_lane(free: Sequence[Lane], session: str | None = None) -> Lane:
    """The lane a cold start takes: the conversation's own, else the least recently used."""
    return max(free, key=lambda ln: (_own(ln, session), -ln.last_used))


def rank(offers: Sequence[Offer], costs: Costs, prompt: int) -> list[tuple[Estimate, Offer]]:
    """Offers by estimated time to the first token, cheapest first (ties: the tier read
    faster, RAM, which is not read, first)."""
    def faster(o: Offer) -> float:
        bw = costs.bandwidth(o.tier)
        return -math.inf if bw is None else -bw

    ranked = [(costs.estimate(o.tier, o.n, o.nbytes, prompt), o) for o in offers]
    ranked.sort(key=lambda eo: (eo[0].total_s, faster(eo[1]), -eo[1].n))
    return ranked


def publish_points(
    *, reuse: int, limit: int, replay_at: int, match_depth: int, page: int,
) -> list[tuple[int, Role]]:
    """Positions (after ``reuse``, at most ``limit``) where prefill saves a checkpoint.

    The replay point is the last whole page at or before the generation prompt; the
    branch point the last whole page before this prompt left the deepest cached
    match. Periodic points are placed after every other point (``periodic_points``).
    """
    points: dict[int, Role] = {}
    branch = (match_depth // page) * page
    if reuse < branch <= limit and match_depth < limit:
        points[branch] = Role.BRANCH
    replay = (min(replay_at, limit) // page) * page
    if reuse < replay <= limit:
        points[replay] = Role.REPLAY
    return sorted(points.items())


def choose_share_points(cands: Sequence[int], anchors: Sequence[int], *, k: int,
                        page: int) -> list[int]:
    """At most ``k`` of ``cands`` (sorted, each past the first anchor), largest gap first:
    a point's gap is how far it lies past the nearest anchor (a FULL state) at or before
    it, what a conversation that parts there would prefill again without it. A chosen
    point is an anchor for the rest; none within a page of an anchor is taken."""
    have = list(anchors)
    todo = list(cands)
    chosen: list[int] = []

    def gap(n: int) -> int:
        return n - max(a for a in have if a <= n)

    while todo and len(chosen) < k:
        best = max(todo, key=gap)
        if gap(best) < page:
            break
        todo.remove(best)
        have.append(best)
        chosen.append(best)
    return chosen
