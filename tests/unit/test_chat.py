"""Chat template rendering: the Gemma 3 fallback and a ChatML template with tools and thinking."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.api.openai import parse_chat_request
from proxy.api.render import (
    FALLBACK_TEMPLATE,
    ChatTemplate,
    keep_thinking_defaults,
    load_chat_template,
    render_chat,
)
from proxy.api.reply import starts_in_reasoning

# A small ChatML template that reads messages the way Qwen3's does: tool_call.function
# when present, arguments through tojson when they are a mapping, reasoning_content.
CHATML = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools><|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{% if message.reasoning_content and (preserve_thinking or loop.last) %}<think>
{{ message.reasoning_content }}
</think>

{% endif %}{{ message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- set call = tool_call.function if tool_call.function else tool_call %}
<tool_call>
{"name": "{{ call.name }}", "arguments": {{ call.arguments if call.arguments is string \
else call.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]

AGENT_TURNS: list[dict[str, Any]] = [
    {"role": "developer", "content": "You are terse."},
    {"role": "user", "content": [{"type": "text", "text": "What is in a.py?"}]},
    {"role": "assistant", "content": None, "reasoning_content": "I must read it.",
     "tool_calls": [{"id": "call_1", "type": "function",
                     "function": {"name": "read_file", "arguments": '{"path": "a.py"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "print('hé')"},
    {"role": "assistant", "content": "It prints hé.", "reasoning": "Easy."},
    {"role": "user", "content": "Thanks"},
]


def _render(template: ChatTemplate, messages: list[dict[str, Any]], **body: object) -> str:
    return render_chat(template, parse_chat_request({"messages": messages, **body}))


def _gemma() -> ChatTemplate:
    return load_chat_template(None, bos_token="<bos>", eos_token="<eos>")


def test_gemma_fallback_turns_and_system_prefix() -> None:
    text = _render(_gemma(), [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "  Hi  "},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ])
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n"
                    "<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nBye<end_of_turn>\n"
                    "<start_of_turn>model\n")


def test_gemma_fallback_tools_as_text_and_tool_turns() -> None:
    messages = [*AGENT_TURNS[:4],
                {"role": "tool", "tool_call_id": "call_2", "content": "second"},
                *AGENT_TURNS[4:]]
    text = _render(_gemma(), messages, tools=TOOLS)
    system_part = text.split("What is in a.py?")[0]
    assert system_part.startswith("<bos><start_of_turn>user\nYou are terse.\n\n")
    assert '<tools>\n{"type": "function", "function": {"name": "read_file"' in system_part
    # Both tool results form one user turn; the call keeps its arguments as sent.
    assert ('<start_of_turn>model\n<tool_call>\n{"name": "read_file", "arguments": '
            '{"path": "a.py"}}\n</tool_call><end_of_turn>\n'
            "<start_of_turn>user\n<tool_response>\nprint('hé')\n</tool_response>\n"
            "<tool_response>\nsecond\n</tool_response><end_of_turn>\n"
            "<start_of_turn>model\nIt prints hé.<end_of_turn>\n") in text
    assert text.endswith("<start_of_turn>user\nThanks<end_of_turn>\n<start_of_turn>model\n")
    assert "I must read it." not in text  # Gemma 3 has no thinking format


def test_gemma_fallback_rejects_roles_out_of_order() -> None:
    # the template itself; render_chat merges such a run first (test_inner_system.py)
    with pytest.raises(ValueError, match="alternate"):
        _gemma().render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(ValueError, match="System messages"):  # the template itself
        _gemma().render([{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                         {"role": "system", "content": "c"}])


def test_chatml_multi_turn_with_tools_and_reasoning() -> None:
    tpl = ChatTemplate(CHATML, origin="test")
    text = _render(tpl, AGENT_TURNS, tools=TOOLS,
                   chat_template_kwargs={"preserve_thinking": False})
    expected = (
        "<|im_start|>system\nYou are terse.\n\n# Tools\n<tools>\n"
        '{"type": "function", "function": {"name": "read_file", "description": "Read a file", '
        '"parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}\n'
        "</tools><|im_end|>\n"
        "<|im_start|>user\nWhat is in a.py?<|im_end|>\n"
        # Reasoning of earlier turns is dropped by this template when asked to.
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\nprint('hé')\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt prints hé.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    assert text == expected
    assert starts_in_reasoning(text)


def test_template_kwargs_reach_the_template() -> None:
    tpl = ChatTemplate(CHATML, origin="test")
    kept = _render(tpl, AGENT_TURNS, tools=TOOLS,
                   chat_template_kwargs={"preserve_thinking": True, "enable_thinking": False})
    assert "<think>\nI must read it.\n</think>" in kept
    assert "<think>\nEasy.\n</think>" in kept  # "reasoning" is read as reasoning_content
    assert kept.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_reasoning(kept)


def test_arguments_reach_templates_parsed_and_at_both_places() -> None:
    tpl = ChatTemplate("{% for m in messages %}{% for c in m.tool_calls or [] %}"
                       "{{ c.function.arguments.path }}|{{ c.arguments.path }}|"
                       "{{ c.function.arguments is mapping }};{% endfor %}{% endfor %}")
    msgs = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"path": "x"}'}},
        {"id": "2", "type": "function", "function": {"name": "f", "arguments": "not json"}},
    ]}]
    assert _render(tpl, msgs) == "x|x|True;||False;"


def test_render_is_deterministic() -> None:
    tpl = ChatTemplate(CHATML)
    first = _render(tpl, AGENT_TURNS, tools=TOOLS)
    assert all(_render(tpl, AGENT_TURNS, tools=TOOLS) == first for _ in range(3))
    assert _render(_gemma(), AGENT_TURNS, tools=TOOLS) == _render(_gemma(), AGENT_TURNS,
                                                                  tools=TOOLS)


def test_raise_exception_is_a_value_error_with_the_message() -> None:
    tpl = ChatTemplate("{{ raise_exception('no tools here, ' + messages[0].role) }}")
    with pytest.raises(ValueError, match="^no tools here, user$"):
        tpl.render([{"role": "user", "content": "x"}])


def test_template_type_errors_become_value_errors() -> None:
    tpl = ChatTemplate("{{ messages[0].content + 1 }}")
    with pytest.raises(ValueError, match="chat template failed"):
        tpl.render([{"role": "user", "content": "x"}])


def test_sandbox_blocks_attribute_escapes() -> None:
    # Unsafe attributes are undefined: printing gives nothing, calling raises.
    assert ChatTemplate("[{{ ().__class__ }}]").render([]) == "[]"
    with pytest.raises(ValueError):
        ChatTemplate("{{ ().__class__.__base__.__subclasses__() }}").render([])
    # a template may change its own lists (Kimi K2's append to one, as llama.cpp's engine
    # allows); the messages it is given are copies, so the caller's stay as they were
    sent = [{"role": "user", "content": "hi"}]
    tpl = ChatTemplate("{% set _ = messages.append({'role': 'x'}) %}{{ messages | length }}")
    assert tpl.render(sent) == "2" and sent == [{"role": "user", "content": "hi"}]


def test_tojson_matches_hf_and_globals_exist() -> None:
    tpl = ChatTemplate("{{ tools | tojson }}|{{ tools[0] | tojson(indent=1) }}|"
                       "{{ strftime_now('%Y') | length }}|{{ bos_token }}{{ eos_token }}",
                       bos_token="<s>", eos_token="</s>")
    out = tpl.render([], tools=[{"é": [1]}])
    assert out == '[{"é": [1]}]|{\n "é": [\n  1\n ]\n}|4|<s></s>'


def test_generation_tag_renders_its_body() -> None:
    assert ChatTemplate("a{% generation %}b{% endgeneration %}c").render([]) == "abc"


def test_reserved_kwargs_rejected() -> None:
    with pytest.raises(ValueError, match="messages"):
        ChatTemplate("x").render([], template_kwargs={"messages": []})


def test_template_source_precedence(tmp_path: Path) -> None:
    override = tmp_path / "t.jinja"
    override.write_text("override")
    assert load_chat_template("gguf", bos_token="", eos_token="",
                              override=override).render([]) == "override"
    assert load_chat_template("gguf", bos_token="", eos_token="").render([]) == "gguf"
    fallback = load_chat_template(None, bos_token="", eos_token="")
    assert fallback.source == FALLBACK_TEMPLATE.read_text()
    assert "fallback" in fallback.origin


def test_bad_template_syntax_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="does not compile"):
        ChatTemplate("{% if %}", origin="the GGUF metadata")


def test_reasoning_is_kept_in_history_by_default() -> None:
    # The template reads preserve_thinking: it is on unless the request says otherwise.
    tpl = ChatTemplate(CHATML, origin="test")
    assert tpl.defaults == {"preserve_thinking": True}
    text = _render(tpl, AGENT_TURNS, tools=TOOLS)
    assert "<think>\nI must read it.\n</think>" in text
    off = _render(tpl, AGENT_TURNS, tools=TOOLS,
                  chat_template_kwargs={"preserve_thinking": False})
    assert "I must read it." not in off


def test_keep_thinking_defaults_follow_the_template() -> None:
    assert keep_thinking_defaults("{% if clear_thinking %}{% endif %}") == {
        "clear_thinking": False}
    assert keep_thinking_defaults("{{ messages }}") == {}
    assert keep_thinking_defaults("{{ preserve_thinking_x }}") == {}
    assert _gemma().defaults == {}
