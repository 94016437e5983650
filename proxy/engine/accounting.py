"""What a request cost and why: its counters, the ``Started`` and ``Done`` log lines, its
final event with usage, and the miss it made (a request that reused less than an
earlier one held, with the reason the HTTP side found: proxy/api/misses.py).

One info line when a request starts and one when it ends:

    Started · lane 0 · input 1,024 · cached 857 (live, lane)
    Done · input 1,024 · cached 857 · prefilled 167 · output 40 · TTFT 0.07 s · ...
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any

from proxy.engine.build import Parts
from proxy.engine.job import Job
from proxy.engine.outbox import Outbox
from proxy.engine.types import Divergence, FinishEvent, Usage
from statecache.sizes import format_size

log = logging.getLogger("statecache")

MAX_MISSES = 100  # kept for GET /admin/misses


class Accounting:
    def __init__(self, parts: Parts) -> None:
        self.p = parts
        self._lock = threading.Lock()
        self._misses: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_MISSES)

    def started(self, job: Job) -> None:
        """The ``Started`` line: the lane, the prompt, what it starts from and why."""
        s = job.stats
        cached = f"{job.reuse:,}"
        if s.source != "cold":
            cached += f" ({s.role}, {s.source})"
        if job.estimate:
            cached += f" · {job.estimate}"  # why the planner read a state (planner.py)
        log.info("Started · lane %d · input %s · cached %s", s.lane, f"{len(job.prompt):,}",
                 cached)

    def finish(self, job: Job, box: Outbox) -> None:
        """Count the request, find its miss, hand its final event (or error) to its
        outbox and write its ``Done`` line."""
        s, out = job.stats, job.out
        now = time.perf_counter()
        completion = len(out.generated) - (1 if out.generated and
                                           self.p.model.is_eog(out.generated[-1]) else 0)
        m = self.p.meter
        intake = job.req.intake
        if out.t_first:
            # from the HTTP handler's start where there was one: render and tokenize count
            s.ttft_s = out.t_first - (intake.t_arrival if intake is not None else job.t_submit)
            m.ttft.observe(s.ttft_s)
        if intake is not None:
            s.http_s = max(job.t_submit - intake.t_arrival, 0.0)
            s.render_s, s.tokenize_s = intake.render_s, intake.tokenize_s
        if out.t_first and out.generated:
            decode_s = now - out.t_first
            s.decode_tps = (len(out.generated) - 1) / decode_s if decode_s > 0 else 0.0
            if len(out.generated) > 1 and decode_s > 0:
                m.decode_rate.observe(s.decode_tps)
        m.requests.inc()
        m.tokens_prompt.inc(by=len(job.prompt))
        m.tokens_reused.inc(by=job.reuse)
        m.tokens_prefilled.inc(by=s.prefilled)
        m.tokens_generated.inc(by=completion)
        if job.req.prewarm:
            m.prewarms.inc()
        if s.source != "cold":  # where the reused prefix came from, and its checkpoint's role
            m.hits.inc(s.source, s.role or "live")
        if job.req.divergence is not None:
            s.shared = job.req.divergence.known
        miss = self._miss(job)
        if miss is not None:
            s.miss = miss.describe()
        usage = Usage(len(job.prompt), completion, job.reuse)
        if job.finish_reason == "error":
            box.put(job.error or RuntimeError("generation failed"))
        else:
            matched = out.stream.matched if out.stream is not None else None
            box.put(FinishEvent(job.finish_reason, usage, s, stop_sequence=matched))
        self._done_line(job, completion, miss)

    def _done_line(self, job: Job, completion: int, miss: Divergence | None) -> None:
        s = job.stats
        log.debug("phases %s · queue %.1f ms · plan %.1f ms (hand-off %.1f, restore %.1f) · "
                  "prefill %.1f ms in %d steps (checkpoints %.1f ms) · TTFT %.1f ms · "
                  "http %.1f ms (render %.1f, tokenize %.1f) · llama_decode %.1f ms",
                  job.req.request_id, 1000 * s.queue_s, 1000 * s.plan_s, 1000 * s.handoff_s,
                  1000 * s.restore_s, 1000 * s.prefill_s, s.prefill_steps, 1000 * s.publish_s,
                  1000 * s.ttft_s, 1000 * s.http_s, 1000 * s.render_s, 1000 * s.tokenize_s,
                  1000 * s.decode_s)
        handoff = f" · hand-off {round(s.handoff_s * 1000)} ms" if s.handoff_s >= 0.0005 else ""
        spec = (f" · drafted {s.drafted:,}, accepted {s.accepted:,} "
                f"({100 * s.accepted / s.drafted:.0f}%)") if s.drafted else ""
        outside = (f" · outside llama_decode {1000 * s.outside_s:.1f} ms "
                   f"({100 * s.outside_s / s.ttft_s:.1f}%)") if s.ttft_s > 0 else ""
        log.info("Done · input %s · cached %s · prefilled %s · output %s · TTFT %.2f s · "
                 "restore %d ms%s · checkpoints +%d (%s)%s%s",
                 f"{len(job.prompt):,}", f"{job.reuse:,}", f"{s.prefilled:,}", f"{completion:,}",
                 s.ttft_s, round(s.restore_s * 1000), handoff + spec, s.checkpoints_added,
                 format_size(s.checkpoint_bytes), outside,
                 ("" if job.finish_reason in ("stop", "length") else f" · {job.finish_reason}")
                 + (f" · miss: {miss.describe()}" if miss is not None else ""))

    def _miss(self, job: Job) -> Divergence | None:
        """The reason this request reused less than an earlier one held, if it did."""
        d = job.req.divergence
        if d is None or job.reuse + self.p.page > min(d.known, len(job.prompt) - 1):
            return None
        if not job.use_cache:
            d = dataclasses.replace(d, cause="cache off")
        elif d.token < 0 or d.token > d.known:  # the text agreed: the state was gone
            lost = None if self.p.pool is None else self.p.pool.dropped_cause(
                job.prompt, tenant=job.req.tenant)  # dropped for a page, not evicted
            d = dataclasses.replace(d, cause=lost or "evicted")
        self.p.meter.misses.inc(d.cause)
        with self._lock:
            self._misses.append({"time": time.time(), "request_id": job.req.request_id,
                                 "tenant": job.req.tenant, "prompt_tokens": len(job.prompt),
                                 "reused": job.reuse, "known": d.known, "cause": d.cause,
                                 "token": d.token, "message": d.message, "role": d.role,
                                 "old": d.old, "new": d.new})
        return d

    def recent_misses(self) -> list[dict[str, Any]]:
        """The last misses, newest first (``GET /admin/misses``)."""
        with self._lock:
            return list(reversed(self._misses))
