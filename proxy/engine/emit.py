"""What a request produces: sample the next token from a row of logits, turn it into text
(whole UTF-8 characters, stop strings held back), log-probabilities when asked, and
decide whether the request is done (end of generation, a stop string, ``max_tokens``,
the server stopping)."""

from __future__ import annotations

import time

import numpy as np

from proxy.engine.build import Parts
from proxy.engine.detok import TextStream
from proxy.engine.job import Job
from proxy.engine.sampling import make_sampler
from proxy.engine.types import TokenLogprob


class Emitter:
    def __init__(self, parts: Parts) -> None:
        self.p = parts

    def prepare(self, job: Job) -> None:
        """The request's sampler and text stream, and whether it drafts."""
        p, out = self.p, job.out
        out.sampler = make_sampler(p.model, job.req.sampling, p.cfg.sampling, job.prompt)
        out.stream = TextStream(job.req.sampling.stop)
        # a grammar would have to pass every drafted token: such a request drafts nothing;
        # nor does one with a seed unless it asks to: a seed promises the same reply
        # again, and a verification batch may be other arithmetic than one-by-one steps
        # (docs/design.md fact 16) on a schedule the machine's timings decide
        sp = job.req.sampling
        job.spec.on = (p.speculation != "off" and not out.sampler.constrained
                       and (sp.speculative or (sp.speculative is None and sp.seed is None)))

    def first(self, job: Job, row: int, logits: np.ndarray | None = None) -> None:
        """The prompt is consumed: the request's first token, sampled from output row
        ``row`` of the last decode or from ``logits`` (kept with the state the prompt
        started from, which held all of it). A pre-warm samples nothing."""
        job.out.t_first = time.perf_counter()
        job.stats.prefill_s = job.out.t_first - job.t_admitted
        if job.prewarm:  # cached, and nothing to generate
            job.finish_reason = "length"
            return
        self.take(job, row, logits)

    def take(self, job: Job, row: int, logits: np.ndarray | None = None) -> None:
        """Sample the next token (from output row ``row`` of the last decode, or from
        ``logits`` where given) and decide whether the request is done."""
        p, out = self.p, job.out
        assert out.sampler is not None and out.stream is not None
        k = job.req.sampling.logprobs
        tok = out.sampler.sample(p.ctx, row, logits)
        if k is not None:  # of the model's own distribution, before the sampler's changes
            row_logits = p.ctx.logits_view(row) if logits is None else logits
            out.logprobs.append(self._logprob(row_logits, tok, k))
        out.generated.append(tok)
        out.pending = tok
        if p.model.is_eog(tok):
            job.finish_reason = "stop"
            out.sampler.close()
            tail = out.stream.finish()
            if tail:
                out.deltas.append((tail, ()))
            return
        text = out.stream.feed(p.model.token_bytes(tok))
        if text:
            out.deltas.append((text, (tok,)))
        if out.stream.stopped:
            job.finish_reason = "stop"
        elif len(out.generated) >= job.req.sampling.max_tokens or job.stopping:
            job.finish_reason = "length"
            tail = out.stream.finish()
            if tail:
                out.deltas.append((tail, ()))
        if job.finish_reason:
            out.sampler.close()  # its chain is freed with the request (or when collected)

    def _logprob(self, logits: np.ndarray, tok: int, k: int) -> TokenLogprob:
        model = self.p.model
        x = logits.astype(np.float64)
        top_logit = float(x.max())
        lse = top_logit + float(np.log(np.exp(x - top_logit).sum()))
        top: tuple[tuple[str, float], ...] = ()
        if k > 0:
            idx = np.argpartition(-x, k - 1)[:k]
            idx = idx[np.argsort(-x[idx], kind="stable")]
            top = tuple((model.detokenize([int(i)]), float(x[i] - lse)) for i in idx)
        return TokenLogprob(model.detokenize([tok]), float(x[tok] - lse), top)
