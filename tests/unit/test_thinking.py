"""Reasoning switches on the vendored templates: what each API asks (Anthropic
``thinking``, Responses ``reasoning.effort``, chat ``reasoning_effort``) reaches the
variable the template reads, and the prompt changes as the template says it should.
Before these switches only ``enable_thinking`` was set, so every template below but the
Qwen ones ignored them."""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import pytest

from proxy.api.anthropic import parse_messages_request
from proxy.api.chat import ChatRequest
from proxy.api.fields import ApiError
from proxy.api.openai import parse_chat_request
from proxy.api.render import ChatTemplate, render_chat
from proxy.api.responses import chat_request, parse_responses_request

TEMPLATES = Path(__file__).resolve().parents[2] / "vendor" / "templates" / "llama.cpp"
USER = {"role": "user", "content": "hi"}


@cache
def template(name: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"),
                        bos_token="<s>", eos_token="</s>")


def anthropic(**kw: Any) -> ChatRequest:
    return parse_messages_request({"max_tokens": 10, "messages": [USER], **kw})


def chat(**kw: Any) -> ChatRequest:
    return parse_chat_request({"messages": [USER], **kw})


def responses(**kw: Any) -> ChatRequest:
    return chat_request(parse_responses_request({"input": "hi", **kw}), ())


OFF = [anthropic(thinking={"type": "disabled"}), chat(reasoning_effort="none"),
       responses(reasoning={"effort": "none"})]


@pytest.mark.parametrize(("name", "ends"), [
    ("Qwen3.5-4B", "<think>\n\n</think>\n\n"),
    ("Kimi-K3", "<|open|>response<|sep|>"),  # thinking = false
    ("MiniMax-M3", "</mm:think>"),  # thinking_mode = "disabled"
    ("google-gemma-4-31B-it", "<|channel>thought\n<channel|>"),
    ("inclusionai-ling-3.0-flash", "<think></think>"),
    ("Cohere2MoE", "<|START_THINKING|><|END_THINKING|>"),  # reasoning_effort = "none"
])
def test_every_api_switches_reasoning_off(name: str, ends: str) -> None:
    for req in OFF:
        assert render_chat(template(name), req).endswith(ends), (name, req.thinking)


@pytest.mark.parametrize(("name", "req", "ends"), [
    ("MiniMax-M3", anthropic(thinking={"type": "enabled", "budget_tokens": 64}), "<mm:think>"),
    ("deepseek-ai-DeepSeek-V3.1", chat(reasoning_effort="high"), "<think>"),  # off by default
    ("google-gemma-4-31B-it", responses(reasoning={"effort": "low"}), "<|turn>model\n"),
])
def test_switching_reasoning_on(name: str, req: ChatRequest, ends: str) -> None:
    assert render_chat(template(name), req).endswith(ends)
    assert not render_chat(template(name), chat()).endswith(ends)  # not the default


@pytest.mark.parametrize(("name", "req", "text"), [
    ("openai-gpt-oss-120b", chat(reasoning_effort="high"), "Reasoning: high"),
    ("openai-gpt-oss-120b", responses(reasoning={"effort": "low"}), "Reasoning: low"),
    ("openai-gpt-oss-120b", anthropic(thinking={"type": "disabled"}), "Reasoning: low"),
    ("Kimi-K3", chat(reasoning_effort="low"), "`thinking_effort=low`"),
    ("Kimi-K3", chat(reasoning_effort="medium"), "`thinking_effort=high`"),  # its nearest
    ("tencent-Hy3", chat(reasoning_effort="medium"), "reasoning_effort:high"),
    ("tencent-Hy3", chat(reasoning_effort="low"), "reasoning_effort:low"),
    ("ByteDance-Seed-OSS", anthropic(thinking={"type": "enabled", "budget_tokens": 256}),
     "the thinking budget, which is 256"),
    ("ibm-granite-granite-3.3-2B-Instruct", chat(reasoning_effort="medium"),
     "Write your thoughts between <think></think>"),
    ("inclusionai-ling-3.0-flash", anthropic(thinking={"type": "disabled"}),
     "detailed thinking off"),
])
def test_each_template_gets_its_own_variable(name: str, req: ChatRequest, text: str) -> None:
    assert text in render_chat(template(name), req)
    assert text not in render_chat(template(name), chat())


def test_the_clients_template_kwargs_win() -> None:
    req = chat(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True})
    assert render_chat(template("Qwen3.5-4B"), req).endswith("<think>\n")


@pytest.mark.parametrize(("req", "param"), [
    ({"reasoning_effort": "huge"}, "reasoning_effort"),
    ({"reasoning_effort": 3}, "reasoning_effort"),
])
def test_bad_switches_are_400s(req: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        chat(**req)
    assert e.value.param == param
    with pytest.raises(ApiError) as e:
        anthropic(thinking={"type": "enabled", "budget_tokens": -1})
    assert e.value.param == "thinking.budget_tokens"


def test_budgets_as_each_api_asks() -> None:
    assert anthropic(thinking={"type": "enabled", "budget_tokens": 64}).thinking.budget == 64
    assert chat(reasoning_budget_tokens=32).thinking.budget == 32
    assert chat(thinking_budget_tokens=-1).thinking is None  # -1: none, as llama-server
