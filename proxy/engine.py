"""The engine: one thread owns the llama context; the event loop talks to it by queue.

``generate()`` is an async generator for the HTTP layer. Requests wait in a bounded
queue until a lane is free; active requests advance one step each in turn (a
prefill chunk or one token), so lanes run side by side without blocking the loop.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from proxy.binding import LLAMA_CPP_VERSION, Context, ContextParams, Model
from proxy.executor import Executor, Job
from proxy.splice import ReplyMemory, aligned_replies, tokenize_spliced
from proxy.types import (
    Event,
    FinishEvent,
    GenerationRequest,
    QueueFull,
    TokenEvent,
    Usage,
)
from statecache.config import Config
from statecache.pool import CheckpointPool
from statecache.sizes import format_size

log = logging.getLogger("statecache")


def state_format(ctx_params: ContextParams) -> int:
    """Version of the bytes llama.cpp writes: states of another build never load."""
    key = f"{LLAMA_CPP_VERSION}|swa_full={ctx_params.swa_full}|kv=f16"
    return xxhash.xxh32_intdigest(key.encode()) & 0x7FFFFFFF


class Engine:
    def __init__(self, cfg: Config, model_path: Path) -> None:
        self.cfg = cfg
        mc = cfg.model
        self.model = Model(model_path, n_gpu_layers=mc.n_gpu_layers,
                           verbose=cfg.log.llama_verbose)
        lanes = cfg.server.lanes
        n_ctx = min(mc.n_ctx, self.model.n_ctx_train) if self.model.n_ctx_train else mc.n_ctx
        self.params = ContextParams(n_ctx=n_ctx * lanes, n_seq_max=lanes, n_batch=mc.n_batch,
                                    n_ubatch=mc.n_ubatch, n_rs_seq=mc.n_rs_seq,
                                    threads=mc.threads)
        self.ctx = Context(self.model, self.params)
        self.memory = self.ctx.describe_memory()
        self.n_ctx = self.ctx.n_ctx_seq
        self.pool: CheckpointPool | None = None
        if cfg.cache.enabled:
            self.pool = CheckpointPool(cfg.cache, self.model.fingerprint,
                                       state_format=state_format(self.params))
        self.counters: collections.Counter[str] = collections.Counter()
        self.exec = Executor(self.ctx, self.memory, self.pool, cfg, self.counters)
        self.replies = ReplyMemory(size=8 * lanes) if cfg.cache.splice_generated else None
        self.model_name = model_path.name
        self.chat_template = self.model.chat_template()
        self.bos_token = self.model.token_text(self.model.bos) if self.model.bos >= 0 else ""
        self.eos_token = self.model.token_text(self.model.eos) if self.model.eos >= 0 else ""
        self._cv = threading.Condition()
        self._waiting: collections.deque[tuple[Job, _Outbox]] = collections.deque()
        self._active: list[tuple[Job, _Outbox]] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="statecache-engine", daemon=True)
        self._thread.start()
        log.info("model %s (%s, %s memory, %d lanes x %d tokens, fingerprint %s)",
                 self.model_name, self.model.architecture, self.memory.kind.value, lanes,
                 self.n_ctx, self.model.fingerprint[:12])

    # -- the HTTP side ----------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.model.tokenize(text, add_special=False, parse_special=True)

    def tokenize_prompt(self, text: str, tenant: str = "") -> list[int]:
        """Tokenize a rendered prompt; with ``cache.splice_generated``, the ids of recent
        replies stand in for their re-tokenized text (see proxy/splice.py)."""
        if self.replies is None:
            return self.tokenize(text)
        ids, n = tokenize_spliced(text, self.tokenize, self.replies.recent(tenant))
        if n:
            self.counters["replies_spliced"] += n
        return ids

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Event]:
        n = len(req.prompt_tokens)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n + req.sampling.max_tokens > self.n_ctx:
            raise ValueError(
                f"this model's context is {self.n_ctx} tokens per lane; the prompt has {n} "
                f"and max_tokens is {req.sampling.max_tokens}")
        job = Job(req=req, prompt=np.asarray(req.prompt_tokens, dtype=np.int32),
                  use_cache=self.pool is not None and req.use_cache,
                  t_submit=time.perf_counter())
        box = _Outbox(asyncio.get_running_loop())
        with self._cv:
            if self._stopping:
                raise QueueFull(retry_after=5.0)
            capacity = len(self.exec.lanes) + self.cfg.server.queue_size
            if len(self._waiting) + len(self._active) >= capacity:
                self.counters["rejected_busy"] += 1
                raise QueueFull(retry_after=1.0)
            self._waiting.append((job, box))
            self._cv.notify()
        done = False
        try:
            while True:
                ev = await box.queue.get()
                if isinstance(ev, BaseException):
                    raise ev
                yield ev
                if isinstance(ev, FinishEvent):
                    done = True
                    return
        finally:
            if not done:
                job.cancelled = True  # the engine stops it at its next step
                with self._cv:
                    self._cv.notify()

    def describe_checkpoints(self) -> list[dict[str, Any]]:
        return self.pool.describe() if self.pool is not None else []

    def get_checkpoint(self, entry_id: str) -> dict[str, Any] | None:
        return self.pool.get(entry_id) if self.pool is not None else None

    def metrics(self) -> dict[str, Any]:
        with self._cv:
            queued, active = len(self._waiting), len(self._active)
        out: dict[str, Any] = dict(self.counters)
        out["queue_depth"] = queued
        out["active_requests"] = active
        out["lanes"] = len(self.exec.lanes)
        if self.pool is not None:
            out["pool"] = self.pool.stats()
        return out

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "model": self.model_name, "memory": self.memory.to_json(),
                "lanes": len(self.exec.lanes), "n_ctx": self.n_ctx,
                "cache": self.pool is not None}

    def close(self) -> None:
        """Finish the running requests, keep lane states, write the pool to disk."""
        with self._cv:
            self._stopping = True
            for _job, box in self._waiting:
                box.put(QueueFull(retry_after=5.0))
            self._waiting.clear()
            for job, _ in self._active:
                job.cancelled = True
            self._cv.notify()
        self._thread.join()
        if self.pool is not None:
            self.pool.close()
        self.ctx.close()
        self.model.close()

    # -- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._active and not self._waiting and not self._stopping:
                    self._cv.wait()
                if self._stopping and not self._active:
                    break
                admitted: list[tuple[Job, _Outbox]] = []
                while self._waiting and len(self._active) + len(admitted) < len(self.exec.lanes):
                    admitted.append(self._waiting.popleft())
            for job, box in admitted:
                self._admit(job, box)
            for item in list(self._active):
                self._advance(*item)
        try:
            self.exec.shutdown()
        except Exception:
            log.exception("saving lane states at shutdown failed")

    def _admit(self, job: Job, box: _Outbox) -> None:
        if job.cancelled:
            return
        try:
            job.stats.queue_s = time.perf_counter() - job.t_submit
            self.exec.start(job)
        except Exception as exc:
            log.exception("request %s could not start", job.req.request_id)
            if job.lane is not None:
                job.lane.busy = False
            box.put(exc)
            return
        with self._cv:
            self._active.append((job, box))
        s = job.stats
        cached = f"{job.reuse:,}"
        if s.source != "cold":
            cached += f" ({s.role}, {s.source})"
        log.info("Started · lane %d · input %s · cached %s", s.lane, f"{len(job.prompt):,}",
                 cached)

    def _advance(self, job: Job, box: _Outbox) -> None:
        try:
            if job.cancelled:
                job.finish_reason = "cancelled"
            else:
                deltas = self.exec.step(job)
                if job.logprobs and not deltas:
                    deltas = [("", ())]
                for i, (text, ids) in enumerate(deltas):
                    lps = tuple(job.logprobs) if i == 0 else ()
                    box.put(TokenEvent(text, ids, lps))
                job.logprobs.clear()
        except Exception as exc:
            log.exception("request %s failed", job.req.request_id)
            job.finish_reason = "error"
            box.put(exc)
        if not job.finish_reason:
            return
        try:
            self.exec.finish(job)
        except Exception:
            log.exception("finishing request %s failed", job.req.request_id)
        with self._cv:
            self._active.remove((job, box))
        if self.replies is not None and job.finish_reason in ("stop", "length"):
            self._remember_reply(job)
        self._account(job, box)

    def _remember_reply(self, job: Job) -> None:
        assert self.replies is not None
        m = self.model
        ids = [t for t in job.generated if not m.is_eog(t)]
        pieces = [m.token_bytes(t) for t in ids]
        special = [not m.token_bytes(t, special=False) and bool(p)
                   for t, p in zip(ids, pieces, strict=True)]
        self.replies.remember(job.req.tenant, aligned_replies(ids, pieces, special))

    def _account(self, job: Job, box: _Outbox) -> None:
        s = job.stats
        now = time.perf_counter()
        completion = len(job.generated) - (1 if job.generated and
                                           self.model.is_eog(job.generated[-1]) else 0)
        if job.t_first:
            s.ttft_s = job.t_first - job.t_submit
            decode_s = now - job.t_first
            s.decode_tps = (len(job.generated) - 1) / decode_s if decode_s > 0 else 0.0
        c = self.counters
        c["requests"] += 1
        c["tokens_prompt"] += len(job.prompt)
        c["tokens_reused"] += job.reuse
        c["tokens_prefilled"] += s.prefilled
        c["tokens_generated"] += completion
        if s.source != "cold":  # where the reused prefix came from, and its checkpoint's role
            c[f"hits.{s.source}.{s.role or 'live'}"] += 1
        usage = Usage(len(job.prompt), completion, job.reuse)
        if job.finish_reason != "error":
            box.put(FinishEvent(job.finish_reason, usage, s))
        handoff = f" · hand-off {round(s.handoff_s * 1000)} ms" if s.handoff_s >= 0.0005 else ""
        log.info("Done · input %s · cached %s · prefilled %s · output %s · TTFT %.2f s · "
                 "restore %d ms%s · checkpoints +%d (%s)%s",
                 f"{len(job.prompt):,}", f"{job.reuse:,}", f"{s.prefilled:,}", f"{completion:,}",
                 s.ttft_s, round(s.restore_s * 1000), handoff, s.checkpoints_added,
                 format_size(s.checkpoint_bytes),
                 "" if job.finish_reason in ("stop", "length") else f" · {job.finish_reason}")


class _Outbox:
    """Hands events from the engine thread to one request's coroutine."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[Event | BaseException] = asyncio.Queue()

    def put(self, ev: Event | BaseException) -> None:
        # a closed loop means the client is gone: nobody is listening
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, ev)

