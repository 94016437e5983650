"""Anthropic Messages: requests parse into the shared chat request (and render exactly as
the same conversation sent to chat completions does); events come in the SDK's order."""

from __future__ import annotations

import json
from typing import Any

import pytest

from proxy.api.anthropic import parse_messages_request
from proxy.api.anthropic_events import MessageEvents, error_body, message_body
from proxy.api.chat import ChatMessage, Thinking, ToolCall
from proxy.api.fields import ApiError
from proxy.api.generation import fit_max_tokens
from proxy.api.openai import parse_chat_request
from proxy.api.openai_events import ChatChunks
from proxy.api.render import VENDOR_TEMPLATES, ChatTemplate, render_chat
from proxy.api.reply import StreamParser, parse_reply
from proxy.engine.types import FinishEvent, Usage

USER = {"role": "user", "content": "hi"}
SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}

# One agent exchange in Anthropic's form ...
ANTHROPIC: dict[str, Any] = {
    "model": "claude-x", "max_tokens": 64,
    "system": [{"type": "text", "text": "You are an agent.",
                "cache_control": {"type": "ephemeral"}}],
    "tools": [{"name": "read_file", "description": "Read a file.", "input_schema": SCHEMA,
               "cache_control": {"type": "ephemeral"}}],
    "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Why do tests fail?"}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "Read the test.", "signature": "sig"},
            {"type": "text", "text": "Reading."},
            {"type": "tool_use", "id": "toolu_1", "name": "read_file",
             "input": {"path": "t.py"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1",
             "content": [{"type": "text", "text": "assert 1 == 2"}],
             "cache_control": {"type": "ephemeral"}},
            {"type": "text", "text": "Go on."}]},
    ],
}
# ... and the same exchange as a chat-completions client sends it.
CHAT: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Why do tests fail?"},
        {"role": "assistant", "content": "Reading.", "reasoning_content": "Read the test.",
         "tool_calls": [{"id": "x", "type": "function", "function": {
             "name": "read_file", "arguments": "{\"path\": \"t.py\"}"}}]},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "assert 1 == 2"},
        {"role": "user", "content": "Go on."},
    ],
    "tools": [{"type": "function", "function": {
        "name": "read_file", "description": "Read a file.", "parameters": SCHEMA}}],
}


def test_agent_exchange_parses_into_chat_messages() -> None:
    req = parse_messages_request(ANTHROPIC)
    assert req.messages == (
        ChatMessage(role="system", content="You are an agent."),
        ChatMessage(role="user", content="Why do tests fail?"),
        ChatMessage(role="assistant", content="Reading.", reasoning_content="Read the test.",
                    tool_calls=(ToolCall("toolu_1", "read_file", '{"path": "t.py"}'),)),
        ChatMessage(role="tool", content="assert 1 == 2", tool_call_id="toolu_1"),
        ChatMessage(role="user", content="Go on."),
    )
    assert req.tools == tuple(CHAT["tools"])
    assert req.max_tokens == 64 and req.parse_tools and not req.stream


def test_same_conversation_renders_the_same_prompt_as_chat() -> None:
    tpl = ChatTemplate((VENDOR_TEMPLATES / "chatml-tools-think.jinja").read_text(),
                       origin="test")
    assert render_chat(tpl, parse_messages_request(ANTHROPIC)) == \
        render_chat(tpl, parse_chat_request(CHAT))


