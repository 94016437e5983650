"""Speculative decoding: where drafts come from, and a draft model kept in step.

A decoding lane's share of a step becomes a verification: the token it sampled last
plus up to ``speculative.draft_max`` drafted tokens, all with logits, in the same
``llama_decode`` as every other lane (proxy/engine/executor.py checks them and rolls
the rejected ones back). Drafts come from one of two sources:

- **prompt lookup** (``source = "lookup"``): the longest n-gram (``lookup_max`` down
  to ``lookup_min`` tokens) that ends the lane's tokens and occurred earlier in them,
  in the prompt or in the reply so far, proposes the tokens that followed it there
  (and where they run into the end, the same period again: a loop goes on).
  It needs no model, and pays off when a reply repeats what it was shown (an agent
  re-emitting code it read).
- **a draft model** (``source = "draft"``, ``model.draft_path``): a second, smaller
  llama context with one lane per target lane. Before each step it decodes what it
  lacks of its target lane's tokens (at most ``catch_up`` tokens a step, so a long
  prompt or a restored state costs it a few steps, not a stall), then drafts greedily,
  one batched decode per drafted position for all lanes, and stops a lane's draft
  where its likeliest token's probability falls below ``draft_min_p``.

Drafts are deterministic (a lookup, the draft's argmax: q(x) = 1), so the standard
speculative-sampling rule (accept x with probability min(1, p(x)/q(x)) = p(x), else
draw from max(0, p - q), i.e. p without x) is the same as drawing the target's token
at each row with the request's own sampler chain and accepting while it equals the
draft: the output distribution is the target's, greedy output is the target's argmax.

The draft model's rollback (docs/design.md fact 13: llama-server's draft context cannot roll a
hybrid draft back and keeps stale positions; here every ``seq_rm`` is checked):

- plain attention or SWA draft: ``seq_rm``; nothing of it is ever saved (docs/design.md fact 9).
- recurrent or hybrid draft: before drafting, the lane's recurrent state is staged
  (a partial save in memory); a rejection restores it and cuts the tail (docs/design.md fact 7),
  and the accepted tokens are decoded again with the next catch-up. Its checkpoints
  are partial-only, taken where the target publishes one, kept per lane in the
  pool (owner ``draft``), so a lane the target rolls back at a new turn finds the
  draft's state there too. ``n_rs_seq`` snapshots cannot help a draft that decodes
  one token per ``llama_decode`` (docs/design.md fact 11: a rollback must keep the first token of
  the last ubatch).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from proxy.engine.binding import (
    FLAGS_PARTIAL,
    Context,
    ContextParams,
    MemoryKind,
    Model,
)
from proxy.engine.lanes import LaneSet
from proxy.meters import EngineMeter
from statecache.config import SpeculativeConfig
from statecache.pages import common_prefix
from statecache.pool import CheckpointPool
from statecache.records import Kind, Owner, Role

log = logging.getLogger(__name__)

LOOKUP_WINDOW = 65536  # most recent tokens prompt lookup searches


def lookup_draft(tokens: np.ndarray, k: int, n_max: int = 4, n_min: int = 2,
                 history: np.ndarray | None = None) -> np.ndarray:
    """Prompt lookup: up to ``k`` tokens that followed the latest earlier occurrence of
    the longest n-gram (``n_max`` down to ``n_min`` tokens) that ends ``tokens`` (``k``
    exactly where they run into the end: they repeat, ``_repeat``); where
    ``tokens`` has none, the same n-gram's latest occurrence in ``history`` (the replies
    of the conversation's earlier requests, ``History``)."""
    return lookup(tokens, k, n_max, n_min, history)[0]


def lookup(tokens: np.ndarray, k: int, n_max: int = 4, n_min: int = 2,
           history: np.ndarray | None = None, cursor: int = -1
           ) -> tuple[np.ndarray, int, int]:
    """``lookup_draft``, where in ``tokens`` its drafts start (-1: from ``history`` or
    none), and how many tokens the match covers (``n_min`` for a cursor's copy, 0 for
    none). ``cursor``: where in ``tokens`` the last drafts' copy goes on (the text a
    reply is copying, past what it accepted); while the copy holds there (its ``n_min``
    tokens before it end ``tokens`` too) the drafts come from there, whatever else
    matches: a file re-emitted line by line repeats short n-grams everywhere."""
    n_tok = len(tokens)
    if n_tok < n_min + 1 or k <= 0:
        return NO_DRAFT, -1, 0
    if n_min <= cursor < n_tok - 1 and \
            np.array_equal(tokens[cursor - n_min: cursor], tokens[n_tok - n_min:]):
        return _repeat(tokens[cursor: cursor + k], k), cursor, n_min
    off = max(n_tok - LOOKUP_WINDOW, 0)
    hist = tokens[off:]
    found, start, matched = _follows(hist, len(hist) - 1, hist, k, n_max, n_min)
    if len(found):  # (the lane's tokens hold no separator: shorter than k only at the end)
        return _repeat(found, k), start + off, matched
    if history is not None and len(history):
        found, _, matched = _follows(history, len(history), hist, k, n_max, n_min)
        return found, -1, matched
    return NO_DRAFT, -1, 0


