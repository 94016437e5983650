"""How many drafts each lane verifies (proxy/engine/speculation.py verifies them):
drafting adapts per lane, by expected gain. A verification of ``k`` drafts yields ``1 +
p + ... + p^k`` tokens where each draft is accepted with probability ``p`` (measured per
lane and per source: the drafts accepted and rejected, decaying; prompt lookup's drafts
are three sources, a copy that holds, a long new match, a short one), and makes the step
longer by what ``k`` drafts added to earlier steps (measured: ``StepTimer.verify_s``, as
a share of a step, plus the draft model's own time per drafted token). A step of ``n``
decoding lanes that takes ``S`` seconds yields ``n / S`` tokens a second; a lane drafts
the ``k`` (0 to the source's maximum) that yields the most, from the source (prompt
lookup, or the draft model where one is configured) that yields more. Where neither
beats no drafts, or prompt lookup keeps finding nothing, the lane rests: it decodes as
any other (a lone stream in its fast path; no draft model, and a lookup at each token
only where one costs at most ``WATCH_SHARE`` of a step, drafting at once where it finds
drafts that pay) and probes once after ``PROBE_EVERY`` tokens, twice as long after each
probe that did not pay (``MAX_REST`` at most; nor did one whose drafts were all accepted
where even that loses to steps without them), so a pair where drafting loses pays a
probe a few hundred tokens. A lone lane's probe that finds nothing to draft costs a
lookup in its fast path, not a planned step. The first drafts a lane's prompt lookup
finds are such a probe too: whether a copy goes on is the text's to say, which no
earlier request measured. A draft model asked for drafts that made none (it stops where
it is not sure) counts as rejected on the lane; one that keeps making none is not asked
to measure what its drafts cost, only where its own time would pay, and is probed only
where its lane is nearly in step (a probe first decodes what the lane rested through).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from proxy.engine.build import Parts
from proxy.engine.job import NONE, Drafting, Job, Work
from proxy.engine.timing import StepTimer

DECAY = 0.95  # weight of a lane's earlier drafts against its last verification
MODEL_DECAY = 0.99  # ...and of every lane's, for the record a new request starts from
PROBE_EVERY = 32  # tokens a lane rests before its first probe
MAX_REST = 1024  # longest rest between two probes
MISSES_TO_REST = 4  # steps in a row that found nothing to draft before a lane rests
PROBE_DRAFTS = 2  # drafts a probe verifies, whatever they are expected to yield
MEASURE_ABOVE = 0.25  # how often a draft model makes drafts when asked, to be asked to measure
PRIOR = 24.0  # drafts' worth of this model's record a new request starts from
PROBE_CATCH_UP = 8  # tokens a probe of a draft model that rarely drafts may catch up
# a resting lane checks prompt lookup at every token while a lookup costs at most this
# share of a step (a copy that starts again while the lane rests is drafted at once)
WATCH_SHARE = 0.02
# the sources, as indexes of Drafting.accepted / rejected: prompt lookup's drafts from a
# new match of the shortest length (``lookup_min`` tokens), the draft model's, prompt
# lookup's where the copy the last drafts came from goes on (all of them accepted), and
# from a new match longer than the shortest. Each has a record of its own: a copy that
# holds tends to go on holding, where a new match of two tokens is often a common pair
# of words (docs/design.md, "Drafting from a copy")
LOOKUP, DRAFT, COPY, LONG = 0, 1, 2, 3


def acceptance(spec: Drafting, source: int) -> float:
    """The chance a draft of ``source`` is accepted on this lane (prior: one of each)."""
    a, r = spec.accepted[source], spec.rejected[source]
    return (a + 1.0) / (a + r + 2.0)


def expected_tokens(p: float, k: int) -> float:
    """Tokens a verification of ``k`` drafts yields when each is accepted with ``p``."""
    return sum(p ** i for i in range(k + 1))


def best_length(p: float, k_max: int, lanes: int, step_s: float,
                cost: Callable[[int], float | None]) -> tuple[int, float]:
    """The draft length that yields the most tokens per second in a step of ``lanes``
    decoding lanes that takes ``step_s`` seconds without it, where ``cost(k)`` is what
    ``k`` drafts add (None: not measured yet, so worth measuring), and that rate
    (``lanes / step_s`` for 0: drafting loses)."""
    best, value = 0, lanes / step_s
    for k in range(1, k_max + 1):
        extra = cost(k)
        if extra is None:
            return k_max, float("inf")  # measure it
        v = (lanes - 1 + expected_tokens(p, k)) / (step_s + extra)
        if v > value * 1.0001:
            best, value = k, v
    return best, value


# Prompt lookup's drafts for a job whose lane will hold ``known``, at most ``k``: the
# drafts, where they start, their source (``Speculation.lookup``).
Lookup = Callable[[Job, np.ndarray, int], tuple[np.ndarray, int, int]]


class DraftLength:
    """The draft-length policy: each lane's record of what drafts paid and every lane's,
    what the draft model costs, and whether a lane drafts, rests or probes."""

    def __init__(self, parts: Parts, timer: StepTimer, lookup: Lookup, *, lookup_on: bool,
                 lookup_max: int) -> None:
        self.p = parts
        self.timer = timer
        self._lookup = lookup
        self.lookup_on = lookup_on
        self.lookup_max = lookup_max
        # tokens resting lanes decoded since the draft model was last probed, and how
        # many it waits for (doubling while its probes do not pay)
        self.model_since, self.model_rest = 0, PROBE_EVERY
        self.lanes_decoding = 1  # in the step being planned (plan_step sets it)
        # every lane's record of each source (the draft model, copies that hold, new
        # matches long and short), decaying slowly: where a request starts
        self.accepted, self.rejected = [0.0] * 4, [0.0] * 4
        # ...and how often, asked for drafts, it made any (it stops where it is not sure)
        self.asks, self.answers = 0.0, 0.0
        # where the last request that ended rested: its rest and the tokens it rested
        # through (None: it did not), for a new one on a model where no drafts pay
        self.rested: tuple[int, int] | None = None

    def wants_step(self, job: Job) -> bool:
        """Whether ``job`` drafts at its next step (a resting lane once a probe is due, or
        where prompt lookup finds drafts worth verifying: ``_worth_now``)."""
        spec = job.spec
        if not spec.on:
            return False
        if not spec.resting or spec.since >= spec.rest:
            return True
        return self._worth_now(job)

    def _worth_now(self, job: Job) -> bool:
        """Whether prompt lookup finds drafts for a resting lane that its record says
        pay, checked at every token where a lookup costs at most ``WATCH_SHARE`` of a
        step (the check of a lone lane, in its fast path, costs no planned step): a lane
        rests after the copy it drafted from broke off, or where a new match did not
        pay, and a copy often starts again a few tokens later (a file re-emitted after
        an edit, or after its opening line). No drafts are forced, as in a probe."""
        spec, lane = job.spec, job.lane
        step_s = self.timer.base_s(self.lanes_decoding)
        if not self.lookup_on or lane is None or spec.fresh or len(spec.replay) or \
                step_s <= 0 or self.timer.lookup_s > WATCH_SHARE * step_s:
            return False
        at = (lane.n, job.out.pending)
        if spec.watched[0] == at:  # asked already at this token
            return spec.watched[1]
        known = np.append(lane.tokens, np.int32(job.out.pending))
        found, _, look = self._lookup(job, known, self.lookup_max)
        worth = False
        if len(found):
            p = acceptance(spec, look)
            worth = best_length(p, len(found), self.lanes_decoding, step_s,
                                self.timer.verify_cost)[0] > 0
        spec.watched = (at, worth)
        return worth

    def quiet_probe(self, job: Job) -> bool:
        """A lone lane's due probe, checked in its fast path (``Executor.decode_alone``)
        with ``pending`` not yet decoded: where prompt lookup finds nothing to draft and
        no probe of the draft model is due, the probe is over (the lane rests again,
        twice as long) for the cost of a lookup, not of a planned step; returns whether
        it was."""
        spec, lane = job.spec, job.lane
        assert lane is not None
        if spec.since < spec.rest or spec.fresh or self._model_probe_due(job):
            return False  # (not yet due: ``_worth_now`` found drafts that pay)
        known = np.append(lane.tokens, np.int32(job.out.pending))
        if self.lookup_on and len(self._lookup(job, known, 1)[0]):
            return False
        self.p.meter.spec_probes.inc()
        self.rest(spec)
        return True

    def decoded(self, job: Job, n: int = 1) -> None:
        """``n`` tokens decoded without drafts on ``job``'s lane."""
        if job.spec.resting:
            job.spec.since += n
            self.model_since += n

    def ended(self, spec: Drafting) -> None:
        """A request ended: where its lane rested, for the next request to go on
        resting from (``_rests_from_start``)."""
        self.rested = (spec.rest, spec.since) if spec.resting else None

    def rest(self, spec: Drafting) -> None:
        """Drafting does not pay on this lane now: probe again later."""
        spec.rest = min(spec.rest * 2, MAX_REST)  # 32 tokens first, twice as long after
        spec.resting, spec.probing, spec.since, spec.misses = True, False, 0, 0
        self.p.meter.spec_rests.inc()

    def choose(self, w: Work, known: np.ndarray) -> int:
        """This step's drafts for a decoding lane, by expected gain: prompt lookup's (set
        here), or the draft model's (returns how many to ask it for), or none."""
        job, spec, sc, timer = w.job, w.job.spec, self.p.cfg.speculative, self.timer
        first = spec.fresh  # the request's first decode step
        if first:
            self._prime(spec)
            if sc.adaptive and self._rests_from_start(job):
                return 0
        if spec.resting:  # a probe is due, or drafts that pay were found (_worth_now)
            spec.resting, spec.probing = False, spec.since >= spec.rest
            if spec.probing:
                self.p.meter.spec_probes.inc()
        found, spec.start, look = NONE, -1, LOOKUP
        if self.lookup_on:
            found, spec.start, look = self._lookup(job, known, min(w.room, self.lookup_max))
        if not sc.adaptive:  # every step, the longest a source proposes
            if len(found):
                spec.source, spec.drafts = look, found
                return 0
            spec.source = DRAFT
            return min(w.room, sc.draft_max) if self.p.draft is not None else 0
        lanes = self.lanes_decoding
        step_s = timer.base_s(lanes)
        if step_s <= 0:
            return 0  # this step, without drafts, measures one
        k_look, v_look = best_length(acceptance(spec, look), len(found), lanes, step_s,
                                     timer.verify_cost) if len(found) else (0, 0.0)
        k_model, v_model = 0, 0.0
        if self.p.draft is not None:
            per = timer.model_s
            # a draft lane behind its lane (it rested, or the prompt came from the cache)
            # decodes what it lacks first, once: spread over the tokens this request may
            # still produce, each step bears its share of the tokens it yields
            assert job.lane is not None
            step = len(known) - len(job.lane.tokens)  # followed at every step anyway
            behind = self.p.draft.behind(job.lane.id, known, job.lane.tenant) - step
            left = max(job.req.sampling.max_tokens - len(job.out.generated), 1)
            catch_up = max(behind, 0) * (timer.follow_s or per) / left
            p_model = acceptance(spec, DRAFT)
            answers = self._answer_rate()

            def model_cost(k: int) -> float | None:
                # before any verification: worth one to measure, unless the model, asked
                # again and again, made nothing (then it is asked only where its own
                # time pays, the drafts' cost to the target taken as nothing)
                verify = timer.verify_cost(k)
                if per <= 0 or (verify is None and answers > MEASURE_ABOVE):
                    return None
                return (verify or 0.0) + per * k + catch_up * expected_tokens(p_model, k)
            k_model, v_model = best_length(p_model, min(w.room, sc.draft_max), lanes,
                                           step_s, model_cost)
            if k_model and self._model_loses():
                k_model, v_model = 0, 0.0
        # a probe measures what drafts yield now; so does the first a lane's lookup finds
        # (its record is only the prior then: the text, not the model, decides whether
        # a copy goes on, and a copy of the prompt often starts at the reply's first
        # token)
        untried = spec.accepted[look] + spec.rejected[look] == 0
        if (spec.probing or untried or first) and not (k_model or k_look):
            if len(found) and (spec.probing or untried):
                k_look = min(len(found), PROBE_DRAFTS)
            elif (spec.probing or first) and self._model_probe_due(job):
                # the draft model catches up on what its lane rested through (nothing,
                # at a request's first step: it followed the prefill): probed for every
                # lane at once, as rarely as it keeps not paying, so a model measured
                # to lose is measured again
                self.model_since, self.model_rest = 0, min(self.model_rest * 2, MAX_REST)
                k_model, v_model = min(w.room, PROBE_DRAFTS), 1.0
        if k_model and v_model > v_look:
            spec.source = DRAFT
            return k_model
        if k_look:
            spec.source = look
            spec.drafts = found[:k_look]
            self._drafted(spec)
            return 0
        if len(found) or spec.probing or self.p.draft is not None:  # measured not to pay
            self.rest(spec)
        else:  # nothing to draft this time
            spec.misses += 1
            if spec.misses >= MISSES_TO_REST:
                self.rest(spec)
        return 0

    def answered(self, spec: Drafting) -> None:
        """The draft model was asked for ``spec``'s drafts (it answered with some or none)."""
        self.asks = self.asks * MODEL_DECAY + 1
        self.answers = self.answers * MODEL_DECAY + bool(len(spec.drafts))
        self._drafted(spec)

    def verified(self, spec: Drafting, src: int, accepted: int, drafted: int) -> None:
        """``accepted`` of ``drafted`` drafts of ``src`` held: the lane's record and every
        lane's, and whether the lane rests."""
        spec.accepted[src] = spec.accepted[src] * DECAY + accepted
        spec.rejected[src] = spec.rejected[src] * DECAY + (accepted < drafted)
        self.accepted[src] = self.accepted[src] * MODEL_DECAY + accepted
        self.rejected[src] = self.rejected[src] * MODEL_DECAY + (accepted < drafted)
        probe, spec.probing = spec.probing, False  # a probe is in: the next step weighs it
        if src != DRAFT and spec.start >= 0:  # where the copy goes on, if it does
            spec.cursor = spec.start + accepted + 1
        if accepted == drafted:
            if self._could_pay(drafted):  # drafting pays here: a rest starts short again
                spec.rest = PROBE_EVERY // 2
                if src == DRAFT and not self._model_loses():  # ...and the model's probe
                    self.model_rest = PROBE_EVERY
            elif probe:  # even drafts all accepted lose to steps without them: rest now
                self.rest(spec)

    def _model_probe_due(self, job: Job) -> bool:
        """Whether the draft model (if any) is due a probe on ``job``'s lane: resting
        lanes decoded ``model_rest`` tokens since its last, and the probe is worth its
        catch-up. A probe first decodes what the draft lane lacks (the tokens it rested
        through, a prompt that came from the cache): a model that, asked, rarely makes
        drafts at all, or whose steps were measured to lose (``_model_loses``), is
        probed only where its lane is nearly in step (a new request's first steps), not
        after a rest, where that catch-up would cost as much as
        following every token would have."""
        draft, lane = self.p.draft, job.lane
        if draft is None or self.model_since < self.model_rest:
            return False
        if (self._answer_rate() > MEASURE_ABOVE and not self._model_loses()) or lane is None:
            return True
        return draft.behind(lane.id, lane.tokens, lane.tenant) <= PROBE_CATCH_UP

    def _model_loses(self) -> bool:
        """Whether a lone lane got its tokens slower from steps that asked the draft model
        than from steps without it (``StepTimer.model_yield_s`` against ``alone_s``): the
        whole of what asking it costs, measured, where the estimate from its parts can
        miss some (a model that often declines to draft, a planned step's own cost,
        as hybrid-mid's pair on these cores, bench.speculative). It is then asked only
        in probes."""
        t = self.timer
        return self.lanes_decoding == 1 and t.alone_s > 0 and t.model_yield_s > t.alone_s

    def _answer_rate(self) -> float:
        """How often the draft model, asked for drafts, made any (from one in two)."""
        return (self.answers + 1.0) / (self.asks + 2.0)

    def _rests_from_start(self, job: Job) -> bool:
        """Whether a new request rests from its first step: on a model where no drafts
        pay even were every one accepted (by the costs measured: a tiny model whose step
        of a few tokens costs more than as many steps of one), after a request that
        ended resting, it goes on from that rest and the tokens rested through, so
        probes stay as far apart across requests as along one, where each request
        started over: it planned its first steps, verified the first drafts it found,
        and probed at its 32nd, 96th and 224th tokens. A probe that is due, or one of the
        draft model, is this step."""
        spec, carried = job.spec, self.rested
        if carried is None or self._could_pay(self.lookup_max) or \
                self._model_probe_due(job):
            return False
        spec.rest, spec.since = carried
        spec.resting = True  # (a probe due: planned below, as a lane's after its rest)
        return spec.since < spec.rest

    def _could_pay(self, k: int) -> bool:
        """Whether ``k`` drafts, every one accepted, would beat a step without them by
        the costs measured (unmeasured: they might). Where they would not (a model whose
        step of a few tokens costs more than as many steps of one, as the tiny synthetic
        ones on these cores), a probe that copied well says nothing for the next step,
        and a lane's rest grows as it does after a probe that did not pay."""
        lanes = self.lanes_decoding
        step_s = self.timer.base_s(lanes)
        if step_s <= 0 or self.timer.verify_cost(k) is None:
            return True
        return best_length(1.0, k, lanes, step_s, self.timer.verify_cost)[0] > 0

    def _prime(self, spec: Drafting) -> None:
        """A new request's record of each source: every earlier request's, worth
        ``PRIOR`` drafts at most (how well a draft model agrees with its target is
        theirs, how long a copy goes on once it holds is much the same from one reply
        to the next, and so is how often a new short match starts one). A short
        match's record that started from nothing fell, at a reply's first rejected
        match, to where no later one was drafted on a model whose draft costs most of
        a step (SmolLM2's code-edit turn: docs/speculative.md, "Through the server: the
        rule against fixed lengths")."""
        spec.fresh = False
        for src in (DRAFT, COPY, LONG, LOOKUP):
            a, r = self.accepted[src], self.rejected[src]
            scale = min(1.0, PRIOR / (a + r)) if a + r > 0 else 0.0
            spec.accepted[src] += a * scale  # (a new lane's own record: nothing yet)
            spec.rejected[src] += r * scale

    def _drafted(self, spec: Drafting) -> None:
        """After a source drafted: a draft model that was asked for drafts and made
        none (it was not sure enough of any) counts as a draft rejected, and a miss."""
        if len(spec.drafts):
            spec.misses = 0
            return
        spec.rejected[DRAFT] = spec.rejected[DRAFT] * DECAY + 1
        probe, spec.probing = spec.probing, False
        spec.misses += 1
        # a probe that drafted nothing is answered (not adaptive: every step asks again)
        if (probe or spec.misses >= MISSES_TO_REST) and self.p.cfg.speculative.adaptive:
            self.rest(spec)

