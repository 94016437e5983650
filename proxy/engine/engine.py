"""The engine: one thread owns the llama context and runs it one batched step at a time.

``generate()`` is an async generator for the HTTP side. Requests wait in a bounded
queue until a lane is free (proxy/engine/admission.py). Each step is ONE
``llama_decode`` carrying the next token of every decoding lane plus prefill chunks of
the lanes that are prefilling (vLLM's chunked-prefill order: decode tokens first, then
prefill under the step's token budget; proxy/engine/steps.py sizes it,
proxy/engine/executor.py runs it). The rules:

- While any stream decodes, a long prompt prefills in bursts: one step of at most
  ``engine.prefill_pause_ms``, then steps of the streams alone for
  ``engine.decode_share`` of the time: a long prompt never holds the streams up for
  long, and both sides run at full efficiency.
- Prefill goes shortest-remaining first, so a short request behind a long one gets
  its first token quickly; a prefill that got nothing for two steps goes first.
- One stream decoding with nothing else to do (the most common case) runs steps of
  its own without planning each one (``_decode_alone``), until a request arrives,
  the stream ends or is cancelled, or ``engine.lone_run_ms`` have passed.
- Per-lane everything: a lane that is cancelled, fails, or hits its limit ends
  alone. A failed ``llama_decode`` fails the lanes of that step and clears them.
- The thread cannot die silently: if the loop fails outside the per-request guards,
  every waiting request fails, ``/health`` says so, and new requests are refused.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from proxy.engine.accounting import Accounting
from proxy.engine.admission import Admission, Board
from proxy.engine.build import build, log_started
from proxy.engine.checks import sanity_check
from proxy.engine.emit import Emitter
from proxy.engine.executor import Executor
from proxy.engine.job import Job
from proxy.engine.outbox import Outbox
from proxy.engine.placement import Placement
from proxy.engine.publishing import Publisher
from proxy.engine.restore import Restorer
from proxy.engine.sampling import check_logit_bias
from proxy.engine.speculation import Speculation
from proxy.engine.splice import ReplyMemory
from proxy.engine.steps import Stepper
from proxy.engine.streams import Streams
from proxy.engine.timing import StepTimer
from proxy.engine.tokens import Tokenizer
from proxy.engine.types import Event, FinishEvent, GenerationRequest, QueueFull
from proxy.meter import Family
from proxy.meters import pool_families
from statecache.config import Config
from statecache.pages import PageChain

log = logging.getLogger("statecache")


class EngineDead(RuntimeError):
    """The engine thread stopped; nothing can be generated (HTTP 500)."""


class Engine:
    def __init__(self, cfg: Config, model_path: Path, name: str | None = None) -> None:
        """``name``: the model as the user asked for it (default: the file's name)."""
        self.cfg = cfg
        p = self.parts = build(cfg, model_path)
        self.model, self.ctx, self.memory, self.pool, self.draft = (
            p.model, p.ctx, p.memory, p.pool, p.draft)
        self.meter = p.meter
        self.n_ctx = p.n_ctx
        publisher = Publisher(p)
        emitter = Emitter(p)
        self.timer = StepTimer(share=cfg.engine.decode_share)
        self.exec = Executor(p, publisher, Speculation(p, self.timer), emitter)
        self.restorer = Restorer(p, publisher, Placement(p, publisher), emitter)
        self.board = Board()
        self.accounting = Accounting(p)
        self.admission = Admission(p, self.board, self.restorer, publisher, self.accounting)
        self.publisher = publisher
        self.tokenizer = Tokenizer(
            self.model, self.meter,
            ReplyMemory(size=8 * len(p.lanes)) if cfg.cache.splice_generated else None)
        self.stepper = Stepper(p, self.board, self.exec, self.restorer.placement,
                               self.accounting, self.tokenizer, self.timer,
                               Streams(cfg.server.stream_interval_ms / 1000))
        self.check_steps = cfg.engine.sanity_checks  # engine.sanity_check() after each step
        self.model_name = name or model_path.name
        self.model_file = str(model_path)
        self.chat_template = self.model.chat_template()
        self.bos_token = self.model.token_text(self.model.bos) if self.model.bos >= 0 else ""
        self.eos_token = self.model.token_text(self.model.eos) if self.model.eos >= 0 else ""
        self._dead: str | None = None
        self._close_lock = threading.Lock()
        self._closed = False
        self._ui_chains: dict[int, PageChain] = {}  # describe_lanes: each lane's last chain
        self._thread = threading.Thread(target=self._run, name="statecache-engine", daemon=True)
        self._thread.start()
        log_started(p, self.model_name if self.model_name == model_path.name
                    else f"{self.model_name} ({model_path})")

    # -- the HTTP side ----------------------------------------------------------------

    async def generate(self, req: GenerationRequest) -> AsyncIterator[Event]:
        n = len(req.prompt_tokens)
        if n == 0:
            raise ValueError("the prompt is empty")
        if n + req.sampling.max_tokens > self.n_ctx:
            raise ValueError(
                f"this model's context is {self.n_ctx} tokens per lane; the prompt has {n} "
                f"and max_tokens is {req.sampling.max_tokens}")
        check_logit_bias(req.sampling, self.model.n_vocab)  # before any lane is touched
        job = Job(req=req, prompt=np.asarray(req.prompt_tokens, dtype=np.int32),
                  use_cache=self.pool is not None and req.use_cache,
                  t_submit=time.perf_counter())
        box = Outbox(asyncio.get_running_loop())
        b = self.board
        with b.cv:
            if self._dead is not None:
                raise EngineDead(f"the engine stopped: {self._dead}")
            if b.stopping:
                raise QueueFull(retry_after=5.0)
            capacity = len(self.parts.lanes) + self.cfg.server.queue_size
            if len(b.waiting) + len(b.active) >= capacity and \
                    (req.prewarm or not self.admission.drop_a_prewarm()):
                self.meter.rejected_busy.inc()
                raise QueueFull(retry_after=1.0)
            b.waiting.append((job, box))
            b.cv.notify()
        done = False
        try:
            while True:
                for ev in await box.get():
                    if isinstance(ev, BaseException):
                        raise ev
                    yield ev
                    if isinstance(ev, FinishEvent):
                        done = True
                        return
        finally:
            box.close()
            if not done:
                job.cancelled = True  # the engine stops it at its next step, queued or not
                with b.cv:
                    b.cv.notify()

    def describe_checkpoints(self) -> list[dict[str, Any]]:
        return self.pool.describe() if self.pool is not None else []

    def get_checkpoint(self, entry_id: str) -> dict[str, Any] | None:
        return self.pool.get(entry_id) if self.pool is not None else None

    def recent_misses(self) -> list[dict[str, Any]]:
        """The last misses, newest first (``GET /admin/misses``)."""
        return self.accounting.recent_misses()

    # -- read-only views for the live page (proxy/api/ui.py); off the engine thread ------

    def checkpoint_pages(self) -> Mapping[str, tuple[bytes, ...]]:
        """Each checkpoint's page hashes (the records' own tuples, not copies): which
        checkpoints share a prefix. In-process only, never sent as they are."""
        return self.pool.page_hashes() if self.pool is not None else {}

    def describe_lanes(self) -> list[dict[str, Any]]:
        """Each lane now: what it holds (tokens, tenant, session), its request's progress
        and rate, and in ``pages`` the page hashes of its tokens (where it sits among the
        checkpoints; in-process only). Read while the engine runs: a lane that changes
        meanwhile shows a step stale. The board's lock is held only to copy its list."""
        with self.board.cv:
            jobs = {job.lane.id: job for job, _ in self.board.active if job.lane is not None}
        now = time.perf_counter()
        out = []
        for lane in self.parts.lanes:
            tokens, tenant = lane.tokens.copy(), lane.tenant
            row: dict[str, Any] = {"lane": lane.id, "tokens": int(tokens.size),
                                   "tenant": tenant, "session": lane.session,
                                   "state": "idle" if tokens.size else "empty",
                                   "pages": self._lane_pages(lane.id, tokens, tenant)}
            job = jobs.get(lane.id)
            if job is not None:
                row.update(_progress(job, now))
            out.append(row)
        return out

    def _lane_pages(self, lane: int, tokens: np.ndarray, tenant: str) -> tuple[bytes, ...]:
        if self.pool is None:
            return ()
        prev = self._ui_chains.get(lane)  # a lane's next look rehashes only its new pages
        chain = self._ui_chains[lane] = self.pool.chain(tokens, tenant, prev)
        return chain.hashes

    def tiers(self) -> dict[str, Any]:
        """Which model this is and where its tiers are: the model, its fingerprint, the
        disk directory (None while the disk tier is off), the tiers' status and figures."""
        pool = self.pool
        disk = pool is not None and pool.disk_status == "ok"
        return {"model": self.model_name, "fingerprint": self.model.fingerprint,
                "disk_path": str(Path(self.cfg.cache.disk_path).expanduser().resolve())
                if disk else None,
                "disk": pool.disk_status if pool is not None else "cache off",
                "remote": pool.remote_status if pool is not None else "off",
                "stats": pool.stats() if pool is not None else None}

    def queue(self) -> dict[str, int]:
        """Requests waiting for a lane and requests holding one, now."""
        with self.board.cv:
            return {"queue_depth": len(self.board.waiting),
                    "active_requests": len(self.board.active)}

    def metrics(self) -> list[Family]:
        """The engine's metric families for ``/metrics``, its gauges read now."""
        m = self.meter
        q = self.queue()
        m.queue_depth.set(q["queue_depth"])
        m.active_requests.set(q["active_requests"])
        m.lanes.set(len(self.parts.lanes))
        out = m.families()
        if self.pool is not None:
            out += pool_families(self.pool.stats())
        return out

    def health(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "status": "ok", "model": self.model_name, "memory": self.memory.to_json(),
            "lanes": len(self.parts.lanes), "n_ctx": self.n_ctx, "cache": self.pool is not None,
            "disk": self.pool.disk_status if self.pool is not None else "cache off"}
        if self._dead is not None:
            body.update(status="error", ok=False, error=f"the engine stopped: {self._dead}")
        elif self.board.stopping:
            body.update(status="shutting down", ok=False)
        return body

    def begin_shutdown(self) -> None:
        """Stop admitting; running generations end at their next step with a final event."""
        b = self.board
        with b.cv:
            b.stopping = True
            for job, box in b.waiting:
                job.wait.drop_prefetched()
                box.put(QueueFull(retry_after=5.0))
            b.waiting.clear()
            for job, _ in b.active:
                job.stopping = True
            b.cv.notify()

    def close(self) -> None:
        """End the running requests, keep lane states, write the pool to disk.
        Blocking: call it off the event loop. A second call waits for the first."""
        self.begin_shutdown()
        self._thread.join()
        self.admission.close()
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            if self.pool is not None:
                self.pool.close()
            if self.draft is not None:  # first: it may decode on the target's threadpool
                self.draft.close()
            self.ctx.close()
            self.model.close()

    def sanity_check(self) -> None:
        """The engine's invariants (proxy/engine/checks.py); engine thread, between steps."""
        with self.board.cv:
            active = [job for job, _ in self.board.active]
        sanity_check(self.parts, active)

    # -- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        b = self.board
        try:
            self._loop()
        except BaseException as exc:  # a bug: fail everyone loudly, never hang them
            log.critical("the engine thread failed; no request can be served", exc_info=True)
            with b.cv:
                self._dead = f"{type(exc).__name__}: {exc}"
                for job, box in [*b.waiting, *b.active]:
                    job.finish_reason = "error"
                    box.put(EngineDead(f"the engine stopped: {self._dead}"))
                b.waiting.clear()
                b.active.clear()
            return
        try:
            self.publisher.shutdown()
        except Exception:
            log.exception("saving lane states at shutdown failed")

    def _loop(self) -> None:
        idle_s = self.cfg.engine.idle_save_s
        b, admission = self.board, self.admission
        while True:
            if not b.active and self.pool is not None:
                self.pool.hold_writes(False)  # idle: the disk writer goes on
            with b.cv:
                while not b.active and not admission.ready() and not b.stopping:
                    if not b.cv.wait(timeout=idle_s or None) and idle_s:
                        break  # idle: a moment to save lanes
                admission.drop_cancelled()
                if b.stopping and not b.active:
                    return
                admitted = admission.choose()
            if admitted:
                self.stepper.write(flush=True)  # an admission may read or restore a state
            for job, box in admitted:
                admission.admit(job, box)
            if admitted:  # a prompt cached to its end has its first token already
                self.stepper.write()
            self._save_an_idle_lane(idle_s)
            with b.cv:
                active = list(b.active)
            self.stepper.run(active)
            if self.check_steps:
                self.sanity_check()

    def _save_an_idle_lane(self, idle_s: float) -> None:
        if not idle_s or self.pool is None:
            return
        now = self.parts.clock()
        for lane in self.parts.lanes:
            if not lane.busy and not lane.saved_full and lane.n and now - lane.last_used > idle_s:
                self.stepper.write(flush=True)
                try:
                    self.publisher.idle_save(lane)
                except Exception:
                    log.exception("saving idle lane %d failed", lane.id)
                return  # one per step: a save holds the streams up


def _progress(job: Job, now: float) -> dict[str, Any]:
    """A running request's progress: prompt tokens consumed, tokens generated, and its
    rate (prefill tokens/s since admission, or decode tokens/s since its first token)."""
    out = job.out
    generated = len(out.generated)
    if job.prefilling:
        took = now - job.t_admitted if job.t_admitted else 0.0
        tps = (job.pos - job.reuse) / took if took > 0 else 0.0
    else:
        took = now - out.t_first if out.t_first else 0.0
        tps = (generated - 1) / took if took > 0 and generated > 1 else 0.0
    return {"state": "prefilling" if job.prefilling else "decoding",
            "request_id": job.req.request_id, "prompt": len(job.prompt), "pos": job.pos,
            "reused": job.reuse, "generated": generated,
            "max_tokens": job.req.sampling.max_tokens, "tps": round(tps, 1)}
