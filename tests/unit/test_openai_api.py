"""Request validation: every bad input names its parameter; good inputs parse."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.api.chat import ChatMessage, ToolCall
from proxy.api.fields import ApiError
from proxy.api.openai import parse_chat_request, parse_completion_request
from proxy.api.sampling import MIN_TEMPERATURE, to_params
from proxy.engine.types import SamplingParams

USER = {"role": "user", "content": "hi"}


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [USER], **fields}


def test_minimal_chat_request_gets_defaults() -> None:
    req = parse_chat_request({"messages": [USER]})
    assert req.messages == (ChatMessage(role="user", content="hi"),)
    assert req.sampling == SamplingParams() and req.max_tokens is None
    assert (req.model, req.stream, req.include_usage, req.user) == ("", False, False, None)
    assert (req.tools, req.tool_choice, dict(req.template_kwargs)) == (None, None, {})
    assert not req.parse_tools


def test_full_chat_request_parses() -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    req = parse_chat_request(chat(
        messages=[
            {"role": "developer", "content": "sys"},
            {"role": "user", "content": [{"type": "text", "text": "a"},
                                         {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": None, "reasoning": "hmm",
             "tool_calls": [{"id": "c1", "type": "function",
                             "function": {"name": "f", "arguments": '{"x": 1}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42", "name": "f"},
        ],
        tools=tools, tool_choice="auto", chat_template_kwargs={"enable_thinking": False},
        temperature=0, top_p=0.5, top_k=-1, min_p=0.1, seed=3, max_tokens=10,
        max_completion_tokens=20, stop="END", stream=True,
        stream_options={"include_usage": True}, n=1, user="alice",
        logit_bias={}, presence_penalty=0, metadata={"x": "y"},  # defaults; unknown: ignored
    ))
    sys_msg, user, asst, tool = req.messages
    assert sys_msg.role == "system" and user.content == "a\nb"
    assert asst == ChatMessage(role="assistant", content=None, reasoning_content="hmm",
                               tool_calls=(ToolCall("c1", "f", '{"x": 1}'),))
    assert (tool.tool_call_id, tool.name) == ("c1", "f")
    assert req.tools == tuple(tools) and req.parse_tools
    assert req.template_kwargs == {"enable_thinking": False}
    assert req.sampling == SamplingParams(temperature=0.0, top_p=0.5, top_k=0, min_p=0.1,
                                          seed=3, stop=("END",), presence_penalty=0.0)
    assert req.max_tokens == 20
    assert (req.stream, req.include_usage, req.user) == (True, True, "alice")
    params = to_params(req.sampling, 20)
    assert params.greedy and params.max_tokens == 20 and params.stop == ("END",)


def test_nulls_mean_absent_and_arguments_object_is_accepted() -> None:
    req = parse_chat_request(chat(temperature=None, stop=None, tools=None, n=None,
                                  stream_options=None, max_tokens=None, messages=[
        USER, {"role": "assistant", "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": {"é": 1}}}]}]))
    assert req.sampling == SamplingParams() and req.max_tokens is None
    assert req.messages[1].tool_calls == (ToolCall("c", "f", '{"é": 1}'),)
    assert req.messages[1].content is None


def test_tool_choice_none_turns_off_parsing_only() -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    req = parse_chat_request(chat(tools=tools, tool_choice="none"))
    assert req.tools == tuple(tools) and not req.parse_tools


BAD_CHAT = [
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"model": 3}, "model"),
    ({"messages": [USER, "x"]}, "messages[1]"),
    ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"arguments": "{}"}}]}]},
     "messages[0].tool_calls[0].function"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"type": "code", "function": {"name": "f"}}]}]}, "messages[0].tool_calls[0].type"),
    ({"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": "f", "arguments": 3}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "assistant", "content": "", "reasoning_content": 1}]},
     "messages[0].reasoning_content"),
    ({"messages": [{"role": "tool", "content": "x", "tool_call_id": 1}]},
     "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "name": 1}]}, "messages[0].name"),
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {}}]}, "tools[0]"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tool_choice": "always"}, "tool_choice"),
    ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": "0.5"}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 1.5}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"seed": "7"}, "seed"),
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": "10"}, "max_tokens"),
    ({"max_completion_tokens": -1}, "max_completion_tokens"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"stop": [1]}, "stop"),
    ({"stop": ""}, "stop"),
    ({"stop": {"a": 1}}, "stop"),
    ({"stream": "yes"}, "stream"),
    ({"stream_options": True}, "stream_options"),
    ({"stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"n": 2}, "n"),
    ({"n": 0}, "n"),
    ({"user": 12}, "user"),
]


@pytest.mark.parametrize(("fields", "param"), BAD_CHAT)
def test_bad_chat_input_names_the_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_chat_request(chat(**fields))
    assert e.value.param == param
    assert isinstance(e.value, ValueError) and str(e.value)


def test_image_part_has_a_clear_message() -> None:
    with pytest.raises(ValueError, match="image_url.*text-only"):
        parse_chat_request(chat(messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:"}}]}]))


@pytest.mark.parametrize("body", [[], "x", None, 3])
def test_body_must_be_an_object(body: object) -> None:
    with pytest.raises(ApiError, match="JSON object"):
        parse_chat_request(body)
    with pytest.raises(ApiError, match="JSON object"):
        parse_completion_request(body)


def test_completion_request_parses() -> None:
    req = parse_completion_request({"model": "m", "prompt": ["Once"], "max_tokens": 5,
                                    "temperature": 0.2, "stream": True, "echo": False})
    assert (req.prompt, req.max_tokens, req.sampling.temperature, req.stream) == (
        "Once", 5, 0.2, True)
    assert parse_completion_request({"prompt": ""}).prompt == ""


@pytest.mark.parametrize(("fields", "param"), [
    ({}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": [[1, 2]]}, "prompt"),
    ({"prompt": "a", "top_p": -1}, "top_p"),
    ({"prompt": "a", "n": 3}, "n"),
    ({"prompt": "a", "stop": 5}, "stop"),
])
def test_bad_completion_input_names_the_param(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as e:
        parse_completion_request(fields)
    assert e.value.param == param


def test_seed_minus_one_means_random_and_out_of_range_seeds_are_refused() -> None:
    assert parse_chat_request(chat(seed=-1)).sampling.seed is None
    assert parse_chat_request(chat(seed=0)).sampling.seed == 0
    assert parse_chat_request(chat(seed=2**64 - 1)).sampling.seed == 2**64 - 1
    for bad in (-2, 2**64):
        with pytest.raises(ApiError) as e:
            parse_chat_request(chat(seed=bad))
        assert e.value.param == "seed"


def test_a_vanishing_temperature_is_greedy() -> None:
    # 1e-320 is a subnormal float: logits / 1e-320 overflow to inf and sampling yields NaN.
    for t in (1e-320, 5e-324, MIN_TEMPERATURE / 2):
        req = parse_chat_request(chat(temperature=t))
        assert req.sampling.temperature == 0.0
        assert to_params(req.sampling, 4).greedy
    assert parse_chat_request(chat(temperature=0.5)).sampling.temperature == 0.5
    # another API's parser may build its SamplingParams itself: to_params still makes it greedy
    assert to_params(SamplingParams(temperature=1e-320), 4).greedy


# llama-server fields that would not act here (the OpenAI ones all act now:
# tests/unit/test_sampling.py)
REFUSED_CHAT = [
    ({"mirostat": 2}, "mirostat"),
    ({"ignore_eos": True}, "ignore_eos"),
    ({"n_probs": 3}, "n_probs"),
    ({"top_n_sigma": 1.5}, "top_n_sigma"),
    ({"dynatemp_range": 0.5}, "dynatemp_range"),
    ({"samplers": ["top_k"]}, "samplers"),
]


@pytest.mark.parametrize(("fields", "param"), REFUSED_CHAT)
def test_fields_the_sampler_cannot_honour_are_refused_by_name(
        fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError, match="not supported") as e:
        parse_chat_request(chat(**fields))
    assert e.value.param == param


@pytest.mark.parametrize(("fields", "param"), [
    ({"echo": True}, "echo"),
    ({"best_of": 3}, "best_of"),
    ({"suffix": "end"}, "suffix"),
    ({"mirostat": 1}, "mirostat"),
])
def test_completion_fields_not_supported_are_refused_by_name(
        fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError, match="not supported") as e:
        parse_completion_request({"prompt": "a", **fields})
    assert e.value.param == param


def test_refused_fields_at_their_defaults_are_accepted() -> None:
    parse_chat_request(chat(logit_bias={}, presence_penalty=0, frequency_penalty=0.0,
                            repetition_penalty=1, response_format={"type": "text"},
                            tool_choice="auto", parallel_tool_calls=True, logit_bias_x=1))
    parse_chat_request(chat(parallel_tool_calls=False))  # no tools: nothing to limit
    parse_completion_request({"prompt": "a", "echo": False, "best_of": 1, "suffix": None})
