"""The sampling fields of an OpenAI body (chat completions and completions), as the
engine's own record, ``SamplingParams``; and that record made final for the engine.

Sampling runs on llama.cpp's sampler chain (proxy/engine/sampling.py): OpenAI's
``temperature``, ``top_p``, ``seed``, ``stop``, ``logit_bias`` (token id -> bias in
[-100, 100]; ``false`` bans it, as llama-server reads it), ``presence_penalty``,
``frequency_penalty``, ``logprobs``; llama-server's ``top_k``, ``min_p``, ``typical_p``,
``repeat_penalty`` (``repetition_penalty`` too), ``repeat_last_n``, ``dry_*``, ``xtc_*``,
``grammar`` (GBNF) and ``json_schema``. A field left out takes the ``[sampling]``
config's value, or the model's own recommendation in its GGUF.

- ``max_completion_tokens`` wins over ``max_tokens`` when both are given; the request
  keeps what was asked until the prompt's length is known (``to_params``).
- ``top_k`` of -1 (vLLM's "off") is read as 0 (off here).
- ``seed`` of -1 means "random" (llama.cpp's convention), as an absent seed does.
- A ``temperature`` above 0 but below ``MIN_TEMPERATURE`` is greedy: dividing logits
  by it would overflow, and sampling at it is greedy in effect (every API's, in
  ``to_params``).
- ``speculative`` and llama-server's ``cache_prompt`` are not sampling but ride along
  (``engine_fields``): how the engine serves the request, read the same on every API.
- Fields that would not act are refused by name (400) when set to anything but their
  default: llama-server's ``mirostat``, ``ignore_eos``, ``n_probs``, ``top_n_sigma``,
  ``dynatemp_range``, ``samplers``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from proxy.api.fields import ApiError, opt_bool, opt_float, opt_int, opt_str, refuse_set
from proxy.api.structured import REASONING, constraint
from proxy.engine.grammar import check_grammar
from proxy.engine.types import SamplingParams

MAX_STOP = 4
MIN_TEMPERATURE = 1e-6
MAX_SEED = 2**64 - 1
MAX_LOGIT_BIAS = 1024
MAX_GRAMMAR = 256 * 1024
MAX_BREAKERS = 32
MAX_TOP_LOGPROBS = 20
# llama-server's sampling fields that would not act here, with their defaults
UNSUPPORTED = (("mirostat", 0), ("ignore_eos", False), ("n_probs", 0), ("top_n_sigma", -1),
               ("dynatemp_range", 0), ("samplers", None))


def to_params(sampling: SamplingParams, max_tokens: int) -> SamplingParams:
    """The engine's record of a request: ``max_tokens`` as the prompt's length allows it,
    and a vanishing temperature greedy (every API's parser leaves it to here)."""
    t = sampling.temperature
    return dataclasses.replace(
        sampling, max_tokens=max_tokens,
        temperature=0.0 if t is not None and t < MIN_TEMPERATURE else t)


def parse_sampling(body: Mapping[str, Any]) -> tuple[SamplingParams, int | None]:
    """The sampling fields both OpenAI endpoints share (chat adds its constraints later),
    and the ``max_tokens`` asked (None: not given)."""
    refuse_set(body, UNSUPPORTED)
    top_k = opt_int(body, "top_k", lo=-1)
    max_tokens = opt_int(body, "max_tokens", lo=0)  # 0: a pre-warm (prefill and cache only)
    max_completion = opt_int(body, "max_completion_tokens", lo=0)
    sampling = SamplingParams(
        temperature=_temperature(body),
        top_p=opt_float(body, "top_p", 0.0, 1.0, lo_open=True),
        top_k=0 if top_k == -1 else top_k,
        min_p=opt_float(body, "min_p", 0.0, 1.0),
        typical_p=opt_float(body, "typical_p", 0.0, 1.0, lo_open=True),
        repeat_penalty=_repeat_penalty(body),
        repeat_last_n=opt_int(body, "repeat_last_n", lo=-1),
        presence_penalty=opt_float(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=opt_float(body, "frequency_penalty", -2.0, 2.0),
        dry_multiplier=opt_float(body, "dry_multiplier", 0.0, 100.0),
        dry_base=opt_float(body, "dry_base", 1.0, 100.0),
        dry_allowed_length=opt_int(body, "dry_allowed_length", lo=0),
        dry_penalty_last_n=opt_int(body, "dry_penalty_last_n", lo=-1),
        dry_sequence_breakers=_breakers(body),
        xtc_probability=opt_float(body, "xtc_probability", 0.0, 1.0),
        xtc_threshold=opt_float(body, "xtc_threshold", 0.0, 1.0),
        seed=_seed(body),
        stop=_stop(body),
        logit_bias=_logit_bias(body),
        **engine_fields(body),
        **grammar_fields(body),
    )
    return sampling, max_completion if max_completion is not None else max_tokens


def _stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise ApiError("'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP:
        raise ApiError(f"'stop' may hold at most {MAX_STOP} strings, got {len(items)}", "stop")
    if any(s == "" for s in items):
        raise ApiError("'stop' strings must not be empty", "stop")
    return tuple(items)


def _seed(body: Mapping[str, Any]) -> int | None:
    seed = opt_int(body, "seed", lo=-1)
    if seed is not None and seed > MAX_SEED:
        raise ApiError(f"'seed' must be at most {MAX_SEED} (or -1 for random), got {seed}",
                       "seed")
    return None if seed == -1 else seed


def _temperature(body: Mapping[str, Any]) -> float | None:
    t = opt_float(body, "temperature", 0.0, 2.0)
    return 0.0 if t is not None and t < MIN_TEMPERATURE else t


def _repeat_penalty(body: Mapping[str, Any]) -> float | None:
    """llama-server's ``repeat_penalty``, or vLLM's name for it."""
    key = "repeat_penalty" if body.get("repeat_penalty") is not None else "repetition_penalty"
    return opt_float(body, key, 0.0, 100.0, lo_open=True)


def _breakers(body: Mapping[str, Any]) -> tuple[str, ...] | None:
    v = body.get("dry_sequence_breakers")
    if v is None:
        return None
    if (not isinstance(v, list) or len(v) > MAX_BREAKERS
            or not all(isinstance(s, str) and s for s in v)):
        raise ApiError(f"'dry_sequence_breakers' must be a list of at most {MAX_BREAKERS} "
                       "non-empty strings", "dry_sequence_breakers")
    return tuple(v)


def _logit_bias(body: Mapping[str, Any]) -> tuple[tuple[int, float], ...]:
    """OpenAI's {"token id": bias}; ``false`` bans the token (llama-server's reading)."""
    v = body.get("logit_bias")
    if v is None:
        return ()
    if not isinstance(v, dict):
        raise ApiError("'logit_bias' must be an object mapping token ids to biases",
                       "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise ApiError(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS} tokens", "logit_bias")
    out: list[tuple[int, float]] = []
    for key, bias in v.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()
                and int(key) < 2**31):
            raise ApiError(f"'logit_bias' keys must be token ids (non-negative integers), "
                           f"got {key!r}", "logit_bias")
        if bias is False:
            out.append((int(key), float("-inf")))
            continue
        if (not isinstance(bias, int | float) or isinstance(bias, bool)
                or not -100 <= bias <= 100):
            raise ApiError(f"'logit_bias' values must be numbers in [-100, 100] (or false), "
                           f"got {bias!r} for token {key}", "logit_bias")
        out.append((int(key), float(bias)))
    return tuple(out)


def engine_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """The fields every API reads that say how the engine serves the request, not what
    it samples: ``speculative`` (False: no drafting) and llama-server's ``cache_prompt``
    (False: nothing cached is reused and nothing is left cached)."""
    return {"speculative": opt_bool(body, "speculative"),
            "cache_prompt": opt_bool(body, "cache_prompt")}


def grammar_fields(body: Mapping[str, Any]) -> dict[str, Any]:
    """llama-server's ``grammar`` (GBNF: the whole reply must match it) or ``json_schema``
    (the reply, after any reasoning, is JSON that validates): SamplingParams' fields."""
    text = opt_str(body, "grammar")
    schema = body.get("json_schema")
    if text and schema is not None:
        raise ApiError("give either 'grammar' or 'json_schema', not both", "json_schema")
    if schema is not None:
        if not isinstance(schema, dict):
            raise ApiError("'json_schema' must be an object (a JSON schema)", "json_schema")
        return {"grammar": constraint(json_schema=schema, json_path="json_schema"),
                "reasoning": REASONING}
    if not text:
        return {}
    if len(text) > MAX_GRAMMAR:
        raise ApiError(f"'grammar' may be at most {MAX_GRAMMAR:,} characters", "grammar")
    try:
        check_grammar(text)
    except ValueError as e:
        raise ApiError(f"'grammar': {e}", "grammar") from None
    return {"grammar": text}


def chat_logprobs(body: Mapping[str, Any]) -> int | None:
    """Chat: ``logprobs`` (bool) turns them on, ``top_logprobs`` (0-20) adds alternatives."""
    on = opt_bool(body, "logprobs")
    top = opt_int(body, "top_logprobs", lo=0)
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise ApiError(f"'top_logprobs' must be at most {MAX_TOP_LOGPROBS}", "top_logprobs")
    if top is not None and not on:
        raise ApiError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def completion_logprobs(body: Mapping[str, Any]) -> int | None:
    """Completions: ``logprobs`` is the number of alternatives (0-5)."""
    n = opt_int(body, "logprobs", lo=0)
    if n is not None and n > 5:
        raise ApiError("'logprobs' must be at most 5", "logprobs")
    return n
