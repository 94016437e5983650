"""Requests and events passed between the HTTP layer and the engine."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """A request's sampling fields. None: not set, so the ``[sampling]`` config and the
    model's own recommendation apply (proxy/engine/sampling.py resolves them)."""

    temperature: float | None = None  # 0: greedy
    top_p: float | None = None
    top_k: int | None = None  # 0: off
    min_p: float | None = None
    typical_p: float | None = None
    repeat_penalty: float | None = None
    repeat_last_n: int | None = None  # -1: the whole context
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: tuple[str, ...] | None = None
    xtc_probability: float | None = None
    xtc_threshold: float | None = None
    seed: int | None = None  # None: random
    max_tokens: int = 512  # 0: a pre-warm (prefill and cache the prompt, generate nothing)
    stop: tuple[str, ...] = ()
    logprobs: int | None = None  # None: off; k: the chosen token's and k alternatives'
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token, bias); -inf bans the token
    grammar: str = ""  # GBNF with a rule "root" that the whole reply must match
    # (open, close) of the template's reasoning block: when the prompt leaves the reply
    # inside one, the reply may reason first and the grammar applies after ``close``;
    # when it leaves the choice to the model, the reply may open one first
    reasoning: tuple[str, str] | None = None
    # most tokens the reply may spend inside ``reasoning`` before its closer is forced
    reasoning_budget: int | None = None
    speculative: bool | None = None  # False: no drafting for this request
    # False (llama-server's field): this request reuses no cached state and leaves none
    cache_prompt: bool | None = None

    @property
    def greedy(self) -> bool:
        """Whether the request itself asks for greedy decoding."""
        return (self.temperature is not None and self.temperature <= 0.0) or self.top_k == 1


MISS_CAUSES = ("new conversation", "system prompt changed", "tools changed",
               "earlier message edited", "reasoning dropped", "reply re-rendered differently",
               "reply re-tokenized differently", "evicted", "other tenant", "cache off",
               "page missing", "page refused")


@dataclass(slots=True, frozen=True)
class Divergence:
    """Where a prompt leaves the longest conversation the server saw before (the HTTP
    side keeps them): the engine reports it as a miss when it reuses less than that."""

    known: int  # tokens of the prompt that an earlier prompt or reply already held
    cause: str  # one of MISS_CAUSES; "evicted" when nothing in the text diverged
    token: int = -1  # first token that differs (-1: none before ``known``)
    message: int = -1  # index of the message where it differs
    role: str = ""
    old: str = ""  # a short excerpt of the earlier text there
    new: str = ""  # ...and of this prompt's
    # the prompt holds the whole earlier prompt and its reply as generated: this client
    # sends replies back verbatim, so the next turn will continue from the reply's end
    replayed: bool = False
    # the tool-call and reasoning syntax of the template that re-rendered a reply
    family: str = ""

    def describe(self) -> str:
        where = f" at token {self.token:,}" if self.token >= 0 else ""
        if self.message >= 0:
            where += f" (message {self.message}, {self.role or '?'})"
        if self.family:
            where += f" by the {self.family} template"
        text = f": {self.old!r} -> {self.new!r}" if self.old or self.new else ""
        return f"{self.cause}{where}{text}"


@dataclass(slots=True, frozen=True)
class Intake:
    """What the HTTP side spent on a request before the engine had it: when its handler
    began (``time.perf_counter``, the engine's clock) and the seconds of each of its
    parts. The engine counts a request's TTFT from ``t_arrival``."""

    t_arrival: float
    render_s: float = 0.0  # the chat template, the prompt and its history
    tokenize_s: float = 0.0
    points_s: float = 0.0  # share points and breakpoints placed (proxy/api/hints.py)


@dataclass(slots=True, frozen=True, eq=False)
class GenerationRequest:
    """One generation: the prompt already rendered and tokenized."""

    request_id: str
    prompt_tokens: tuple[int, ...] | np.ndarray  # an int32 array goes to the engine as is
    sampling: SamplingParams
    tenant: str = ""
    use_cache: bool = True
    # Tokens of the conversation before the generation prompt (rendered without it);
    # the replay checkpoint goes at the last whole page at or before this point.
    history_tokens: int | None = None
    divergence: Divergence | None = None  # None: nothing earlier shares this prompt
    # Where other conversations may share this prompt (the starts of its first turn's
    # messages and parts): FULL checkpoints at some of them (cache.share_points)
    share_points: tuple[int, ...] = ()
    # A client's cache breakpoints: (tokens, seconds) a FULL checkpoint after that many
    # tokens is kept above ordinary ones for that long
    breakpoints: tuple[tuple[int, float], ...] = ()
    session: str | None = None  # the client's name for the conversation: lane affinity
    intake: Intake | None = None  # the HTTP side's timings (None: not an HTTP request)

    @property
    def prewarm(self) -> bool:
        """Prefill and cache the prompt, generate nothing (``max_tokens`` 0)."""
        return self.sampling.max_tokens == 0


