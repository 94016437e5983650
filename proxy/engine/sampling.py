"""From a request's sampling fields to its llama.cpp sampler chain.

Which value applies, field by field: the request's own; else the model's recommendation
in its GGUF metadata (``general.sampling.temp``, ``top_k``, ``top_p``, ``min_p``,
``penalty_repeat``, ``penalty_last_n``, ``xtc_probability``, ``xtc_threshold``) unless
``sampling.model_defaults`` is false; else the ``[sampling]`` config.

The chain follows llama-server's order: logit bias, penalties (repeat, frequency,
presence), DRY, top-k, typical, top-p, min-p, XTC, temperature, then a seeded draw.
Greedy (temperature 0 or top-k 1) keeps only what changes the argmax (bias, penalties,
DRY) and ends in ``greedy``; with none of those it takes the exact argmax of the logits
without a chain. The penalties and DRY also see the prompt's last tokens (as
llama-server's do). A request's ``seed`` seeds the draw and XTC (modulo 2^32 - 1); none
is a random seed.

The grammar, if any, belongs to this request's chain: cached model state never holds
it, so constrained requests reuse cached prefixes like any other. Speculative decoding
is to draft nothing for them (``Sampler.constrained``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from proxy.engine.binding import Context, Model, SamplerChain
from proxy.engine.budget import ReasoningBudget
from proxy.engine.grammar import after_reasoning, may_reason_first
from proxy.engine.types import SamplingParams
from statecache.config import SamplingConfig

log = logging.getLogger(__name__)

DEFAULT_SEED = 0xFFFFFFFF  # llama.cpp's LLAMA_DEFAULT_SEED: a random seed
DRY_BREAKERS = ("\n", ":", '"', "*")  # llama-server's default sequence breakers
MAX_HISTORY = 8192  # prompt tokens fed to the penalties at most
TAIL_TOKENS = 32  # prompt tokens read back to see whether the reply starts in reasoning

# GGUF key -> the field it recommends a value for (llama.cpp's general.sampling.*)
MODEL_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_k": "top_k",
    "general.sampling.top_p": "top_p",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repeat_penalty",
    "general.sampling.penalty_last_n": "repeat_last_n",
    "general.sampling.xtc_probability": "xtc_probability",
    "general.sampling.xtc_threshold": "xtc_threshold",
}
_INTS = frozenset({"top_k", "repeat_last_n", "dry_allowed_length", "dry_penalty_last_n"})


@dataclass(slots=True, frozen=True)
class ChainSpec:
    """Every sampling value resolved: what the chain is built from."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    typical_p: float
    repeat_penalty: float
    repeat_last_n: int
    presence_penalty: float
    frequency_penalty: float
    dry_multiplier: float
    dry_base: float
    dry_allowed_length: int
    dry_penalty_last_n: int
    dry_sequence_breakers: tuple[str, ...]
    xtc_probability: float
    xtc_threshold: float
    seed: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: str = ""
    grammar_root: str = "root"

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalties(self) -> bool:
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or
                                            self.presence_penalty != 0.0 or
                                            self.frequency_penalty != 0.0)

    @property
    def dry(self) -> bool:
        return self.dry_multiplier > 0.0 and self.dry_penalty_last_n != 0

    @property
    def exact_argmax(self) -> bool:
        """Greedy with nothing that changes the logits: no chain needed."""
        return self.greedy and not (self.logit_bias or self.penalties or self.dry
                                    or self.grammar)

    @property
    def history(self) -> int:
        """Prompt tokens the penalties and DRY look back over (-1: all of them)."""
        windows = [n for n, on in ((self.repeat_last_n, self.penalties),
                                   (self.dry_penalty_last_n, self.dry)) if on]
        return -1 if -1 in windows else max(windows, default=0)


