"""Sampling fields: which default applies, how each request field reaches the engine,
and the grammars and 400s of structured output and forced tool calls (no model)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from proxy.api.anthropic import parse_messages_request
from proxy.api.fields import ApiError
from proxy.api.openai import parse_chat_request, parse_completion_request
from proxy.api.responses import parse_responses_request
from proxy.api.sampling import to_params
from proxy.engine.binding import check_grammar
from proxy.engine.sampling import defaults, model_defaults, resolve
from proxy.engine.types import SamplingParams
from statecache.config import SamplingConfig, load_config

USER = {"role": "user", "content": "hi"}
TOOL: dict[str, Any] = {"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}
GGUF = {"general.sampling.temp": "0.6", "general.sampling.top_k": "20",
        "general.sampling.top_p": "0.950000", "general.sampling.penalty_repeat": "1.1"}


def chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [USER], **fields}


# -- defaults: config < the GGUF's general.sampling.* < the request ----------------------

def test_config_then_model_then_request() -> None:
    cfg = SamplingConfig(temperature=0.9, top_k=50, min_p=0.1)
    spec = resolve(SamplingParams(), defaults(cfg, {}))
    assert (spec.temperature, spec.top_k, spec.min_p, spec.top_p) == (0.9, 50, 0.1, 0.95)
    spec = resolve(SamplingParams(), defaults(cfg, GGUF))
    assert (spec.temperature, spec.top_k, spec.top_p, spec.repeat_penalty, spec.min_p) == \
        (0.6, 20, 0.95, 1.1, 0.1)  # min_p: the GGUF says nothing, the config's stays
    spec = resolve(SamplingParams(temperature=0.2, top_k=0), defaults(cfg, GGUF))
    assert (spec.temperature, spec.top_k, spec.repeat_penalty) == (0.2, 0, 1.1)
    off = SamplingConfig(temperature=0.9, model_defaults=False)
    assert resolve(SamplingParams(), defaults(off, GGUF)).temperature == 0.9


def test_unreadable_model_values_are_skipped() -> None:
    assert model_defaults({"general.sampling.temp": "warm", "general.sampling.top_k": "nan",
                           "general.sampling.min_p": "0.02"}) == {"min_p": 0.02}
    assert model_defaults({"general.sampling.penalty_last_n": "128.0"}) == \
        {"repeat_last_n": 128}


def test_the_sampling_section_of_the_config(tmp_path: Any) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[sampling]\ntemperature = 0.3\ntop_k = 8\nmodel_defaults = false\n")
    cfg = load_config(f)
    assert (cfg.sampling.temperature, cfg.sampling.top_k, cfg.sampling.model_defaults) == \
        (0.3, 8, False)
    f.write_text("[sampling]\ntop_p = 1.5\n")
    with pytest.raises(ValueError, match="sampling.top_p"):
        load_config(f)


def test_when_no_chain_is_needed() -> None:
    base = defaults(SamplingConfig(), {})
    assert resolve(SamplingParams(temperature=0.0), base).exact_argmax
    assert resolve(SamplingParams(top_k=1), base).exact_argmax
    assert not resolve(SamplingParams(), base).exact_argmax  # 0.8 by default
    for extra in ({"logit_bias": ((1, 2.0),)}, {"presence_penalty": 0.5},
                  {"repeat_penalty": 1.2}, {"dry_multiplier": 0.8}, {"grammar": 'root ::= "a"'}):
        assert not resolve(SamplingParams(temperature=0.0, **extra), base).exact_argmax, extra
    # a penalty window of 0 turns the penalties off
    assert resolve(SamplingParams(temperature=0.0, presence_penalty=0.5, repeat_last_n=0),
                   base).exact_argmax


# -- every accepted field reaches the engine ---------------------------------------------

@pytest.mark.parametrize(("field", "value", "attr", "expected"), [
    ("temperature", 0.5, "temperature", 0.5),
    ("top_p", 0.9, "top_p", 0.9),
    ("top_k", 12, "top_k", 12),
    ("top_k", -1, "top_k", 0),
    ("min_p", 0.1, "min_p", 0.1),
    ("typical_p", 0.7, "typical_p", 0.7),
    ("repeat_penalty", 1.2, "repeat_penalty", 1.2),
    ("repetition_penalty", 1.3, "repeat_penalty", 1.3),
    ("repeat_last_n", -1, "repeat_last_n", -1),
    ("presence_penalty", -0.5, "presence_penalty", -0.5),
    ("frequency_penalty", 1.5, "frequency_penalty", 1.5),
    ("dry_multiplier", 0.8, "dry_multiplier", 0.8),
    ("dry_base", 2.0, "dry_base", 2.0),
    ("dry_allowed_length", 3, "dry_allowed_length", 3),
    ("dry_penalty_last_n", 256, "dry_penalty_last_n", 256),
    ("dry_sequence_breakers", ["\n", "###"], "dry_sequence_breakers", ("\n", "###")),
    ("xtc_probability", 0.5, "xtc_probability", 0.5),
    ("xtc_threshold", 0.2, "xtc_threshold", 0.2),
    ("seed", 42, "seed", 42),
    ("stop", ["END"], "stop", ("END",)),
    ("logit_bias", {"7": 5, "9": -100}, "logit_bias", ((7, 5.0), (9, -100.0))),
    ("grammar", 'root ::= "yes" | "no"', "grammar", 'root ::= "yes" | "no"'),
])
def test_each_field_reaches_the_engine(field: str, value: object, attr: str,
                                       expected: object) -> None:
    for parse in (lambda b: parse_chat_request(chat(**b)),
                  lambda b: parse_completion_request({"prompt": "a", **b})):
        params = to_params(parse({field: value}).sampling, 16)
        assert getattr(params, attr) == expected, field
        assert getattr(SamplingParams(), attr) != expected  # not the default by chance


def test_logit_bias_false_bans_the_token() -> None:
    params = to_params(parse_chat_request(chat(logit_bias={"3": False})).sampling, 4)
    assert params.logit_bias[0][0] == 3 and math.isinf(params.logit_bias[0][1])


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"logit_bias": {"a": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"-1": 1}}, "logit_bias", "token ids"),
    ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": {"5": "x"}}, "logit_bias", "[-100, 100]"),
    ({"logit_bias": [[5, 1]]}, "logit_bias", "object"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "at most"),
    ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
    ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
    ({"repeat_penalty": 0}, "repeat_penalty", "(0, 100]"),
    ({"typical_p": 0}, "typical_p", "(0, 1]"),
    ({"xtc_probability": 2}, "xtc_probability", "[0, 1]"),
    ({"dry_base": 0.5}, "dry_base", "[1, 100]"),
    ({"dry_sequence_breakers": [""]}, "dry_sequence_breakers", "non-empty"),
    ({"repeat_last_n": -2}, "repeat_last_n", ">= -1"),
    ({"grammar": "root ::= undefined-rule"}, "grammar", "cannot parse"),
    ({"grammar": "start ::= \"a\""}, "grammar", "'root'"),
    ({"grammar": "root ::= " + "(" * 2000 + '"a"' + ")" * 2000}, "grammar", "nests"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "json_schema", "either"),
    ({"json_schema": {"type": "integer", "minimum": 0}}, "json_schema", "'minimum'"),
    ({"mirostat": 2}, "mirostat", "not supported"),
])
def test_bad_sampling_fields_are_400s_naming_them(fields: dict[str, Any], param: str,
                                                 words: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_chat_request(chat(**fields))
    assert e.value.param == param and words in str(e.value), str(e.value)


# -- structured output and forced tool calls ---------------------------------------------

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
    {"json_schema": SCHEMA},
    {"tools": [TOOL], "tool_choice": "required"},
    {"tools": [TOOL], "tool_choice": "required", "parallel_tool_calls": False},
    {"tools": [TOOL, {"type": "function", "function": {"name": "g"}}],
     "tool_choice": {"type": "function", "function": {"name": "g"}}},
    {"tools": [TOOL], "parallel_tool_calls": False},
    {"tools": [TOOL], "response_format": {"type": "json_object"}},
])
def test_constraints_make_grammars_llama_cpp_parses(fields: dict[str, Any]) -> None:
    params = to_params(parse_chat_request(chat(**fields)).sampling, 8)
    assert params.grammar and params.reasoning == ("<think>", "</think>")
    check_grammar(params.grammar)


def test_no_constraint_no_grammar() -> None:
    for fields in ({}, {"tools": [TOOL]}, {"tools": [TOOL], "tool_choice": "none",
                                            "parallel_tool_calls": False},
                   {"response_format": {"type": "text"}}):
        assert parse_chat_request(chat(**fields)).sampling.grammar == "", fields
    # a user's GBNF covers the whole reply: reasoning is not set apart
    assert parse_chat_request(chat(grammar='root ::= "a"')).sampling.reasoning is None


def test_forced_tool_grammar_offers_only_the_named_tool() -> None:
    g = parse_chat_request(chat(tools=[TOOL, {"type": "function", "function": {"name": "g"}}],
                                tool_choice={"type": "function", "function": {"name": "g"}})
                           ).sampling.grammar
    assert '"\\"g\\""' in g and '"\\"f\\""' not in g


@pytest.mark.parametrize(("schema", "where", "words"), [
    ({"type": "integer", "minimum": 1}, "schema'", "'minimum'"),
    ({"type": "array", "items": {"type": "string"}, "uniqueItems": True}, "schema'",
     "'uniqueItems'"),
    ({"type": "object", "properties": {"a": {"not": {"type": "null"}}}}, "schema.properties.a'",
     "'not'"),
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["b"]},
     "schema.required'", "'b' is required"),
    ({"type": "string", "pattern": "[a-z]+"}, "schema.pattern'", "anchored"),
    ({"type": "string", "pattern": "^a$", "maxLength": 3}, "schema'", "together"),
    ({"type": "array", "items": {}, "prefixItems": [{}]}, "schema'", "prefixItems"),
    ({"type": "array", "items": {"type": "string", "maxLength": 100000}},
     "schema.items.maxLength'", "above"),
    ({"type": ["string", "null"], "maxLength": 3}, "schema'", "anyOf"),
    ({"type": "strin"}, "schema.type'", "unknown type"),
    ({"$ref": "https://example.com/s.json"}, "schema'", "local references"),
    ({"$ref": "#/$defs/missing"}, "schema'", "points to nothing"),
    ({"type": "object", "properties": {"a": True}}, "schema.properties.a'", "true/false"),
    ({"anyOf": [{"type": "string"}], "properties": {}}, "schema'", "'anyOf'"),
    ({"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(12_000)}},
     "schema'", "more than 20,000 JSON values"),
])
def test_schemas_the_grammar_cannot_enforce_name_the_part(schema: dict[str, Any], where: str,
                                                          words: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_chat_request(chat(response_format={"type": "json_schema", "json_schema": {
            "name": "x", "schema": schema}}))
    assert e.value.param == "response_format"
    assert f"'response_format.json_schema.{where}" in str(e.value) and words in str(e.value), \
        str(e.value)


def test_a_tool_schema_error_names_the_tool() -> None:
    bad = {"type": "function", "function": {"name": "h", "parameters": {
        "type": "object", "properties": {"n": {"type": "number", "maximum": 3}}}}}
    with pytest.raises(ApiError) as e:
        parse_chat_request(chat(tools=[TOOL, bad], tool_choice="required"))
    assert e.value.param == "tools"
    assert "'tools[1].function.parameters.properties.n'" in str(e.value)


@pytest.mark.parametrize(("fields", "param", "words"), [
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "no tool named 'nope'"),
    ({"tools": [TOOL], "tool_choice": {"type": "function"}}, "tool_choice", "must be"),
    ({"tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "forced tool call"),
    ({"tools": [TOOL], "tool_choice": "required", "grammar": 'root ::= "a"'}, "grammar",
     "cannot be combined"),
    ({"response_format": {"type": "xml"}}, "response_format", "must be"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema"),
])
def test_conflicting_or_incomplete_constraints_are_400s(fields: dict[str, Any], param: str,
                                                        words: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_chat_request(chat(**fields))
    assert e.value.param == param and words in str(e.value), str(e.value)


def test_anthropic_forced_tools_and_output_format() -> None:
    tools = [{"name": "f", "input_schema": {"type": "object", "properties": {
        "x": {"type": "integer"}}, "required": ["x"]}}]
    base = {"max_tokens": 8, "messages": [USER], "tools": tools}
    for choice in ({"type": "any"}, {"type": "tool", "name": "f"}):
        params = to_params(parse_messages_request({**base, "tool_choice": choice}).sampling, 8)
        assert params.grammar and params.reasoning is not None
        check_grammar(params.grammar)
        assert "tool-call-block (" in params.grammar  # parallel calls by default
    one = parse_messages_request({**base, "tool_choice": {
        "type": "any", "disable_parallel_tool_use": True}}).sampling.grammar
    assert "tool-calls ::= tool-call-block\n" in one + "\n"
    fmt = parse_messages_request({"max_tokens": 8, "messages": [USER], "output_config": {
        "format": {"type": "json_schema", "schema": SCHEMA}}}).sampling.grammar
    check_grammar(fmt)
    with pytest.raises(ApiError) as e:
        parse_messages_request({**base, "tool_choice": {"type": "tool", "name": "g"}})
    assert e.value.param == "tool_choice"
    with pytest.raises(ApiError) as e:
        parse_messages_request({"max_tokens": 8, "messages": [USER], "output_config": {
            "format": {"type": "json_schema", "schema": {"type": "integer", "maximum": 2}}}})
    assert e.value.param == "output_config" and "output_config.format.schema" in str(e.value)


def test_responses_text_format_and_forced_tools() -> None:
    fmt = parse_responses_request({"input": "x", "text": {"format": {
        "type": "json_schema", "name": "x", "schema": SCHEMA, "strict": True}}})
    check_grammar(fmt.sampling.grammar)
    assert parse_responses_request({"input": "x", "text": {"format": {"type": "text"}}}
                                   ).sampling.grammar == ""
    tools = [{"type": "function", "name": "f", "parameters": TOOL["function"]["parameters"]}]
    forced = parse_responses_request({"input": "x", "tools": tools, "tool_choice": "required",
                                      "parallel_tool_calls": False})
    check_grammar(forced.sampling.grammar)
    with pytest.raises(ApiError) as e:
        parse_responses_request({"input": "x", "text": {"format": {
            "type": "json_schema", "name": "x", "schema": {"type": "string", "format": "email",
                                                          "maxLength": 4}}}})
    assert e.value.param == "text" and "'text.format.schema'" in str(e.value)