@dataclass(slots=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def to_json(self) -> dict[str, object]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    """One sampled token, its log-probability and the top alternatives (OpenAI form)."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...] = ()

    def to_json(self) -> dict[str, object]:
        def entry(text: str, lp: float) -> dict[str, object]:
            return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
        return {**entry(self.token, self.logprob),
                "top_logprobs": [entry(t, lp) for t, lp in self.top]}


@dataclass(slots=True, frozen=True)
class TokenEvent:
    """Text decoded since the last event (never splits a UTF-8 character)."""

    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


STEP_LOG_MAX = 512  # prefill steps a request's record lists, at most (262,144 tokens)


@dataclass(slots=True)
class RequestStats:
    lane: int = -1
    source: str = "cold"  # cold | lane | the tier it was read from (ram, disk, remote)
    role: str = ""  # role of the checkpoint used, if any
    prefilled: int = 0
    ttft_s: float = 0.0  # from the HTTP handler's start (else from submission) to token one
    http_s: float = 0.0  # the HTTP side's part of it: body, render, tokenize, points
    render_s: float = 0.0
    tokenize_s: float = 0.0
    decode_s: float = 0.0  # inside llama_decode, of the steps this request was in, to token one
    restore_s: float = 0.0  # restoring or cutting back the state this request starts from
    handoff_s: float = 0.0  # saving the lane's previous conversation before reusing the lane
    queue_s: float = 0.0  # waiting for a lane (or for a shared prefix)
    plan_s: float = 0.0  # admission: planning, hand-off and restore together
    prefill_s: float = 0.0  # from admission to the first token
    prefill_steps: int = 0
    # each prefill step before the first token: (its first position, its tokens, seconds
    # inside llama_decode), the first STEP_LOG_MAX of them (GET /admin/requests)
    step_log: list[tuple[int, int, float]] = field(default_factory=list)
    publish_s: float = 0.0  # saving checkpoints during prefill
    checkpoints_added: int = 0
    checkpoint_bytes: int = 0
    decode_tps: float = 0.0
    drafted: int = 0  # speculative decoding: tokens drafted and verified
    accepted: int = 0  # ...of which the target accepted
    miss: str = ""  # why it reused less than an earlier request held ("": it did not)
    # prompt tokens an earlier prompt or reply held (what it could reuse; -1: unknown)
    shared: int = -1
    # why its reply may differ from a cold server's in the last bits (docs/exact.md):
    # empty, it took the exact path (a state a cold prefill writes, one lane a step)
    breaks: list[str] = field(default_factory=list)

    def not_exact(self, why: str) -> None:
        if why not in self.breaks:
            self.breaks.append(why)

    @property
    def outside_s(self) -> float:
        """Of the TTFT, the time not spent inside ``llama_decode``: the server's own."""
        return max(self.ttft_s - self.decode_s, 0.0)


# RequestStats.breaks: what took a request off the exact path
FROM_DECODE = "state from decode"  # it reused a live lane's tokens that a decode wrote
RESTORED = "checkpoint off the grid"  # a default-mode checkpoint (cut at any page)
OFF_GRID = "prefill off the grid"  # a prefill step that starts or ends off the n_ubatch grid
BATCHED = "batched with other lanes"  # a step that carried another lane's tokens too
DRAFTED = "speculative drafts"  # tokens verified in a batch of drafts


@dataclass(slots=True, frozen=True)
class StartEvent:
    """The request has a lane and its plan: how much of the prompt it reuses. Sent before
    its prefill, so an API can report usage (Anthropic's ``message_start``) and open its
    stream before the first token."""

    prompt_tokens: int
    cached_tokens: int


@dataclass(slots=True, frozen=True)
class FinishEvent:
    reason: str  # "stop" | "length" | "cancelled"
    usage: Usage
    stats: RequestStats = field(default_factory=RequestStats)
    stop_sequence: str | None = None  # the stop string that ended the reply, if one did


Event = StartEvent | TokenEvent | FinishEvent


class QueueFull(Exception):
    """Every lane is busy and the wait queue is full (HTTP 503 with Retry-After)."""

    def __init__(self, retry_after: float) -> None:
        super().__init__("server busy: all lanes and the wait queue are full")
        self.retry_after = retry_after
