"""Sizing the context: tokens per lane from the model and the memory budget, and the
version of the state bytes this build writes."""

from __future__ import annotations

import xxhash

from proxy.engine.binding import LLAMA_CPP_VERSION, Context, ContextParams, Model
from statecache.budgets import DEFAULT_TRAINING_CONTEXT, lane_context
from statecache.config import Config


def state_format(ctx_params: ContextParams, *, exact: bool = False) -> int:
    """Version of the bytes llama.cpp writes: states of another build never load. An
    exact-mode server's states (cache.exact: written by prefill steps on the grid) are a
    format of their own, so neither mode ever restores the other's."""
    key = f"{LLAMA_CPP_VERSION}|swa_full={ctx_params.swa_full}|kv=f16"
    if exact:
        key += f"|exact grid={ctx_params.n_ubatch}"
    if ctx_params.n_rs_seq:  # a hybrid's states then carry its per-token snapshots
        key += f"|n_rs_seq={ctx_params.n_rs_seq}"
    return xxhash.xxh32_intdigest(key.encode()) & 0x7FFFFFFF


def choose_n_ctx(model: Model, cfg: Config) -> tuple[int, str]:
    """Tokens per lane, and why: the configured value, or the model's training context
    capped so that the KV of all lanes fits ``model.kv_budget``."""
    mc, lanes = cfg.model, cfg.server.lanes
    if mc.n_ctx:
        return min(mc.n_ctx, model.n_ctx_train or DEFAULT_TRAINING_CONTEXT), "configured"
    probe = ContextParams(n_ctx=512, n_seq_max=1, n_batch=64, n_ubatch=64, threads=1)
    with Context(model, probe) as ctx:
        per_token = ctx.describe_memory().bytes_per_token
    return lane_context(model.n_ctx_train, per_token, mc.kv_budget, lanes)
