"""Each vendored template's own rendering of tool calls, through the parser its probe
picks: the syntax found, the calls read back typed, every split of the reply streamed,
the form of a forced call, and the grammar built in that form.

The replies are the templates' renders of an assistant turn with reasoning and two
calls (one where the template renders only the first), read from where the generation
prompt ends: what the model would write, in the template's own words.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest

from proxy.api.render import ChatTemplate
from proxy.api.reply import StreamParser, parse_reply, starts_in_reasoning
from proxy.api.structured import reply_grammar
from proxy.api.syntax.calls import Delta
from proxy.api.syntax.probe import PROBE_TOOLS, TOOL_FORMATS, probe_reply
from proxy.engine.grammar import check_grammar, literal
from statecache import config

TEMPLATES = Path(__file__).resolve().parents[2] / "vendor" / "templates" / "llama.cpp"
CALLS = (("zqcA1b2C3", {"path": "src/a b.py", "limit": 5}),
         ("zqcZ9y8X7", {"path": "two\nlines.md"}))

# The syntax each template writes; none: the template renders no tool calls
EXPECTED = {
    "Apertus-8B-Instruct": "apertus", "Apriel-1.6-15b-Thinker-fixed": "tool-calls-json",
    "Bielik-11B-v3.0-Instruct": "hermes", "ByteDance-Seed-OSS": "seed-oss",
    "Cohere2MoE": "command-r", "CohereForAI-c4ai-command-r-plus-tool_use": "command-r",
    "CohereForAI-c4ai-command-r7b-12-2024-tool_use": "command-r", "GLM-4.6": "glm",
    "GLM-4.7-Flash": "glm", "GigaChat3-10B-A1.8B": "gigachat",
    "GigaChat3.1-10B-A1.8B": "gigachat", "HuggingFaceTB-SmolLM3-3B": "none",
    "Kimi-K2-Instruct": "kimi-k2", "Kimi-K2-Thinking": "kimi-k2", "Kimi-K3": "kimi-k3",
    "LFM2-8B-A1B": "lfm2", "LFM2.5-8B-A1B": "lfm2", "LFM2.5-Instruct": "none",
    "MiMo-VL": "hermes", "MiniMax-M1": "tool-calls-json", "MiniMax-M2": "minimax-m2",
    "MiniMax-M3": "minimax-m3", "Mistral-Small-3.2-24B-Instruct-2506": "mistral",
    "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16": "qwen3-xml", "NVIDIA-Nemotron-Nano-v2":
    "nemotron-v2", "NousResearch-Hermes-2-Pro-Llama-3-8B-tool_use": "hermes",
    "NousResearch-Hermes-3-Llama-3.1-8B-tool_use": "hermes", "Qwen-QwQ-32B": "hermes",
    "Qwen-Qwen2.5-7B-Instruct": "hermes", "Qwen-Qwen3-0.6B": "hermes",
    "Qwen3-Coder": "qwen3-xml", "Qwen3.5-4B": "qwen3-xml", "Reka-Edge": "hermes",
    "Spark2.5": "glm", "StepFun3.5-Flash": "qwen3-xml",
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": "deepseek",
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": "deepseek",
    "deepseek-ai-DeepSeek-V3.1": "deepseek", "deepseek-ai-DeepSeek-V3.2": "deepseek-dsml",
    "deepseek-ai-DeepSeek-V4-Flash-0731": "deepseek-dsml",
    "deepseek-ai-DeepSeek-V4": "deepseek-dsml",
    "fireworks-ai-llama-3-firefunction-v2": "firefunction", "google-gemma-2-2b-it": "none",
    "google-gemma-4-31B-it-interleaved": "gemma4", "google-gemma-4-31B-it": "gemma4",
    "ibm-granite-granite-3.3-2B-Instruct": "none", "ibm-granite-granite-4.0": "hermes",
    "ibm-granite-granite-4.1": "hermes", "inclusionai-ling-3.0-flash": "glm",
    "llama-cpp-deepseek-r1": "deepseek", "llama-cpp-rwkv-world": "none",
    "meetkai-functionary-medium-v3.1": "functionary-v3.1",
    "meetkai-functionary-medium-v3.2": "functionary-v3.2",
    "meta-llama-Llama-3.1-8B-Instruct": "llama3", "meta-llama-Llama-3.2-3B-Instruct": "llama3",
    "meta-llama-Llama-3.3-70B-Instruct": "llama3", "microsoft-Phi-3.5-mini-instruct": "none",
    "mistralai-Ministral-3-14B-Reasoning-2512": "mistral",
    "mistralai-Mistral-Nemo-Instruct-2407": "mistral", "moonshotai-Kimi-K2": "kimi-k2",
    "muse-glimmer": "atem", "openai-gpt-oss-120b": "harmony", "openbmb-MiniCPM5-1B": "minicpm",
    "poolside-Laguna-S-2.1": "glm", "poolside-Laguna-XS-2.1": "glm",
    "poolside-Laguna-XS.2": "glm", "tencent-Hy3": "hunyuan", "unsloth-Apriel-1.5":
    "tool-calls-json", "unsloth-mistral-Devstral-Small-2507": "mistral",
    "upstage-Solar-Open-100B": "solar",
}
CALLING = sorted(n for n, s in EXPECTED.items() if s != "none")
# templates that render only a turn's first call, or none of past turns (LFM2 8B-A1B)
FIRST_ONLY = {"GigaChat3-10B-A1.8B", "GigaChat3.1-10B-A1.8B", "openai-gpt-oss-120b",
              "meta-llama-Llama-3.1-8B-Instruct", "meta-llama-Llama-3.2-3B-Instruct",
              "meta-llama-Llama-3.3-70B-Instruct"}


@cache
def template(name: str) -> ChatTemplate:
    return ChatTemplate((TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8"),
                        bos_token="<s>", eos_token="</s>", origin=name)


def test_every_vendored_template_is_listed() -> None:
    assert sorted(EXPECTED) == sorted(f.stem for f in TEMPLATES.glob("*.jinja"))
    assert len(CALLING) == 64


def test_the_config_names_every_syntax() -> None:
    assert sorted(config.TOOL_FORMATS) == sorted(TOOL_FORMATS)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_probe_finds_the_syntax(name: str) -> None:
    assert template(name).syntax.name == EXPECTED[name]


def _reply(name: str) -> tuple[str, list[tuple[str, dict[str, object]]], bool]:
    t = template(name)
    calls = CALLS[:1] if name in FIRST_ONLY else CALLS
    reply = probe_reply(t.render, calls, ("</s>",))
    if not reply:  # a template that lists the tools only: the family's own form
        assert t.call_form is not None
        reply = "".join(t.call_form.write("read_file", a) for _, a in calls)
    head = [{"role": "user", "content": "zquser"}]
    opened = starts_in_reasoning(t.render(head, tools=PROBE_TOOLS), t.syntax)
    return reply, [("read_file", a) for _, a in calls], opened


@pytest.mark.parametrize("name", CALLING)
def test_the_reply_reads_back_as_typed_calls(name: str) -> None:
    reply, want, opened = _reply(name)
    syntax = template(name).syntax
    got = parse_reply(reply, syntax=syntax, starts_in_reasoning=opened, tools=PROBE_TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == want, reply
    markers = [b.open for b in syntax.blocks] + [t for p in syntax.reasoning for t in p]
    assert not [m for m in markers if m and m in got.content], got.content


@pytest.mark.parametrize("name", CALLING)
def test_every_split_streams_as_the_whole(name: str) -> None:
    reply, _, opened = _reply(name)
    syntax = template(name).syntax
    whole = parse_reply(reply, syntax=syntax, starts_in_reasoning=opened, tools=PROBE_TOOLS)
    key = [(c.name, c.arguments) for c in whole.tool_calls]
    for cut in [*range(1, len(reply)), None]:
        pieces = [reply[:cut], reply[cut:]] if cut else list(reply)  # None: char by char
        p = StreamParser(syntax, starts_in_reasoning=opened, tools=PROBE_TOOLS)
        got = Delta()
        for piece in pieces:
            got.extend(p.feed(piece))
        got.extend(p.finish())
        assert (got.reasoning, got.content) == (whole.reasoning, whole.content), cut
        assert [(c.name, c.arguments) for c in got.tool_calls] == key, cut


TOOL = {"type": "function", "function": {"name": "pick", "parameters": {
    "type": "object", "properties": {
        "path": {"type": "string"}, "n": {"type": "integer"},
        "mode": {"enum": ["fast", "slow"]}, "opts": {"type": "object"},
        "tags": {"type": "array", "items": {"type": "string"}}, "flag": {"type": "boolean"}},
    "required": ["path", "n"]}}}


@pytest.mark.parametrize("name", CALLING)
def test_a_forced_call_has_a_grammar_in_the_family_form(name: str) -> None:
    form = template(name).call_form
    assert form is not None
    for choice, parallel in (("required", True), ({"type": "function", "function": {
            "name": "pick"}}, False), ("auto", False)):
        if not form.prefix and not parallel and choice == "auto":
            continue  # no opener to keep out of the text before one call (Functionary v3.2)
        grammar = reply_grammar(json_schema=None, json_path="response_format",
                                tools=[TOOL, PROBE_TOOLS[0]], tool_choice=choice,
                                parallel=parallel, form=form)
        check_grammar(grammar)
        # the call opens as the family writes it
        assert f"tool-call-block ::= ( {literal(form.head('pick'))}" in grammar


@pytest.mark.parametrize(("text", "content"), [
    ("to", "to"), ("assistant", "assistant"),  # words a header may start with: text
    ("<|start|>assistant to=functions.f<|channel|>commentary", ""),  # a header cut short
])
def test_a_harmony_reply_that_ends_before_a_message(text: str, content: str) -> None:
    got = parse_reply(text, syntax=template("openai-gpt-oss-120b").syntax)
    assert (got.content, got.tool_calls) == (content, [])


def test_a_forced_harmony_reply_holds_one_call() -> None:
    # a Harmony call ends at <|call|>, a stop token: a grammar that let more calls follow
    # had a random model write call after call, with no <|start|> between, to the limit
    form = template("openai-gpt-oss-120b").call_form
    assert form is not None and not form.repeats
    grammar = reply_grammar(json_schema=None, json_path="response_format",
                            tools=[TOOL], tool_choice="required", parallel=True, form=form)
    assert "tool-calls ::= tool-call-block\n" in grammar + "\n"


def test_a_harmony_call_ends_where_a_header_begins() -> None:
    # calls written one after the other without <|start|>assistant between are calls each,
    # streamed alike, with no marker left in the arguments
    one = "<|channel|>commentary to=functions.read_file <|constrain|>json<|message|>"
    reply = f'{one}{{"path": "a<|channel|>b", "limit": 5}} \n{one}{{"path": "c"}}'
    syntax = template("openai-gpt-oss-120b").syntax
    want = [("read_file", {"path": "a<|channel|>b", "limit": 5}), ("read_file", {"path": "c"})]
    got = parse_reply(reply, syntax=syntax, tools=PROBE_TOOLS)
    assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == want
    assert got.content == ""
    p = StreamParser(syntax, tools=PROBE_TOOLS)
    streamed = Delta()
    for ch in reply:
        streamed.extend(p.feed(ch))
    streamed.extend(p.finish())
    assert [(c.name, json.loads(c.arguments)) for c in streamed.tool_calls] == want