def test_tool_results_keep_their_order_and_errors_are_marked() -> None:
    req = parse_messages_request({"max_tokens": 8, "messages": [
        {"role": "user", "content": [
            {"type": "text", "text": "a"},
            {"type": "tool_result", "tool_use_id": "t1", "content": "boom", "is_error": True},
            {"type": "tool_result", "tool_use_id": "t2"},
            {"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}]})
    assert [(m.role, m.content, m.tool_call_id) for m in req.messages] == [
        ("user", "a", None), ("tool", "Error: boom", "t1"), ("tool", "", "t2"),
        ("user", "b\nc", None)]


def test_system_messages_inside_the_conversation_stay_in_place() -> None:
    # Claude Code sends them (beta mid-conversation-system).
    req = parse_messages_request({"max_tokens": 8, "system": "first", "messages": [
        USER, {"role": "system", "content": [{"type": "text", "text": "agents: a, b"}]},
        {"role": "user", "content": "go"}]})
    assert [(m.role, m.content) for m in req.messages] == [
        ("system", "first"), ("user", "hi"), ("system", "agents: a, b"), ("user", "go")]


def test_max_tokens_is_cut_to_the_room_the_context_leaves() -> None:
    asked = parse_messages_request({"max_tokens": 64000, "messages": [USER]}).max_tokens
    assert fit_max_tokens(asked, n_ctx=4096, n_prompt=96) == 4000
    assert fit_max_tokens(asked, n_ctx=100_000, n_prompt=96) == asked
    assert fit_max_tokens(asked, n_ctx=96, n_prompt=96) == asked  # no room: refused later
    cut = FinishEvent(reason="length", usage=Usage(prompt_tokens=96, completion_tokens=4000))
    body = message_body("m", "m", parse_reply("x"), cut, window=True)
    assert body["stop_reason"] == "model_context_window_exceeded"


def test_sampling_tool_choice_and_thinking() -> None:
    req = parse_messages_request({
        "max_tokens": 10, "messages": [USER], "temperature": 0, "top_p": 0.5, "top_k": 3,
        "stop_sequences": ["END"], "stream": True, "metadata": {"user_id": "u"},
        "tool_choice": {"type": "any"}, "thinking": {"type": "disabled"},
        "tools": ANTHROPIC["tools"]})
    s = req.sampling
    assert (s.temperature, s.top_p, s.top_k, s.stop, req.max_tokens) == (0.0, 0.5, 3, ("END",),
                                                                          10)
    assert req.stream and req.tool_choice == "required" and req.user is None
    # off, set as the variables the model's template reads when it renders
    assert req.thinking == Thinking(on=False) and dict(req.template_kwargs) == {}
    tool = parse_messages_request({"max_tokens": 1, "messages": [USER],
                                   "tool_choice": {"type": "tool", "name": "read_file"},
                                   "tools": ANTHROPIC["tools"]})
    assert tool.tool_choice == {"type": "function", "function": {"name": "read_file"}}
    none = parse_messages_request({"max_tokens": 1, "messages": [USER],
                                   "tool_choice": {"type": "none"}, "tools": ANTHROPIC["tools"]})
    assert not none.parse_tools
    counted = parse_messages_request({"messages": [USER], "stream": True}, count_only=True)
    assert counted.max_tokens is None and not counted.stream


@pytest.mark.parametrize(("body", "param", "words"), [
    ({"messages": [USER]}, "max_tokens", "required"),
    ({"max_tokens": -1, "messages": [USER]}, "max_tokens", ">= 0"),
    ({"max_tokens": 1, "messages": []}, "messages", "non-empty"),
    ({"max_tokens": 1, "messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role",
     "'user', 'assistant' or 'system'"),
    ({"max_tokens": 1, "messages": [USER], "temperature": 1.5}, "temperature", "[0, 1]"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "data": ""}}]}]},
     "messages[0].content[0]", "'image'"),
    ({"max_tokens": 1, "messages": [USER],
      "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     "tools[0]", "web_search_20250305"),
    ({"max_tokens": 1, "messages": [USER], "tools": [{"name": "f"}]},
     "tools[0].input_schema", "object"),
    ({"max_tokens": 1, "messages": [USER], "stop_sequences": "END"}, "stop_sequences", "list"),
    ({"max_tokens": 1, "messages": [USER], "thinking": {"type": "sometimes"}},
     "thinking.type", "disabled"),
    ({"max_tokens": 1, "messages": [{"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]},
     "messages[0].content[0].input", "object"),
    ({"max_tokens": 1, "messages": [USER, {"role": "assistant", "content": "The answer is"}]},
     "messages[1]", "prefilled reply"),
    ({"max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "tool_result", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id", "string"),
])
def test_bad_requests_name_their_parameter(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_messages_request(body, hosted_tools="reject")
    assert err.value.param == param
    assert words in str(err.value)


def test_error_body_is_anthropics_shape() -> None:
    assert error_body(400, "bad") == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "bad"}}
    assert error_body(503, "busy")["error"]["type"] == "overloaded_error"
    assert error_body(500, "oops")["error"]["type"] == "api_error"
    assert error_body(404, "no")["error"]["type"] == "not_found_error"


FIN = FinishEvent(reason="stop", usage=Usage(prompt_tokens=100, completion_tokens=7,
                                             cached_tokens=64))
REPLY = 'Think.</think>\n\nHello.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'


def _ids(starts_in_reasoning: bool = True) -> StreamParser:
    n = iter(range(100))
    return StreamParser(starts_in_reasoning=starts_in_reasoning,
                        make_id=lambda: f"toolu_{next(n)}")


def test_stream_events_follow_the_sdk_order() -> None:
    events = MessageEvents("msg_1", "m", _ids(), prompt_tokens=100)
    out = events.start()
    for ch in REPLY:  # one character at a time: tags split across deltas
        out += events.text(ch)
    out += events.finish(FIN)
    kinds = [(e["type"], e.get("index"), (e.get("delta") or e.get("content_block") or {})
              .get("type")) for e in out]
    # collapse runs of identical deltas
    runs = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert runs == [
        ("message_start", None, None), ("ping", None, None),
        ("content_block_start", 0, "thinking"), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"), ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"), ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("message_delta", None, None), ("message_stop", None, None)]
    assert out[0]["message"]["usage"]["input_tokens"] == 100
    thinking = "".join(e["delta"]["thinking"] for e in out
                       if e.get("delta", {}).get("type") == "thinking_delta")
    assert thinking == "Think."
    tool = next(e for e in out if e.get("delta", {}).get("type") == "input_json_delta")
    assert json.loads(tool["delta"]["partial_json"]) == {"a": 1}
    end = out[-2]
    assert end["delta"]["stop_reason"] == "tool_use"
    assert end["usage"] == {"input_tokens": 36, "cache_creation_input_tokens": 0,
                            "cache_read_input_tokens": 64, "output_tokens": 7}


def test_message_body_blocks_and_stop_reasons() -> None:
    reply = parse_reply(REPLY, starts_in_reasoning=True)
    body = message_body("msg_1", "m", reply, FIN)
    assert [b["type"] for b in body["content"]] == ["thinking", "text", "tool_use"]
    assert body["content"][2]["input"] == {"a": 1}
    assert body["stop_reason"] == "tool_use"
    assert body["usage"]["cache_read_input_tokens"] == 64
    cut = FinishEvent(reason="length", usage=Usage(prompt_tokens=5, completion_tokens=3))
    plain = message_body("msg_2", "m", parse_reply("Hi", parse_tools=False), cut)
    assert plain["content"] == [{"type": "text", "text": "Hi"}]
    assert plain["stop_reason"] == "max_tokens"
    assert message_body("m", "m", parse_reply("Hi"), FinishEvent(
        reason="stop", usage=Usage()))["stop_reason"] == "end_turn"


# a whole call, then one the token limit cut inside its closing tag (as a constrained
# reply of a random model did on a GPU, where its text ran longer than on these cores)
CUT_CALLS = ('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n'
             '<tool_call>\n{"name": "f", "arguments": {"a": 2}}\n</tool_')
CUT = FinishEvent(reason="length", usage=Usage(prompt_tokens=5, completion_tokens=40))


def test_a_reply_the_limit_cut_says_so_though_it_holds_tool_calls() -> None:
    reply = parse_reply(CUT_CALLS)
    assert [c.arguments for c in reply.tool_calls] == ['{"a": 1}']  # the whole one
    assert ChatChunks.completion("c", "m", reply, CUT)["choices"][0]["finish_reason"] == \
        "length"
    assert message_body("m", "m", reply, CUT)["stop_reason"] == "max_tokens"
    chunks = ChatChunks("c", "m", _ids(False), include_usage=False)
    events = MessageEvents("m", "m", _ids(False), prompt_tokens=5)
    out, evs = [], events.start()
    for ch in CUT_CALLS:
        out += chunks.text(ch)
        evs += events.text(ch)
    out += chunks.finish(CUT)
    evs += events.finish(CUT)
    assert any(c["choices"][0]["delta"].get("tool_calls") for c in out)
    assert out[-1]["choices"][0]["finish_reason"] == "length"
    assert evs[-2]["delta"]["stop_reason"] == "max_tokens"
    # ...and one that ended with its calls says tool_calls / tool_use, as before
    whole = CUT_CALLS.rsplit("<tool_call>", 1)[0]
    assert ChatChunks.completion("c", "m", parse_reply(whole), FIN)["choices"][0][
        "finish_reason"] == "tool_calls"
    assert message_body("m", "m", parse_reply(whole), FIN)["stop_reason"] == "tool_use"
