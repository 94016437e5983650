"""The engine: one thread owns the llama context and runs it one batched step at a time.

``generate()`` is an async generator for the HTTP layer. Requests wait in a bounded
queue until a lane is free. Each step is ONE ``llama_decode`` carrying the next
token of every decoding lane plus prefill chunks of the lanes that are prefilling
(vLLM's chunked-prefill order: decode tokens first, then prefill under the step's
token budget). The rules:

- While any stream decodes, a long prompt prefills in bursts (``proxy/engine/steps.py``):
  one step of at most ``engine.prefill_pause_ms`` (sized from measured step times),
  then steps of the streams alone for ``engine.decode_share`` of the time: a long
  prompt never holds the streams up for long, and both sides run at full efficiency.
- Prefill goes shortest-remaining first, so a short request behind a long one gets
  its first token quickly; a prefill that got nothing for two steps goes first.
- Admission follows lane availability, not strict arrival order: a waiting request
  whose conversation a free lane holds goes before others, and a request passed
  over twice goes next; a request that shares a prefix with one being prefilled
  waits for that one's FULL checkpoint there instead of prefilling it side by side
  (and starts at once from it if that one's lane is exactly there).
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
import collections
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np

from proxy.engine.binding import Context, ContextParams, Model, supports_rs_rollback
from proxy.engine.drafting import DraftModel
from proxy.engine.executor import Executor, Job, Work
from proxy.engine.outbox import Outbox
from proxy.engine.sampling import check_logit_bias
from proxy.engine.sizing import choose_n_ctx, state_format
from proxy.engine.splice import ReplyMemory
from proxy.engine.steps import StepTimer, plan_step
from proxy.engine.tokens import Tokenizer
from proxy.engine.types import (
    Divergence,
    Event,
    FinishEvent,
    GenerationRequest,
    QueueFull,
    StartEvent,
    TokenEvent,
    Usage,
)
from statecache.config import Config
from statecache.pages import common_prefix
from statecache.pool import CheckpointPool, Offer
from statecache.sizes import format_size

log = logging.getLogger("statecache")

MAX_SKIPS = 2  # admissions that may pass a waiting request over
MAX_MISSES = 100  # kept for GET /admin/misses


class EngineDead(RuntimeError):
    """The engine thread stopped; nothing can be generated (HTTP 500)."""


class Engine:
    def __init__(self, cfg: Config, model_path: Path) -> None:
        self.cfg = cfg
        mc, ec = cfg.model, cfg.engine
        self.model = Model(model_path, n_gpu_layers=mc.n_gpu_layers,
                           verbose=cfg.log.llama_verbose)
        lanes = cfg.server.lanes
        n_ctx, why = choose_n_ctx(self.model, cfg)
        step = ec.step_tokens or mc.n_batch
        if step < lanes:
            raise ValueError(f"engine.step_tokens ({step}) must hold one token per lane ({lanes})")
        sc = cfg.speculative
        n_rs_seq = mc.n_rs_seq
        drafting_model = sc.source in ("draft", "auto") and bool(mc.draft_path)
        rollback = sc.rollback if sc.rollback != "auto" else (
            "snapshots" if drafting_model else "staged")
        if sc.source != "off" and rollback == "snapshots" and supports_rs_rollback(self.model):
            # a verification's rejected drafts roll back through the hybrid memory's
            # per-token snapshots: the drafts and the token before them
            n_rs_seq = max(n_rs_seq, sc.draft_max + 1)
        self.params = ContextParams(n_ctx=n_ctx * lanes, n_seq_max=lanes,
                                    n_batch=max(step, mc.n_batch), n_ubatch=mc.n_ubatch,
                                    n_rs_seq=n_rs_seq, threads=mc.threads,
                                    poll=ec.thread_poll)
        self.ctx = Context(self.model, self.params)
        self.memory = self.ctx.describe_memory()
        self.n_ctx = self.ctx.n_ctx_seq
        self.step_tokens = step
        self.prefill_chunk = min(ec.prefill_chunk or step, step)
        self.pool: CheckpointPool | None = None
        if cfg.cache.enabled:
            self.pool = CheckpointPool(cfg.cache, self.model.fingerprint,
                                       state_format=state_format(self.params))
        self.draft: DraftModel | None = None
        if sc.source in ("draft", "auto") and mc.draft_path:
            self.draft = DraftModel(Path(mc.draft_path).expanduser(), self.model, sc,
                                    lanes=lanes, n_ctx=self.n_ctx, step_tokens=step,
                                    threads=mc.threads,
                                    pool=self.pool, n_gpu_layers=mc.n_gpu_layers,
                                    verbose=cfg.log.llama_verbose, threads_of=self.ctx)
        self.counters: collections.Counter[str] = collections.Counter()
        self.exec = Executor(self.ctx, self.memory, self.pool, cfg, self.counters,
                             draft=self.draft)
        self.tokenizer = Tokenizer(
            self.model, self.counters,
            ReplyMemory(size=8 * lanes) if cfg.cache.splice_generated else None)
        self.timer = StepTimer(share=cfg.engine.decode_share)
        self.alone_s = ec.lone_run_ms / 1000
        # reads from disk or the shared store for a waiting request, off the engine thread
        self._fetcher = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="statecache-fetch")
        self.stream_interval_s = cfg.server.stream_interval_ms / 1000
        self.model_name = model_path.name
        self.chat_template = self.model.chat_template()
        self.bos_token = self.model.token_text(self.model.bos) if self.model.bos >= 0 else ""
        self.eos_token = self.model.token_text(self.model.eos) if self.model.eos >= 0 else ""
        self._cv = threading.Condition()
        self._waiting: collections.deque[tuple[Job, Outbox]] = collections.deque()
        self._active: list[tuple[Job, Outbox]] = []
        self._last_write = -math.inf  # when the streams were last written together
        self._stopping = False
        self._dead: str | None = None
        self._misses: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_MISSES)
        self._close_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="statecache-engine", daemon=True)
        self._thread.start()
        log.info("model %s (%s, %s memory, fingerprint %s): %d lanes x %s tokens (%s), "
                 "steps of %d tokens", self.model_name, self.model.architecture,
                 self.memory.kind.value, self.model.fingerprint[:12], lanes,
                 f"{self.n_ctx:,}", why, step)
        if self.pool is not None:
            log.info("checkpoints: RAM %s, disk tier %s, remote tier %s",
                     format_size(cfg.cache.ram_budget), self.pool.disk_status,
                     self.pool.remote_status)
        if self.exec.speculation != "off":
            how = "a staged partial state" if self.exec.staging else (
                f"n_rs_seq {self.memory.n_rs_seq}" if self.exec.rs_snapshots else "seq_rm")
            what = "prompt lookup" if self.draft is None else \
                f"draft model {Path(mc.draft_path).name} ({self.draft.memory.kind.value} memory)"
            log.info("speculative decoding: %s, up to %d tokens a step; rejected drafts "
                     "roll back by %s", what, sc.draft_max, how)

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
        with self._cv:
            if self._dead is not None:
                raise EngineDead(f"the engine stopped: {self._dead}")
            if self._stopping:
                raise QueueFull(retry_after=5.0)
            capacity = len(self.exec.lanes) + self.cfg.server.queue_size
            if len(self._waiting) + len(self._active) >= capacity and \
                    (req.prewarm or not self._drop_a_prewarm()):
                self.counters["rejected_busy"] += 1
                raise QueueFull(retry_after=1.0)
            self._waiting.append((job, box))
            self._cv.notify()
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
        if self.draft is not None:
            out.update(self.draft.counters)
        return out

    def health(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "status": "ok", "model": self.model_name, "memory": self.memory.to_json(),
            "lanes": len(self.exec.lanes), "n_ctx": self.n_ctx, "cache": self.pool is not None,
            "disk": self.pool.disk_status if self.pool is not None else "cache off"}
        if self._dead is not None:
            body.update(status="error", ok=False, error=f"the engine stopped: {self._dead}")
        elif self._stopping:
            body.update(status="shutting down", ok=False)
        return body

    def begin_shutdown(self) -> None:
        """Stop admitting; running generations end at their next step with a final event."""
        with self._cv:
            self._stopping = True
            for job, box in self._waiting:
                _drop_prefetched(job)
                box.put(QueueFull(retry_after=5.0))
            self._waiting.clear()
            for job, _ in self._active:
                job.stopping = True
            self._cv.notify()

    def close(self) -> None:
        """End the running requests, keep lane states, write the pool to disk.
        Blocking: call it off the event loop. A second call waits for the first."""
        self.begin_shutdown()
        self._thread.join()
        self._fetcher.shutdown(wait=True)  # no read of the pool outlives it
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

    # -- the engine thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug: fail everyone loudly, never hang them
            log.critical("the engine thread failed; no request can be served", exc_info=True)
            with self._cv:
                self._dead = f"{type(exc).__name__}: {exc}"
                for job, box in [*self._waiting, *self._active]:
                    job.finish_reason = "error"
                    box.put(EngineDead(f"the engine stopped: {self._dead}"))
                self._waiting.clear()
                self._active.clear()
            return
        try:
            self.exec.shutdown()
        except Exception:
            log.exception("saving lane states at shutdown failed")

    def _loop(self) -> None:
        idle_s = self.cfg.engine.idle_save_s
        while True:
            with self._cv:
                while not self._active and not self._ready_waiting() and not self._stopping:
                    if not self._cv.wait(timeout=idle_s or None) and idle_s:
                        break  # idle: a moment to save lanes
                self._drop_cancelled_waiting()
                if self._stopping and not self._active:
                    return
                admitted = self._choose_admissions()
            if admitted:
                self._write_streams(flush=True)  # an admission may read or restore a state
            for job, box in admitted:
                self._admit(job, box)
            self._save_an_idle_lane(idle_s)
            with self._cv:
                active = list(self._active)
            if len(active) == 1 and self._alone(active[0][0]):
                self._decode_alone(*active[0])
            elif active:
                self._step(active)

    # admission ------------------------------------------------------------------

    def _ready_waiting(self) -> bool:
        return any(self._may_start(job) for job, _ in self._waiting)

    def _may_start(self, job: Job) -> bool:
        if job.fetching:
            return False
        if job.req.prewarm and not self.exec.vacant_lanes(job):
            return False  # a pre-warm never takes a lane that holds a live conversation
        k = job.waiting_for
        if k is None:
            return True
        if k.done or k.cancelled or k.pos >= job.wait_point:
            job.waiting_for = None
            return True
        return False

    def _drop_a_prewarm(self) -> bool:
        """Make room in a full queue for a request that generates: the newest waiting
        pre-warm is dropped (503). False when none waits (called with the lock)."""
        for job, box in reversed(self._waiting):
            if job.req.prewarm and not job.fetching:
                self._waiting.remove((job, box))
                _drop_prefetched(job)
                box.put(QueueFull(retry_after=5.0))
                self.counters["prewarms_dropped"] += 1
                return True
        return False

    def _drop_cancelled_waiting(self) -> None:
        if any(job.cancelled for job, _ in self._waiting):
            for job, _ in [w for w in self._waiting if w[0].cancelled]:
                _drop_prefetched(job)
                self.counters["cancelled_queued"] += 1
                log.info("request %s left while queued", job.req.request_id)
            self._waiting = collections.deque(w for w in self._waiting if not w[0].cancelled)

    def _choose_admissions(self) -> list[tuple[Job, Outbox]]:
        """Which waiting requests start now (called with the lock held)."""
        if self._stopping or not self._waiting:
            return []
        free = self.exec.lanes.free()
        out: list[tuple[Job, Outbox]] = []
        while free and self._waiting:
            ready = [w for w in self._waiting if self._may_start(w[0])]
            if not ready:
                break
            pick = self._pick(ready, free)
            if pick is None:
                break
            job = pick[0]
            for other, _ in ready:
                if other is not job and other.t_submit < job.t_submit:
                    other.skipped += 1
            self._waiting.remove(pick)
            out.append(pick)
            free.pop()  # which lane it takes is the planner's choice
        return out

    def _pick(self, ready: list[tuple[Job, Outbox]], free: list[Any]
              ) -> tuple[Job, Outbox] | None:
        oldest = ready[0]
        if oldest[0].skipped >= MAX_SKIPS:
            return oldest

        def held(w: tuple[Job, Outbox]) -> int:  # prompt tokens a free lane holds
            job = w[0]
            return max((ln.common(job.prompt, job.req.tenant) for ln in free), default=0)

        best = max(ready, key=held)
        return best if held(best) >= self.exec.page else oldest

    def _should_wait(self, job: Job) -> bool:
        """Whether ``job`` waits for an active request that is prefilling a prefix they
        share, beyond what ``job`` could start from now: that one publishes a FULL
        checkpoint where they meet, and ``job`` starts there (called with the lock)."""
        if not job.use_cache or self.pool is None:
            return False
        page = self.exec.page
        best: tuple[Job, int] | None = None
        for k, _ in self._active:
            if k.done or not k.use_cache or k.req.tenant != job.req.tenant:
                continue
            shared = common_prefix(k.prompt, job.prompt)
            at = (min(shared, len(k.prompt) - 1) // page) * page
            if at >= 2 * page and at >= k.pos and (best is None or at > best[1]):
                best = (k, at)
        if best is None:
            return False
        k, at = best
        if self.exec.reusable_now(job) + page > at:
            return False
        if k.pos == at:  # its lane holds exactly the shared prefix now
            self.exec.ensure_full(k)
            return False
        if self.exec.share_point(k, at) != at:
            return False
        job.waiting_for, job.wait_point = k, at
        self.counters["waits_for_shared_prefix"] += 1
        return True

    def _admit(self, job: Job, box: Outbox) -> None:
        if job.cancelled:
            _drop_prefetched(job)
            return
        with self._cv:
            if self._should_wait(job) or (job.req.prewarm and not self.exec.vacant_lanes(job)):
                self._waiting.appendleft((job, box))  # a pre-warm's lane went to another
                return
        held, job.prefetched = job.prefetched, None
        # while others run, a read from disk or the store goes to the fetch thread
        defer = not job.fetched and any(not k.done for k, _ in self._active)
        try:
            job.stats.queue_s = time.perf_counter() - job.t_submit
            offer = self.exec.start(job, held=held, defer_reads=defer)
        except Exception as exc:
            log.exception("request %s could not start", job.req.request_id)
            if job.lane is not None:
                try:
                    self.exec.clear(job.lane)
                finally:
                    job.lane.busy = False
            box.put(exc)
            return
        if offer is not None:
            self._fetch(job, box, offer)
            return
        with self._cv:
            self._active.append((job, box))
        box.put(StartEvent(len(job.prompt), job.reuse))  # before the prefill
        s = job.stats
        cached = f"{job.reuse:,}"
        if s.source != "cold":
            cached += f" ({s.role}, {s.source})"
        last = self.pool.costs.last if self.pool is not None else None
        if last is not None and last[:2] == (len(job.prompt), job.reuse) and last[2]:
            cached += f" · {last[2]}"  # why the planner fetched it (planner.py)
        log.info("Started · lane %d · input %s · cached %s", s.lane, f"{len(job.prompt):,}",
                 cached)

    def _fetch(self, job: Job, box: Outbox, offer: Offer) -> None:
        """Read ``offer`` on the fetch thread; ``job`` waits in the queue meanwhile and
        starts from it when the read is done (or plans anew if it failed)."""
        job.fetching = job.fetched = True
        self.counters["fetches_in_background"] += 1
        with self._cv:
            self._waiting.appendleft((job, box))

        def read() -> None:
            lease = None
            try:
                lease = self.exec.fetch(job, offer)
            except Exception:
                log.exception("reading a checkpoint for %s failed", job.req.request_id)
            with self._cv:
                job.fetching = False
                if job.cancelled or self._stopping or (job, box) not in self._waiting:
                    if lease is not None:
                        lease.close()
                else:
                    job.prefetched = lease
                self._cv.notify_all()

        try:
            self._fetcher.submit(read)
        except RuntimeError:  # shutting down: it plans (and reads) in the engine thread
            job.fetching = False

    def _save_an_idle_lane(self, idle_s: float) -> None:
        if not idle_s or self.pool is None:
            return
        now = time.monotonic()
        for lane in self.exec.lanes:
            if not lane.busy and not lane.saved_full and lane.n and now - lane.last_used > idle_s:
                self._write_streams(flush=True)
                try:
                    self.exec.idle_save(lane)
                except Exception:
                    log.exception("saving idle lane %d failed", lane.id)
                return  # one per step: a save holds the streams up

    # one step ---------------------------------------------------------------------

    def _step(self, active: list[tuple[Job, Outbox]]) -> None:
        for job, _ in active:
            if job.cancelled and not job.done:
                job.finish_reason = "cancelled"
            elif job.stopping and not job.done and job.prefilling:
                job.finish_reason = "length"  # shutting down: nothing more to prefill
        works = self._plan_step([job for job, _ in active if not job.done])
        n_decode = n_prefill = 0  # lanes that decode; prompt tokens this step prefills
        for w in works:
            if w.job.prefilling:
                n_prefill += w.n
            else:
                n_decode += 1
        if n_prefill:
            self._write_streams(active, flush=True)  # a prefill makes the step long
        if works:
            t0 = time.perf_counter()
            try:
                self.exec.run_step(works)
            except Exception as exc:
                log.exception("llama_decode failed; failing the %d lanes of this step",
                              len(works))
                for w in works:
                    w.job.fail(exc)
            else:
                dt = time.perf_counter() - t0
                self.timer.record(dt, n_decode, n_prefill)
                if self.pool is not None and not n_decode:  # the planner's prefill rate
                    self.pool.costs.note_prefill(n_prefill, dt)
                c = self.counters
                c["steps"] += 1
                c["step_tokens"] += sum(w.n for w in works)  # with the drafts it carried
                c["step_lane_work"] += len(works)
                if len(works) > 1:
                    c["steps_multi_lane"] += 1
        self._after_step(active)

    def _alone(self, job: Job) -> bool:
        """Whether ``job``, the only active one, may run steps of its own: it decodes a
        token a step, and nobody waits."""
        return self.alone_s > 0 and not (self._waiting or job.cancelled) and \
            self.exec.decodes_alone(job)

    def _decode_alone(self, job: Job, box: Outbox) -> None:
        """One stream and nothing else to do, the most common case: its steps without
        planning each one (``Executor.decode_alone``) until a request arrives, the stream
        ends, is cancelled or the server stops, or ``engine.lone_run_ms`` have passed
        (the loop's own work between steps, as an idle lane's save, then gets its turn)."""
        pair = [(job, box)]
        write = self._write_streams
        t0 = time.perf_counter()
        until = t0 + self.alone_s

        def more() -> bool:
            write(pair)
            return not (self._waiting or job.cancelled or job.stopping) and \
                time.perf_counter() < until

        try:
            steps = self.exec.decode_alone(job, more)
        except Exception as exc:
            log.exception("a lone run of request %s failed", job.req.request_id)
            job.fail(exc)
        else:
            self.timer.record(time.perf_counter() - t0, 1, 0, steps=steps)
            c = self.counters
            c["steps"] += steps
            c["step_tokens"] += steps
            c["step_lane_work"] += steps
            c["steps_alone"] += steps
        self._after_step(pair)

    def _after_step(self, active: list[tuple[Job, Outbox]]) -> None:
        # every stream's tokens first, with one wake-up of the loop for all of them;
        # a request that ends here saves its state next: nothing waits through that
        ended = any(job.done for job, _ in active)
        self._write_streams(active, flush=ended)
        for job, box in active:
            if job.done:
                self._end(job, box)
        if ended:  # the lanes that decode together stay one run of ids (executor._in_line)
            pass_s = min((s for s in self.timer.decode_s.values() if s > 0), default=0.0)
            self.exec.close_gap([job for job, _ in active if not job.done], pass_s)

    def _plan_step(self, jobs: list[Job]) -> list[Work]:
        ec = self.cfg.engine
        return plan_step(jobs, self.exec, self.timer, step_tokens=self.step_tokens,
                         prefill_chunk=self.prefill_chunk, pause_s=ec.prefill_pause_ms / 1000,
                         min_chunk=ec.min_prefill_chunk)

    def _write_streams(self, active: list[tuple[Job, Outbox]] | None = None, *,
                       flush: bool = False) -> None:
        """Hand each stream's new tokens to its outbox, and wake the event loop once
        for all of them. The streams are written together, at most once per
        ``server.stream_interval_ms``: tokens that come sooner wait in their jobs for a
        later step, so a model decoding faster than that costs the loop, the sockets
        and the clients one write for several tokens, and the loop one wake-up for
        every stream (each stream on a clock of its own would drift out of step with
        the others, and the loop would be woken for a few of them at a time). A
        stream's first tokens and its last go at once; ``flush``: everything goes now
        (the engine is about to do something that takes longer than a decode step)."""
        if active is None:
            with self._cv:
                active = list(self._active)
        now = time.perf_counter()
        due_all = flush or now - self._last_write >= self.stream_interval_s
        due: list[Outbox] = []
        try:
            for job, box in active:
                if not (job.deltas or job.logprobs):
                    continue
                if not (due_all or job.done or not job.written):
                    continue
                job.written = True
                if due_all:
                    self._last_write = now  # a loop that lags merges, not the clock
                if self._deliver(job, box):
                    due.append(box)
        finally:
            if due:
                Outbox.wake_all(due)

    def _deliver(self, job: Job, box: Outbox) -> bool:
        """Hand the tokens ``job`` holds to its outbox; True: the loop must be woken."""
        ev = TokenEvent("".join(t for t, _ in job.deltas),
                        tuple(i for _, d in job.deltas for i in d), tuple(job.logprobs))
        job.deltas.clear()
        job.logprobs.clear()
        return box.put(ev, defer=True)

    def _end(self, job: Job, box: Outbox) -> None:
        try:
            self.exec.finish(job)
        except Exception:
            log.exception("finishing request %s failed", job.req.request_id)
        with self._cv:
            self._active.remove((job, box))
        if job.finish_reason in ("stop", "length"):
            self.tokenizer.remember_reply(job.req.tenant, job.generated)
        self._account(job, box)

    def _account(self, job: Job, box: Outbox) -> None:
        s = job.stats
        now = time.perf_counter()
        completion = len(job.generated) - (1 if job.generated and
                                           self.model.is_eog(job.generated[-1]) else 0)
        if job.t_first:
            s.ttft_s = job.t_first - job.t_submit
        if job.t_first and job.generated:
            decode_s = now - job.t_first
            s.decode_tps = (len(job.generated) - 1) / decode_s if decode_s > 0 else 0.0
        c = self.counters
        c["requests"] += 1
        c["tokens_prompt"] += len(job.prompt)
        c["tokens_reused"] += job.reuse
        c["tokens_prefilled"] += s.prefilled
        c["tokens_generated"] += completion
        if job.req.prewarm:
            c["prewarms"] += 1
        if s.source != "cold":  # where the reused prefix came from, and its checkpoint's role
            c[f"hits.{s.source}.{s.role or 'live'}"] += 1
        miss = self._miss(job)
        if miss is not None:
            s.miss = miss.describe()
        usage = Usage(len(job.prompt), completion, job.reuse)
        if job.finish_reason == "error":
            box.put(job.error or RuntimeError("generation failed"))
        else:
            matched = job.stream.matched if job.stream is not None else None
            box.put(FinishEvent(job.finish_reason, usage, s, stop_sequence=matched))
        log.debug("phases %s · queue %.1f ms · plan %.1f ms (hand-off %.1f, restore %.1f) · "
                  "prefill %.1f ms in %d steps (checkpoints %.1f ms) · TTFT %.1f ms",
                  job.req.request_id, 1000 * s.queue_s, 1000 * s.plan_s, 1000 * s.handoff_s,
                  1000 * s.restore_s, 1000 * s.prefill_s, s.prefill_steps, 1000 * s.publish_s,
                  1000 * s.ttft_s)
        handoff = f" · hand-off {round(s.handoff_s * 1000)} ms" if s.handoff_s >= 0.0005 else ""
        spec = (f" · drafted {s.drafted:,}, accepted {s.accepted:,} "
                f"({100 * s.accepted / s.drafted:.0f}%)") if s.drafted else ""
        log.info("Done · input %s · cached %s · prefilled %s · output %s · TTFT %.2f s · "
                 "restore %d ms%s · checkpoints +%d (%s)%s",
                 f"{len(job.prompt):,}", f"{job.reuse:,}", f"{s.prefilled:,}", f"{completion:,}",
                 s.ttft_s, round(s.restore_s * 1000), handoff + spec, s.checkpoints_added,
                 format_size(s.checkpoint_bytes),
                 ("" if job.finish_reason in ("stop", "length") else f" · {job.finish_reason}")
                 + (f" · miss: {miss.describe()}" if miss is not None else ""))

    def _miss(self, job: Job) -> Divergence | None:
        """The reason this request reused less than an earlier one held, if it did."""
        d = job.req.divergence
        if d is None or job.reuse + self.exec.page > min(d.known, len(job.prompt) - 1):
            return None
        if not job.use_cache:
            d = dataclasses.replace(d, cause="cache off")
        elif d.token < 0 or d.token > d.known:  # the text agreed: the state was gone
            d = dataclasses.replace(d, cause="evicted")
        self.counters[f"misses.{d.cause}"] += 1
        with self._cv:
            self._misses.append({"time": time.time(), "request_id": job.req.request_id,
                                 "tenant": job.req.tenant, "prompt_tokens": len(job.prompt),
                                 "reused": job.reuse, "known": d.known, "cause": d.cause,
                                 "token": d.token, "message": d.message, "role": d.role,
                                 "old": d.old, "new": d.new})
        return d

    def recent_misses(self) -> list[dict[str, Any]]:
        """The last misses, newest first (``GET /admin/misses``)."""
        with self._cv:
            return list(reversed(self._misses))


def _drop_prefetched(job: Job) -> None:
    if job.prefetched is not None:
        job.prefetched.close()
        job.prefetched = None