NO_DRAFT = np.empty(0, dtype=np.int32)


def _repeat(copied: np.ndarray, k: int) -> np.ndarray:
    """``k`` drafts from ``copied``, the lane's tokens after a match (at most ``k``).
    Fewer than ``k`` means the copy ran into the end: the text repeats with that period
    (a match that close to the end says so: a loop, a rule of dashes, a run of blank
    lines), so the drafts go on repeating it rather than stop there, as a lookup that
    searched again after each draft would."""
    out = copied if len(copied) == k else np.resize(copied, k)  # (resize repeats it)
    return out.astype(np.int32, copy=True)


def _follows(hay: np.ndarray, n_ends: int, tail: np.ndarray, k: int, n_max: int,
             n_min: int) -> tuple[np.ndarray, int, int]:
    """Up to ``k`` tokens of ``hay`` after the latest of the longest matches (``n_min``
    to ``n_max`` tokens) of ``tail``'s end that ends before ``hay[n_ends]``, where they
    start, and the match's length."""
    n_tail = len(tail)
    # positions holding the last token, then how far back each match reaches: a few
    # array operations, whatever the length
    ends = np.flatnonzero(hay[:n_ends] == tail[-1])
    length = np.ones(ends.size, dtype=np.int32)
    alive = np.ones(ends.size, dtype=bool)
    for j in range(1, min(n_max, n_tail)):
        back = ends - j
        alive &= back >= 0
        alive[alive] = hay[back[alive]] == tail[n_tail - 1 - j]
        if not alive.any():
            break
        length += alive
    longest = int(length.max()) if ends.size else 0
    if longest < n_min:
        return NO_DRAFT, -1, 0
    best = int(np.flatnonzero(length == longest)[-1])  # the latest of the longest
    start = int(ends[best]) + 1
    out = hay[start: start + k]
    cut = np.flatnonzero(out < 0)  # History's separator: a reply's end
    return (out[: cut[0]] if cut.size else out).astype(np.int32, copy=True), start, longest


class History:
    """The replies of recent conversations, for prompt lookup: a request may re-emit what
    an earlier request of its conversation produced but its prompt no longer holds (a
    regenerated answer, a client that drops or compacts earlier turns, the reasoning a
    template leaves out of later turns, a subagent's output). Per conversation (tenant
    and the client's session name), the last ``tokens`` tokens of its replies, separated;
    ``sessions`` conversations at most, the least recently used forgotten first. At most
    ``sessions * tokens`` int32s: 4 MiB by default. Engine thread only."""

    def __init__(self, sessions: int = 64, tokens: int = 16384) -> None:
        self.sessions = sessions
        self.tokens = tokens
        self._held: OrderedDict[tuple[str, str], np.ndarray] = OrderedDict()

    def get(self, tenant: str, session: str | None) -> np.ndarray | None:
        key = (tenant, session or "")
        held = self._held.get(key)
        if held is not None:
            self._held.move_to_end(key)
        return held

    def add(self, tenant: str, session: str | None, reply: Sequence[int]) -> None:
        if len(reply) < 2 or self.sessions <= 0 or self.tokens <= 0:
            return
        key = (tenant, session or "")
        new = np.asarray(reply, dtype=np.int32)
        held = self._held.pop(key, None)
        joined = new if held is None else np.concatenate([held, SEPARATOR, new])
        self._held[key] = joined[-self.tokens:]
        while len(self._held) > self.sessions:
            self._held.popitem(last=False)


SEPARATOR = np.array([-1], dtype=np.int32)  # between two replies: no match runs across


def check_same_vocab(target: Model, draft: Model) -> None:
    """ValueError unless the draft tokenizes and detokenizes exactly as the target."""
    if draft.n_vocab != target.n_vocab:
        raise ValueError(f"the draft model's vocabulary has {draft.n_vocab:,} tokens, the "
                         f"target's {target.n_vocab:,}: a draft must share the target's "
                         "vocabulary")
    for t in range(target.n_vocab):
        if draft.token_bytes(t) != target.token_bytes(t):
            raise ValueError(f"the draft model's token {t} is "
                             f"{draft.token_bytes(t)!r}, the target's "
                             f"{target.token_bytes(t)!r}: a draft must share the target's "
                             "vocabulary")


