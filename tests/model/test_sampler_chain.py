"""The llama.cpp sampler chain on real GGUFs: greedy, seeds, logit bias, penalties, and
grammars that accept exactly what the chat templates write and reply.py parses."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy.api.openai import parse_chat_request
from proxy.api.render import VENDOR_TEMPLATES, ChatTemplate
from proxy.api.reply import parse_reply
from proxy.api.sampling import to_params
from proxy.engine.binding import Context, ContextParams, Model, SamplerChain
from proxy.engine.sampling import (
    ChainSpec,
    Sampler,
    check_logit_bias,
    defaults,
    make_sampler,
    resolve,
)
from proxy.engine.types import SamplingParams
from statecache.config import SamplingConfig
from tests.busy import THREADS

pytestmark = pytest.mark.model

PROMPT = "<|im_start|>user\nTell me a story.<|im_end|>\n<|im_start|>assistant\n"
WEATHER = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"enum": ["c", "f"]},
        "days": {"type": "array", "items": {"type": "integer"}, "maxItems": 3}},
        "required": ["city", "unit"]}}}
CALL = {"id": "c1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'}}


@pytest.fixture(scope="module")
def hybrid(hybrid_path: Path) -> Iterator[Model]:
    with Model(hybrid_path) as m:
        yield m


def spec_of(model: Model, **fields: object) -> ChainSpec:
    return resolve(SamplingParams(**fields), defaults(SamplingConfig(), model.metadata))  # type: ignore[arg-type]


def generate(model: Model, spec: ChainSpec, n: int, prompt: str = PROMPT) -> list[int]:
    """``n`` tokens sampled by ``spec``'s sampler after ``prompt`` (or fewer: EOG)."""
    toks = model.tokenize(prompt)
    with Context(model, ContextParams(n_ctx=1024, n_batch=256, n_ubatch=256,
                                      threads=THREADS)) as ctx:
        sampler = Sampler(model, spec, np.asarray(toks, dtype=np.int32))
        ctx.prefill(0, toks, 0)
        out: list[int] = []
        try:
            for _ in range(n):
                tok = sampler.sample(ctx, ctx.batch.n - 1)
                if model.is_eog(tok):
                    break
                out.append(tok)
                ctx.prefill(0, [tok], len(toks) + len(out) - 1)
        finally:
            sampler.close()
    return out


def test_greedy_without_a_chain_is_the_argmax_and_the_chain_agrees(hybrid: Model) -> None:
    plain = spec_of(hybrid, temperature=0.0)
    assert plain.exact_argmax and Sampler(hybrid, plain, np.zeros(1, np.int32)).chain is None
    # a zero bias keeps the logits as they are but needs the chain: same tokens
    chained = spec_of(hybrid, temperature=0.0, logit_bias=((5, 0.0),))
    assert not chained.exact_argmax
    assert generate(hybrid, chained, 24) == generate(hybrid, plain, 24)
    assert generate(hybrid, spec_of(hybrid, temperature=1.0, top_k=1), 24) == \
        generate(hybrid, plain, 24)


def test_the_same_seed_gives_the_same_tokens(hybrid: Model) -> None:
    a = generate(hybrid, spec_of(hybrid, temperature=1.0, seed=7), 40)
    assert a == generate(hybrid, spec_of(hybrid, temperature=1.0, seed=7), 40)
    assert a != generate(hybrid, spec_of(hybrid, temperature=1.0, seed=8), 40)
    unseeded = [generate(hybrid, spec_of(hybrid, temperature=1.0), 40) for _ in range(2)]
    assert unseeded[0] != unseeded[1]


def test_logit_bias_forces_and_bans(hybrid: Model) -> None:
    tok = hybrid.tokenize("x")[0]
    forced = generate(hybrid, spec_of(hybrid, temperature=1.0, seed=1,
                                      logit_bias=((tok, 100.0),)), 20)
    assert forced == [tok] * 20
    greedy = generate(hybrid, spec_of(hybrid, temperature=0.0), 30)
    top = max(set(greedy), key=greedy.count)
    banned = generate(hybrid, spec_of(hybrid, temperature=0.0, logit_bias=((top, -100.0),)), 30)
    assert top not in banned and len(banned) == 30
    assert top not in generate(hybrid, spec_of(hybrid, temperature=1.0, seed=3,
                                                logit_bias=((top, float("-inf")),)), 30)