def model_defaults(metadata: Mapping[str, str]) -> dict[str, float | int]:
    """The sampling values a GGUF recommends (``general.sampling.*``); unreadable ones are
    skipped with a warning."""
    out: dict[str, float | int] = {}
    for key, name in MODEL_KEYS.items():
        raw = metadata.get(key)
        if raw is None:
            continue
        try:
            value = float(raw)
        except ValueError:
            log.warning("ignoring %s = %r: not a number", key, raw)
            continue
        if not math.isfinite(value):
            log.warning("ignoring %s = %r", key, raw)
            continue
        out[name] = int(value) if name in _INTS else value
    return out


def defaults(cfg: SamplingConfig, metadata: Mapping[str, str]) -> dict[str, float | int]:
    """The value of every field a request leaves unset: the config, then the model's."""
    out: dict[str, float | int] = {f.name: getattr(cfg, f.name)
                                   for f in dataclasses.fields(cfg) if f.name != "model_defaults"}
    if cfg.model_defaults:
        out.update(model_defaults(metadata))
    return out


def starts_in_reasoning(prompt_tail: str, tags: tuple[str, str]) -> bool:
    """Whether a prompt ending in ``prompt_tail`` leaves the reply inside an open block."""
    return prompt_tail.rfind(tags[0]) > prompt_tail.rfind(tags[1])


def closed_empty(prompt_tail: str, tags: tuple[str, str]) -> bool:
    """Whether the prompt ends in an empty reasoning block (thinking switched off)."""
    pattern = re.escape(tags[0].strip()) + r"\s*" + re.escape(tags[1].strip()) + r"\s*$"
    return re.search(pattern, prompt_tail) is not None


def resolve(params: SamplingParams, base: Mapping[str, float | int], *,
            prompt_tail: str = "") -> ChainSpec:
    """The request's values over ``base`` (from ``defaults``), its grammar made to follow
    the reasoning a thinking template opened in the prompt, or to allow the reasoning a
    model may open itself where the prompt leaves it the choice."""
    values: dict[str, object] = {}
    for f in dataclasses.fields(ChainSpec):
        if f.name in base:
            mine = getattr(params, f.name)
            values[f.name] = base[f.name] if mine is None else mine
    grammar, root = params.grammar, "root"
    if grammar and params.reasoning and starts_in_reasoning(prompt_tail, params.reasoning):
        grammar, root = after_reasoning(grammar, params.reasoning[1])
    elif grammar and params.reasoning and not closed_empty(prompt_tail, params.reasoning):
        # the template left reasoning to the model (thinking on, the block not opened)
        grammar, root = may_reason_first(grammar, *params.reasoning)
    return ChainSpec(**values,  # type: ignore[arg-type]
                     dry_sequence_breakers=params.dry_sequence_breakers or DRY_BREAKERS,
                     seed=params.seed, logit_bias=params.logit_bias, grammar=grammar,
                     grammar_root=root)


def build_chain(model: Model, spec: ChainSpec) -> SamplerChain:
    chain = SamplerChain(model, spec.grammar, spec.grammar_root)
    try:
        seed = DEFAULT_SEED if spec.seed is None else spec.seed % DEFAULT_SEED
        if spec.logit_bias:
            chain.logit_bias(spec.logit_bias)
        if spec.penalties:
            chain.penalties(_window(spec.repeat_last_n), spec.repeat_penalty,
                            spec.frequency_penalty, spec.presence_penalty)
        if spec.dry:
            chain.dry(spec.dry_multiplier, spec.dry_base, spec.dry_allowed_length,
                      _window(spec.dry_penalty_last_n), spec.dry_sequence_breakers)
        if spec.greedy:
            chain.greedy()
        else:
            _add_filters(chain, spec, seed)
    except BaseException:
        chain.close()
        raise
    return chain


def _add_filters(chain: SamplerChain, spec: ChainSpec, seed: int) -> None:
    if spec.top_k > 0:
        chain.top_k(spec.top_k)
    if spec.typical_p < 1.0:
        chain.typical(spec.typical_p)
    if spec.top_p < 1.0:
        chain.top_p(spec.top_p)
    if spec.min_p > 0.0:
        chain.min_p(spec.min_p)
    if spec.xtc_probability > 0.0:
        chain.xtc(spec.xtc_probability, spec.xtc_threshold, seed)
    chain.temperature(spec.temperature)
    chain.dist(seed)


