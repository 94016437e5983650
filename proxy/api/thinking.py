"""Reasoning switches: what a request asks of the model's reasoning, in each API's words,
set as the variables the model's chat template reads.

Asked as (``Thinking``): on or off, an effort, a budget of tokens.
- Anthropic ``thinking``: ``{"type": "enabled", "budget_tokens": N}`` on with a budget,
  ``{"type": "disabled"}`` off, ``adaptive`` the template's default;
- Responses ``reasoning.effort`` and chat ``reasoning_effort``: ``none`` off, any other
  effort on at that effort (as llama-server reads ``reasoning_effort``);
- chat ``reasoning_budget_tokens`` / ``thinking_budget_tokens`` (llama-server's names): a
  budget;
- ``chat_template_kwargs`` are the template's variables as sent, and win over all this.

Set as (read off the template's source when it loads, ``switches_of``): ``enable_thinking``
(Qwen3, Qwen3.5, GLM, Gemma 4, SmolLM3, Nemotron 3, DeepSeek, MiniCPM, Laguna ...),
``thinking`` (Kimi K3, DeepSeek V3.1 to V4, Granite 3.3), ``thinking_mode`` (MiniMax M3:
enabled/disabled), ``thinking_option`` (Ling: on/off), ``skip_thinking`` (Cohere 2),
``reasoning_effort`` (gpt-oss low/medium/high, DeepSeek V4, Hunyuan, Solar, Cohere 2; off:
the value the template compares it with for that, "none" or "no_think", else "low":
gpt-oss cannot switch it off), ``thinking_effort`` (Kimi K3), ``reasoning_strength`` (Muse
Glimmer) and ``thinking_budget`` (Seed-OSS: the budget in tokens, 0 off). An effort goes
as asked, except where the template refuses all but a list of its own (Hunyuan's
no_think/low/high, Kimi K3's low/high/max): then the nearest it takes, higher first. A
template that reads none (Magistral's reasoning system prompt is its own text) renders as
it would anyway.

The budget itself is kept by the engine (proxy/engine/budget.py): at the budget it forces
the family's reasoning closer, as llama-server's ``--reasoning-budget`` does.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.api.chat import ChatRequest, Thinking
from proxy.api.conventions import reads
from proxy.api.fields import ApiError, obj, opt_int
from proxy.api.syntax.calls import Syntax

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
LEVELS = EFFORTS[1:]  # in order
SWITCHES = ("enable_thinking", "thinking", "thinking_mode", "thinking_option",
            "skip_thinking", "reasoning_effort", "thinking_effort", "reasoning_strength",
            "thinking_budget")
OFF_WORDS = ("none", "no_think", "off", "disabled")  # an effort that means no reasoning
_LITERAL = r"""['"]([\w-]+)['"]"""


@dataclass(slots=True, frozen=True)
class Switches:
    """The reasoning variables a template reads; for an effort variable the template
    checks against a list (and refuses others), that list."""

    reads: frozenset[str] = frozenset()
    effort_off: str = "low"  # the reasoning_effort that switches reasoning off
    allowed: tuple[tuple[str, tuple[str, ...]], ...] = ()


def switches_of(source: str) -> Switches:
    compared = re.findall(r"reasoning_effort(?:\s*\|\s*\w+)*\s*(?:==|!=)\s*" + _LITERAL,
                          source) + [
        w for group in re.findall(r"reasoning_effort\s+(?:not\s+)?in\s*\[([^\]]*)\]", source)
        for w in re.findall(_LITERAL, group)]
    off = next((w for w in OFF_WORDS if w in compared), "low")
    allowed = []
    for name in ("reasoning_effort", "thinking_effort"):
        m = re.search(rf"{name}\s+not\s+in\s*\[([^\]]*)\]", source)
        if m is not None:
            allowed.append((name, tuple(re.findall(_LITERAL, m.group(1)))))
    return Switches(reads(source, SWITCHES), off, tuple(allowed))


def _level(effort: str, name: str, s: Switches) -> str:
    """``effort`` as the template takes it: the nearest level it allows, higher first."""
    allowed = dict(s.allowed).get(name)
    if not allowed or effort in allowed:
        return effort
    levels = [w for w in LEVELS if w in allowed]
    if not levels:
        return effort
    at = LEVELS.index(effort)
    higher = [w for w in levels if LEVELS.index(w) >= at]
    return higher[0] if higher else levels[-1]


def from_effort(effort: str | None, param: str, budget: int | None = None) -> Thinking | None:
    if effort is None:
        return Thinking(budget=budget) if budget is not None else None
    if effort not in EFFORTS:
        raise ApiError(f"'{param}' must be one of {', '.join(EFFORTS)}", param)
    if effort == "none":
        return Thinking(on=False)
    return Thinking(on=True, effort=effort, budget=budget)


def chat_thinking(body: Mapping[str, Any]) -> Thinking | None:
    """Chat completions' reasoning_effort and llama-server's budget fields."""
    budget = None
    for key in ("reasoning_budget_tokens", "thinking_budget_tokens"):
        v = opt_int(body, key)
        if v is not None and v >= 0:  # -1: no budget, as llama-server reads it
            budget = v
    effort = body.get("reasoning_effort")
    if effort is not None and not isinstance(effort, str):
        raise ApiError("'reasoning_effort' must be a string", "reasoning_effort")
    return from_effort(effort, "reasoning_effort", budget)


ANTHROPIC_ON = ("enabled", "adaptive", "between_tools")


def anthropic_thinking(v: object) -> Thinking | None:
    """Anthropic's ``thinking`` field."""
    if v is None:
        return None
    spec = obj(v, "thinking")
    kind = spec.get("type")
    if kind == "disabled":
        return Thinking(on=False)
    if kind == "enabled":
        budget = spec.get("budget_tokens")
        if budget is not None and (not isinstance(budget, int) or isinstance(budget, bool)
                                   or budget < 0):
            raise ApiError("'thinking.budget_tokens' must be a non-negative integer",
                           "thinking.budget_tokens")
        return Thinking(on=True, budget=budget)
    if kind in ANTHROPIC_ON:
        return None
    raise ApiError(f"'thinking.type' must be one of {', '.join(ANTHROPIC_ON)} or "
                   "'disabled'", "thinking.type")


def template_switches(thinking: Thinking | None, s: Switches) -> dict[str, Any]:
    """The variables ``thinking`` sets in a template that reads ``s``."""
    if thinking is None:
        return {}
    out: dict[str, Any] = {}
    on, r = thinking.on, s.reads
    if on is not None:
        for name, value in (("enable_thinking", on), ("thinking", on),
                            ("thinking_mode", "enabled" if on else "disabled"),
                            ("thinking_option", "on" if on else "off"),
                            ("skip_thinking", not on)):
            if name in r:
                out[name] = value
        if not on and "reasoning_effort" in r:
            out["reasoning_effort"] = s.effort_off
        if not on and "thinking_budget" in r:
            out["thinking_budget"] = 0
    effort = thinking.effort
    if effort is not None and on is not False:
        for name in ("reasoning_effort", "thinking_effort", "reasoning_strength"):
            if name in r:
                out[name] = _level(effort, name, s)
    if thinking.budget is not None and on is not False and "thinking_budget" in r:
        out["thinking_budget"] = thinking.budget
    return out


def with_budget(chat: ChatRequest, syntax: Syntax) -> ChatRequest:
    """``chat`` with its reasoning budget for the engine to keep, in the family's tags."""
    t = chat.thinking
    tags = syntax.grammar_reasoning
    if t is None or t.budget is None or t.on is False or tags is None:
        return chat
    return dataclasses.replace(chat, sampling=dataclasses.replace(
        chat.sampling, reasoning_budget=t.budget,
        reasoning=chat.sampling.reasoning or tags))