def test_penalties_lower_repetition(hybrid: Model) -> None:
    def repeats(tokens: list[int]) -> int:
        return len(tokens) - len(set(tokens))

    # a bias towards five tokens makes the random model repeat them
    favoured = tuple((hybrid.tokenize(c)[0], 8.0) for c in "abcde")
    def run(seed: int, **penalty: float) -> int:
        return repeats(generate(hybrid, spec_of(
            hybrid, temperature=1.0, seed=seed, logit_bias=favoured, repeat_last_n=-1,
            **penalty), 100))

    for seed in (1, 2):
        plain = run(seed)
        assert plain > 50
        assert run(seed, presence_penalty=2.0) < 0.7 * plain
        assert run(seed, frequency_penalty=2.0) < 0.3 * plain
        assert run(seed, frequency_penalty=-1.0) > plain  # a negative one encourages repeats


def test_a_logit_bias_token_outside_the_vocabulary_is_refused(hybrid: Model) -> None:
    with pytest.raises(ValueError, match="logit_bias"):
        check_logit_bias(SamplingParams(logit_bias=((hybrid.n_vocab, 1.0),)), hybrid.n_vocab)
    with pytest.raises(ValueError, match="logit_bias"):
        make_sampler(hybrid, SamplingParams(logit_bias=((hybrid.n_vocab + 5, 1.0),)),
                     SamplingConfig(), np.zeros(1, np.int32))


# -- grammars ---------------------------------------------------------------------------

def walk(model: Model, chain: SamplerChain, text: str) -> bool:
    """Whether the grammar takes ``text`` (tokenized as the model would write it) and may
    end right after it."""
    for tok in model.tokenize(text):
        if not chain.allows(tok):
            return False
        chain.accept_grammar(tok)
    return chain.allows(model.eos)


def grammar_chain(model: Model, params: SamplingParams, prompt_tail: str = "") -> SamplerChain:
    spec = resolve(params, defaults(SamplingConfig(), {}), prompt_tail=prompt_tail)
    chain = SamplerChain(model, spec.grammar, spec.grammar_root)
    chain.greedy()
    return chain


def forced(**fields: object) -> SamplingParams:
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}],
                              "tools": [WEATHER], **fields})
    return to_params(req.sampling, 64)


@pytest.mark.parametrize("template", ["chatml-tools-think.jinja", "gemma3.jinja"])
def test_the_forced_call_grammar_takes_what_the_template_writes(hybrid: Model,
                                                                template: str) -> None:
    tpl = ChatTemplate((VENDOR_TEMPLATES / template).read_text(), bos_token="<bos>",
                       origin=template)
    msgs: list[dict[str, Any]] = [{"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "", "tool_calls": [CALL]}]
    before = tpl.render(msgs[:1], tools=[WEATHER], template_kwargs={"enable_thinking": False})
    after = tpl.render(msgs, tools=[WEATHER], add_generation_prompt=False,
                       template_kwargs={"enable_thinking": False})
    end = "<|im_end|>" if "chatml" in template else "<end_of_turn>"
    # the reply as the template writes it: after the generation prompt, before end of turn
    written = after[len(before) - len(after):] if after.startswith(before) else \
        after[after.rindex("<tool_call>"):]
    written = written[:written.rindex(end)]
    assert written.startswith("<tool_call>"), written
    assert walk(hybrid, grammar_chain(hybrid, forced(tool_choice="required")), written)
    reply = parse_reply(written)
    assert [(c.name, c.arguments) for c in reply.tool_calls] == \
        [("get_weather", '{"city": "Paris", "unit": "c"}')]
    # two calls, one line apart, when parallel calls are allowed, and only then
    two = written + "\n" + written
    assert walk(hybrid, grammar_chain(hybrid, forced(tool_choice="required")), two)
    assert not walk(hybrid, grammar_chain(
        hybrid, forced(tool_choice="required", parallel_tool_calls=False)), two)


@pytest.mark.parametrize(("text", "ok"), [
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f", '
     '"days": [1, 2]}}\n</tool_call>', True),
    ('<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo","unit":"f"}}\n</tool_call>',
     True),
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     False),  # a required argument is missing
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "k"}}\n'
     '</tool_call>', False),  # not in the enum
    ('<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>', False),
    ('Sure: <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f"}}'
     '\n</tool_call>', False),  # a forced call leaves no room for text
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "f", '
     '"days": [1, 2, 3, 4]}}\n</tool_call>', False),  # maxItems
])
def test_the_forced_call_grammar_checks_the_arguments(hybrid: Model, text: str,
                                                      ok: bool) -> None:
    assert walk(hybrid, grammar_chain(hybrid, forced(tool_choice="required")), text) is ok


