"""A forced call lets the model reason first, as each template leaves it to: after the
reasoning the generation prompt opens, or after one the model may open itself where the
prompt leaves the choice to it (llama.cpp's lazy grammars start at their trigger), and
never where the prompt closed it empty. Real templates' prompts, the grammar llama.cpp
parses."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.api.render import ChatTemplate
from proxy.api.structured import reply_grammar
from proxy.api.syntax.probe import PROBE_TOOLS
from proxy.engine.grammar import check_grammar, literal
from proxy.engine.sampling import defaults, resolve
from proxy.engine.types import SamplingParams
from statecache.config import SamplingConfig

TEMPLATES = Path(__file__).resolve().parents[2] / "vendor" / "templates" / "llama.cpp"


def _spec(name: str, kwargs: dict[str, object] | None = None) -> tuple[str, str, str]:
    t = ChatTemplate((TEMPLATES / name).read_text(encoding="utf-8"), bos_token="<s>",
                     eos_token="</s>")
    prompt = t.render([{"role": "user", "content": "hi"}], tools=PROBE_TOOLS,
                      template_kwargs=kwargs)
    grammar = reply_grammar(json_schema=None, json_path="response_format", tools=PROBE_TOOLS,
                            tool_choice="required", parallel=True, form=t.call_form)
    params = SamplingParams(grammar=grammar, reasoning=t.syntax.grammar_reasoning)
    spec = resolve(params, defaults(SamplingConfig(), {}), prompt_tail=prompt[-200:])
    check_grammar(spec.grammar, spec.grammar_root)
    head = literal(t.call_form.head("read_file")) if t.call_form else ""
    return spec.grammar, spec.grammar_root, head


@pytest.mark.parametrize(("name", "opens"), [
    ("Qwen-Qwen3-0.6B.jinja", "<think>"),  # the model opens <think> itself
    ("openai-gpt-oss-120b.jinja", "<|channel|>analysis<|message|>"),  # Harmony's analysis
    ("MiniMax-M3.jinja", "<mm:think>"),  # adaptive thinking
])
def test_the_model_may_reason_before_a_forced_call(name: str, opens: str) -> None:
    grammar, root, head = _spec(name)
    assert root == "reasoned-root"
    rule = next(r for r in grammar.splitlines() if r.startswith("reasoned-root ::="))
    assert rule.startswith(f"reasoned-root ::= ( {literal(opens)} reasoning-text")
    assert rule.endswith(")? root")  # optional: the call may come at once
    assert head in grammar


def test_after_the_reasoning_the_prompt_opened() -> None:
    grammar, root, _ = _spec("Qwen3.5-4B.jinja")  # its prompt ends in "<think>\n"
    assert root == "reasoned-root"
    rule = next(r for r in grammar.splitlines() if r.startswith("reasoned-root ::="))
    assert rule.startswith("reasoned-root ::= reasoning-text")


@pytest.mark.parametrize(("name", "kwargs"), [
    ("Qwen-Qwen3-0.6B.jinja", {"enable_thinking": False}),  # "<think>\n\n</think>\n\n"
    ("google-gemma-4-31B-it.jinja", None),  # thinking off: an empty thought channel
])
def test_no_reasoning_where_the_prompt_closed_it(name: str, kwargs: dict[str, object] | None
                                                 ) -> None:
    _, root, _ = _spec(name, kwargs)
    assert root == "root"