def _window(last_n: int) -> int:
    # llama.cpp's penalties take no -1: "the whole context" is as far back as they can see
    return MAX_HISTORY if last_n < 0 else last_n


class Sampler:
    """One request's sampling: the exact argmax of the logits, or its chain; with a
    reasoning budget, the closer it forces once the budget is spent."""

    def __init__(self, model: Model, spec: ChainSpec, prompt: np.ndarray,
                 budget: ReasoningBudget | None = None) -> None:
        self.spec = spec
        self.budget = budget
        self._pieces = model.token_bytes
        self.chain: SamplerChain | None = None
        if not spec.exact_argmax:
            self.chain = build_chain(model, spec)
            n = spec.history
            n = len(prompt) if n < 0 else n
            for tok in prompt[max(len(prompt) - min(n, MAX_HISTORY), 0):].tolist():
                self.chain.accept(tok)  # the penalties see the prompt, as llama-server's do

    @property
    def constrained(self) -> bool:
        """Whether a grammar or a reasoning budget constrains the reply: a drafted token
        would have to pass them too, so speculative decoding drafts nothing for it."""
        return bool(self.spec.grammar) or self.budget is not None

    def sample(self, ctx: Context, row: int, logits: np.ndarray | None = None) -> int:
        """The next token from output row ``row`` of the last decode, or from ``logits``
        (a row kept apart) where given."""
        if self.budget is None:
            return self._sample(ctx, row, logits)
        tok = self.budget.next_forced()
        if tok is not None and (self.chain is None or self.chain.allows(tok)):
            if self.chain is not None:
                self.chain.take(tok)
        else:
            if tok is not None:
                self.budget.refused()
            tok = self._sample(ctx, row, logits)
        self.budget.accept(tok, self._pieces(tok))
        return tok

    def _sample(self, ctx: Context, row: int, logits: np.ndarray | None) -> int:
        if logits is not None:
            return int(logits.argmax()) if self.chain is None else \
                self.chain.sample_logits(logits)
        if self.chain is None:
            return int(ctx.logits_view(row).argmax())  # no copy of the vocabulary
        return self.chain.sample(ctx, row)

    def close(self) -> None:
        if self.chain is not None:
            self.chain.close()


def make_sampler(model: Model, params: SamplingParams, cfg: SamplingConfig,
                 prompt: np.ndarray) -> Sampler:
    """The sampler of a request whose prompt is ``prompt``; ValueError for a logit_bias
    token the vocabulary lacks (llama.cpp would ignore it)."""
    check_logit_bias(params, model.n_vocab)
    tail = model.detokenize(prompt[-TAIL_TOKENS:].tolist()) if params.reasoning else ""
    spec = resolve(params, defaults(cfg, model.metadata), prompt_tail=tail)
    budget = None
    if params.reasoning_budget is not None and params.reasoning:
        try:
            forced = model.tokenize(params.reasoning[1], parse_special=True)
        except ValueError:  # a closer the vocabulary cannot write: no budget to keep
            log.warning("the reasoning closer %r is not in this model's vocabulary; the "
                        "reasoning budget is not kept", params.reasoning[1])
        else:
            budget = ReasoningBudget(params.reasoning_budget, params.reasoning, forced,
                                     starts_in_reasoning(tail, params.reasoning))
    return Sampler(model, spec, prompt, budget)


def check_logit_bias(params: SamplingParams, n_vocab: int) -> None:
    """ValueError for a logit_bias token the vocabulary does not have."""
    bad = [t for t, _ in params.logit_bias if not 0 <= t < n_vocab]
    if bad:
        raise ValueError(f"'logit_bias' names token {bad[0]}, but this model's vocabulary "
                         f"has tokens 0 to {n_vocab - 1}")
