"""Build what the engine runs on, from the config: the model, the context and its lanes,
the checkpoint pool, the draft model, and how rejected drafts roll back (chosen once
here, for every room that needs it).

``Parts`` is that set, shared by the rooms (restore, publishing, placement, the step,
speculation, emit): each reads the same context, lanes, pool and meter.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from proxy.engine.binding import (
    Context,
    ContextParams,
    MemoryInfo,
    Model,
    supports_rs_rollback,
)
from proxy.engine.drafting import DraftModel
from proxy.engine.lanes import LaneSet
from proxy.engine.sizing import choose_n_ctx, state_format
from proxy.meters import EngineMeter
from statecache.config import Config
from statecache.pool import CheckpointPool
from statecache.sizes import format_size

log = logging.getLogger("statecache")


@dataclass(slots=True, eq=False)
class Parts:
    """What the engine's rooms share; built once by ``build``."""

    cfg: Config
    model: Model
    params: ContextParams
    ctx: Context
    memory: MemoryInfo
    pool: CheckpointPool | None
    draft: DraftModel | None
    lanes: LaneSet
    meter: EngineMeter  # the engine's counters (proxy/meters.py)
    page: int  # tokens of a page (cache.page_size)
    step_tokens: int  # tokens of one step, every lane together
    why_n_ctx: str  # how the lanes' context was sized (the startup line)
    # "off", "lookup" or "draft": where drafts come from
    speculation: str
    # how rejected drafts leave the target lane: seq_rm where the memory can cut its
    # tail back (attention, SWA kept whole, a hybrid's n_rs_seq snapshots); else the
    # lane's partial state is staged before a verification and restored after
    rs_snapshots: bool
    staging: bool
    eog: np.ndarray  # end-of-turn tokens: the first one in a prompt ends its first turn
    # cache.exact: restores and prefill steps on the grid of ``grid`` tokens (n_ubatch),
    # one lane a step, no speculation (docs/exact.md)
    exact: bool = False
    grid: int = 512
    # when a lane was last used and how long it has been idle (engine.idle_save_s: its
    # save, a pre-warm taking it): a test holds it still or moves it on
    clock: Callable[[], float] = time.monotonic

    @property
    def n_ctx(self) -> int:
        """Tokens per lane."""
        return self.ctx.n_ctx_seq

    @property
    def chunk(self) -> int:
        """Prompt tokens of one lane per step (``engine.prefill_chunk``, at most a step):
        the size of a prefill's whole steps (``layout.step_ends``)."""
        return min(self.cfg.engine.prefill_chunk or self.step_tokens, self.step_tokens)


def build(cfg: Config, model_path: Path) -> Parts:
    mc, ec, sc = cfg.model, cfg.engine, cfg.speculative
    model = Model(model_path, n_gpu_layers=mc.n_gpu_layers, verbose=cfg.log.llama_verbose)
    meter = EngineMeter()
    lanes = cfg.server.lanes
    n_ctx, why = choose_n_ctx(model, cfg)
    step = ec.step_tokens or mc.n_batch
    if step < lanes:
        raise ValueError(f"engine.step_tokens ({step}) must hold one token per lane ({lanes})")
    n_rs_seq = mc.n_rs_seq
    # "auto" stages: n_rs_seq snapshots make every decode dearer, drafted or not (10% on
    # hybrid-mid, bench.speculative's rollback table), where a staged state costs only
    # the verifications; adaptive drafting rests where drafts do not pay, and a resting
    # lane should cost nothing
    rollback = sc.rollback if sc.rollback != "auto" else "staged"
    exact = cfg.cache.exact
    if exact and sc.source != "off":
        # a verification's rows are arithmetic of their own (docs/speculative.md): exact
        # mode never drafts
        log.info("cache.exact: speculative decoding is off")
        sc = dataclasses.replace(sc, source="off")
    drafting_model = sc.source in ("draft", "auto") and bool(mc.draft_path)
    if sc.source != "off" and rollback == "snapshots" and supports_rs_rollback(model):
        # a verification's rejected drafts roll back through the hybrid memory's
        # per-token snapshots: the drafts and the token before them
        n_rs_seq = max(n_rs_seq, sc.draft_max + 1)
    params = ContextParams(n_ctx=n_ctx * lanes, n_seq_max=lanes, n_batch=max(step, mc.n_batch),
                           n_ubatch=mc.n_ubatch, n_rs_seq=n_rs_seq, threads=mc.threads,
                           poll=ec.thread_poll, swa_full=mc.swa_full)
    ctx = Context(model, params)
    memory = ctx.describe_memory()
    pool = None
    if cfg.cache.enabled:
        pool = CheckpointPool(cfg.cache, model.fingerprint,
                              state_format=state_format(params, exact=exact),
                              kv_sections=memory.kv_sections)
    draft = None
    if drafting_model:
        draft = DraftModel(Path(mc.draft_path).expanduser(), model, sc, lanes=lanes,
                           n_ctx=ctx.n_ctx_seq, step_tokens=step, threads=mc.threads,
                           pool=pool, n_gpu_layers=mc.n_gpu_layers,
                           verbose=cfg.log.llama_verbose, threads_of=ctx, meter=meter)
    rs_snapshots = memory.needs_partial and memory.n_rs_seq > sc.draft_max \
        and rollback == "snapshots"
    return Parts(
        cfg=cfg, model=model, params=params, ctx=ctx, memory=memory, pool=pool, draft=draft,
        lanes=LaneSet(ctx.n_lanes), meter=meter,
        page=cfg.cache.page_size, step_tokens=step, why_n_ctx=why,
        speculation="off" if sc.source == "off" else ("draft" if draft else "lookup"),
        rs_snapshots=rs_snapshots,
        staging=memory.partial_rollback and not rs_snapshots,
        eog=np.array([t for t in range(model.n_vocab) if model.is_eog(t)], dtype=np.int32),
        exact=exact, grid=mc.n_ubatch)


def log_started(p: Parts, name: str) -> None:
    """The startup lines: the model and lanes, the tiers, speculative decoding."""
    cfg = p.cfg
    log.info("model %s (%s, %s memory, fingerprint %s): %d lanes x %s tokens (%s), "
             "steps of %d tokens", name, p.model.architecture, p.memory.kind.value,
             p.model.fingerprint[:12], len(p.lanes), f"{p.n_ctx:,}", p.why_n_ctx,
             p.step_tokens)
    if p.pool is not None:
        log.info("checkpoints: RAM %s, disk tier %s, remote tier %s",
                 format_size(cfg.cache.ram_budget), p.pool.disk_status, p.pool.remote_status)
    if p.speculation != "off":
        how = "a staged partial state" if p.staging else (
            f"n_rs_seq {p.memory.n_rs_seq}" if p.rs_snapshots else "seq_rm")
        sc = cfg.speculative
        what = f"prompt lookup (up to {sc.lookup_draft_max} tokens a step)" if p.draft is None \
            else (f"prompt lookup and draft model {Path(cfg.model.draft_path).name} "
                  f"({p.draft.memory.kind.value} memory, up to {sc.draft_max} tokens a step)")
        log.info("speculative decoding: %s, %s; drafts that do not pay are undone by %s",
                 what, "adaptive per lane" if sc.adaptive else "at every step", how)