def test_reasoning_comes_first_when_the_prompt_opened_it(hybrid: Model) -> None:
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}' \
           '\n</tool_call>'
    thought = "The user wants <b>weather</b>; a < b.\n</think>\n\n"
    params = forced(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    opened = "<|im_start|>assistant\n<think>\n"
    assert walk(hybrid, grammar_chain(hybrid, params, opened), thought + call)
    assert walk(hybrid, grammar_chain(hybrid, params, opened), "</think>" + call)
    assert not walk(hybrid, grammar_chain(hybrid, params, opened), call)  # reasoning first
    # no open block: the call comes at once, and reasoning text is not allowed
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert walk(hybrid, grammar_chain(hybrid, params, closed), call)
    assert not walk(hybrid, grammar_chain(hybrid, params, closed), thought + call)
    reply = parse_reply(thought + call, starts_in_reasoning=True)
    assert reply.reasoning.startswith("The user wants") and len(reply.tool_calls) == 1


def test_one_call_at_most_when_parallel_calls_are_off(hybrid: Model) -> None:
    params = forced(tool_choice="auto", parallel_tool_calls=False)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "unit": "c"}}' \
           '\n</tool_call>'
    assert walk(hybrid, grammar_chain(hybrid, params), "No call needed, a <b> is fine.")
    assert walk(hybrid, grammar_chain(hybrid, params), "Let me look.\n" + call)
    assert not walk(hybrid, grammar_chain(hybrid, params), call + "\n" + call)
    assert not walk(hybrid, grammar_chain(hybrid, params), call + " and more text")


SMALL = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
    "required": ["name", "n", "tags"]}


@pytest.mark.parametrize("fields", [
    {"temperature": 0.0},  # greedy: the likeliest allowed token
    {},  # the defaults: top-k, top-p, min-p keep a few candidates
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0},  # the whole vocabulary
    {"xtc_probability": 1.0, "xtc_threshold": 0.01},  # XTC moves the candidates' start
    {"presence_penalty": 1.0, "dry_multiplier": 0.8, "typical_p": 0.9},
], ids=["greedy", "defaults", "full", "xtc", "penalties"])
def test_every_chain_keeps_to_the_grammar(hybrid: Model, fields: dict[str, Any]) -> None:
    import json

    import jsonschema

    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"schema": SMALL}}})
    for seed in (1, 2):
        params = dataclasses.replace(to_params(req.sampling, 400), seed=seed, **fields)
        toks = generate(hybrid, resolve(params, defaults(SamplingConfig(), {})), 400)
        jsonschema.validate(json.loads(hybrid.detokenize(toks)), SMALL)


@pytest.mark.parametrize("fields", [{"temperature": 0.0}, {"temperature": 1.5},
                                    {"top_k": 0, "temperature": 1.5}],
                         ids=["greedy", "top-k", "min-p"])
def test_checking_the_likeliest_candidates_first_changes_nothing(
        hybrid: Model, fields: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """When the grammar rejects the chain's token, it runs over the likeliest candidates
    first (CHUNKS) and over the whole vocabulary only when those do not settle it: the
    tokens are those of the whole-vocabulary pass (llama-server's), draw for draw. The
    chunks are shrunk to fit this model's small vocabulary."""
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"schema": SMALL}}})
    settled = 0
    new = SamplerChain.__init__

    def counting(self: SamplerChain, *args: Any) -> None:
        new(self, *args)
        chains.append(self)

    monkeypatch.setattr(SamplerChain, "__init__", counting)
    for seed in (4, 5, 6):
        runs = []
        for chunks in ((16, 128), ()):
            chains: list[SamplerChain] = []
            monkeypatch.setattr(SamplerChain, "CHUNKS", chunks)
            spec = resolve(dataclasses.replace(to_params(req.sampling, 200), seed=seed, **fields),
                           defaults(SamplingConfig(), {}))
            runs.append(generate(hybrid, spec, 200))
            settled += sum(c.settled_early for c in chains)
        assert runs[0] == runs[1] and len(runs[0]) > 10
    assert settled > 5  # the shortcut was taken


def test_json_grammar_on_gemmas_vocabulary(gemma_path: Path) -> None:
    """A schema's grammar over Gemma 3's 262K vocabulary: sampled at temperature 1 from
    a base model, every reply is JSON that validates."""
    import json

    import jsonschema

    schema = {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}},
        "required": ["name", "age", "tags"]}
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"schema": schema}}})
    with Model(gemma_path) as gemma:
        for seed in (1, 2):
            # Gemma 3's template writes no reasoning: the server's grammar lets none precede
            # the JSON (ChatTemplate.grammar_reasoning), where a request alone asks for
            # Qwen's <think>, which a base model writes as text and never leaves
            params = dataclasses.replace(to_params(req.sampling, 80), seed=seed,
                                         temperature=1.0, reasoning=None)
            spec = resolve(params, defaults(SamplingConfig(), {}))
            toks = generate(gemma, spec, 80, "<start_of_turn>user\nA person as JSON."
                            "<end_of_turn>\n<start_of_turn>model\n")
            jsonschema.validate(json.loads(gemma.detokenize(toks)), schema)