@dataclass(slots=True)
class DraftAsk:
    """What one target lane needs from the draft model this step."""

    lane: int
    tokens: np.ndarray  # the tokens the target lane will hold once this step's work is in
    want: int  # tokens to draft after them (0: only keep up, e.g. while prefilling)
    tenant: str = ""
    step: int = 0  # tokens the target lane takes in this step: the draft follows them


class DraftModel:
    """A draft model's context: lane i follows target lane i. Engine thread only."""

    def __init__(self, path: Path, target: Model, cfg: SpeculativeConfig, *, lanes: int,
                 n_ctx: int, step_tokens: int, threads: int, pool: CheckpointPool | None,
                 n_gpu_layers: int = -1, verbose: bool = False,
                 threads_of: Context | None = None, meter: EngineMeter | None = None) -> None:
        self.model = Model(path, n_gpu_layers=n_gpu_layers, verbose=verbose)
        try:
            check_same_vocab(target, self.model)
            self.cfg = cfg
            self.catch_up = max(cfg.catch_up, cfg.draft_max + 1)
            self.followed = 0  # tokens the last propose decoded to follow its target lanes
            # a step's tokens of every lane, plus a catch-up of each lane that lags
            n_batch = step_tokens + lanes * (self.catch_up + cfg.draft_max + 1)
            self.ctx = Context(self.model, ContextParams(
                n_ctx=n_ctx * lanes, n_seq_max=lanes, n_batch=n_batch, n_ubatch=n_batch,
                n_rs_seq=0, threads=threads))
            if threads_of is not None:  # the target's persistent threadpool, if it has one
                self.ctx.share_threads(threads_of)
        except BaseException:
            self.model.close()
            raise
        self.memory = self.ctx.describe_memory()
        self.recurrent = self.memory.kind in (MemoryKind.HYBRID, MemoryKind.RECURRENT)
        self.lanes = LaneSet(lanes)
        self.pool = pool
        self._staged: list[tuple[int, bytes] | None] = [None] * lanes
        self.meter = meter if meter is not None else EngineMeter()
        m = self.meter  # its families are shown from the start, at 0
        for event in ("rollbacks", "restores", "clears", "checkpoints"):
            m.draft_events.inc(event, by=0)
        for what in ("tokens_decoded", "checkpoint_bytes"):
            m.draft_total.inc(what, by=0)

    # -- keeping up -------------------------------------------------------------------

    def behind(self, lane_id: int, tokens: np.ndarray, tenant: str) -> int:
        """Tokens of ``tokens`` the draft lane would decode before it could draft (at
        least: a recurrent draft rolls back to a checkpoint at or before its match)."""
        lane = self.lanes.lanes[lane_id]
        n = common_prefix(lane.tokens, tokens) if lane.tenant == tenant else 0
        return len(tokens) - n

    def propose(self, asks: list[DraftAsk]) -> dict[int, np.ndarray]:
        """Bring each asked lane up to its target tokens (a chunk at most), then draft
        ``want`` tokens for each lane that got there; lane -> drafts."""
        batch = self.ctx.batch
        batch.clear()
        rows: dict[int, int] = {}
        for ask in asks:
            lane = self.lanes.lanes[ask.lane]
            n = common_prefix(lane.tokens, ask.tokens)
            if n < lane.n or lane.tenant != ask.tenant:
                self._rollback(ask.lane, n if lane.tenant == ask.tenant else 0, ask)
            missing = ask.tokens[lane.n: lane.n + self.catch_up + ask.step]
            if not len(missing):
                continue
            synced = lane.n + len(missing) == len(ask.tokens)
            row = batch.add(ask.lane, missing, lane.n, logits_last=synced and ask.want > 0)
            lane.extend(missing)
            lane.tenant = ask.tenant
            if synced and ask.want > 0:
                rows[ask.lane] = row
        self.followed = batch.n  # tokens decoded to follow the target lanes, this step
        if batch.n:
            self.meter.draft_total.inc("tokens_decoded", by=batch.n)
            self.ctx.decode()
        out: dict[int, list[int]] = {}
        for ask in asks:
            if ask.lane in rows:
                tok = self._pick(rows[ask.lane])
                if tok >= 0:
                    out[ask.lane] = [tok]
                    if self.recurrent:
                        self._stage(ask.lane)
        want = {ask.lane: ask.want for ask in asks}
        while True:
            going = [ln for ln, d in out.items() if len(d) < want[ln] and d[-1] >= 0]
            if not going:
                break
            batch.clear()
            for ln in going:
                lane = self.lanes.lanes[ln]
                rows[ln] = batch.add(ln, [out[ln][-1]], lane.n, logits_last=True)
                lane.push(out[ln][-1])
            self.meter.draft_total.inc("tokens_decoded", by=batch.n)
            self.ctx.decode()
            for ln in going:
                out[ln].append(self._pick(rows[ln]))
        return {ln: np.array([t for t in d if t >= 0], dtype=np.int32)
                for ln, d in out.items()}

    def _pick(self, row: int) -> int:
        """The draft's likeliest token, or -1 when its probability is below draft_min_p."""
        logits = self.ctx.logits_view(row)
        tok = int(np.argmax(logits))
        if self.cfg.draft_min_p > 0:
            top = float(logits[tok])
            p = 1.0 / float(np.exp(logits.astype(np.float64) - top).sum())
            if p < self.cfg.draft_min_p:
                return -1
        return tok

    # -- rolling back -----------------------------------------------------------------

    def _stage(self, lane_id: int) -> None:
        lane = self.lanes.lanes[lane_id]
        self._staged[lane_id] = (lane.n, bytes(self.ctx.save(lane_id, FLAGS_PARTIAL)))

    def _rollback(self, lane_id: int, n: int, ask: DraftAsk) -> None:
        """Cut draft lane ``lane_id`` back to at most ``n`` tokens."""
        lane = self.lanes.lanes[lane_id]
        self.meter.draft_events.inc("rollbacks")
        if n > 0 and not self.recurrent:
            if self.ctx.seq_rm(lane_id, n, -1):
                lane.truncate(n)
                return
        elif n > 0:
            staged = self._staged[lane_id]
            if staged is not None and staged[0] <= n and self._restore(lane_id, staged[1],
                                                                        staged[0]):
                return
            if self._restore_checkpoint(lane_id, n, ask):
                return
        self.clear(lane_id)

    def _restore(self, lane_id: int, data: bytes | memoryview, n: int) -> bool:
        lane = self.lanes.lanes[lane_id]
        # docs/design.md fact 7: the partial state first, then the attention cells past it
        if self.ctx.restore(lane_id, data, FLAGS_PARTIAL) and self.ctx.seq_rm(lane_id, n, -1):
            lane.truncate(n)
            self._drop_above(lane_id, n)
            return True
        return False

    def _restore_checkpoint(self, lane_id: int, n: int, ask: DraftAsk) -> bool:
        if self.pool is None:
            return False
        tokens = ask.tokens[:n]
        chain = self.pool.chain(tokens, ask.tenant)
        lease = self.pool.lookup(tokens, chain, kind=Kind.PARTIAL, owner=Owner.DRAFT,
                                 lane=lane_id, max_n=n, tenant=ask.tenant)
        if lease is None:
            return False
        with lease:
            m = lease.record.n
            lane = self.lanes.lanes[lane_id]
            if lane.n < m or not np.array_equal(lane.tokens[:m], tokens[:m]):
                return False  # the draft lane no longer holds the cells below it
            ok = self._restore(lane_id, lease.data, m)
        if ok:
            self.meter.draft_events.inc("restores")
        return ok

    def _drop_above(self, lane_id: int, n: int) -> None:
        staged = self._staged[lane_id]
        if staged is not None and staged[0] > n:
            self._staged[lane_id] = None
        if self.pool is not None:
            self.pool.drop_lane(lane_id, above=n, owner=Owner.DRAFT)

    def clear(self, lane_id: int) -> None:
        self.meter.draft_events.inc("clears")
        self.ctx.clear_lane(lane_id)
        self.lanes.lanes[lane_id].clear()
        self._drop_above(lane_id, -1)

    # -- checkpoints ------------------------------------------------------------------

    def checkpoint(self, lane_id: int, tokens: np.ndarray, tenant: str, role: Role) -> int:
        """Where the target publishes a checkpoint after ``tokens``: keep the draft lane's
        partial state there too, if it holds exactly those tokens (a plain-attention
        draft keeps nothing: ``seq_rm`` rolls it back). Returns the bytes stored."""
        lane = self.lanes.lanes[lane_id]
        if (self.pool is None or not self.recurrent or lane.n != len(tokens) or lane.n == 0
                or lane.tenant != tenant or not np.array_equal(lane.tokens, tokens)):
            return 0
        data = self.ctx.save(lane_id, FLAGS_PARTIAL)
        rec = self.pool.insert(kind=Kind.PARTIAL, owner=Owner.DRAFT, lane=lane_id,
                               tokens=lane.tokens, role=role, data=data, tenant=tenant)
        if rec is None:
            return 0
        self.meter.draft_events.inc("checkpoints")
        self.meter.draft_total.inc("checkpoint_bytes", by=rec.nbytes)
        return rec.nbytes

    def close(self) -> None:
        self.ctx.close()
        self.model.close()
