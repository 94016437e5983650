"""OpenAI Responses: input items parse into the shared chat request (and render as the
same conversation sent to chat completions does); the store of recent responses; events."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.api.chat import ChatMessage, Thinking, ToolCall
from proxy.api.fields import ApiError
from proxy.api.openai import parse_chat_request
from proxy.api.render import VENDOR_TEMPLATES, ChatTemplate, render_chat
from proxy.api.reply import StreamParser, parse_reply
from proxy.api.response_store import ResponseStore
from proxy.api.responses import REASONING_MARK, chat_request, parse_responses_request
from proxy.api.responses_events import (
    ResponseEvents,
    assistant_message,
    finished,
    output_items,
    response_head,
)
from proxy.engine.types import FinishEvent, Usage

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}

# One agent exchange in the Responses form ...
RESPONSES: dict[str, Any] = {
    "model": "gpt-x", "instructions": "You are an agent.",
    "tools": [{"type": "function", "name": "read_file", "description": "Read a file.",
               "parameters": SCHEMA, "strict": False}],
    "input": [
        {"role": "user", "content": "Why do tests fail?"},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Read the test."}]},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Reading.", "annotations": []}]},
        {"type": "function_call", "call_id": "call_1", "name": "read_file",
         "arguments": "{\"path\": \"t.py\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "assert 1 == 2"},
        {"type": "message", "role": "user",
         "content": [{"type": "input_text", "text": "Go on."}]},
    ],
}
# ... and the same exchange as a chat-completions client sends it.
CHAT: dict[str, Any] = {
    "messages": [
        {"role": "system", "content": "You are an agent."},
        {"role": "user", "content": "Why do tests fail?"},
        {"role": "assistant", "content": "Reading.", "reasoning_content": "Read the test.",
         "tool_calls": [{"id": "call_1", "type": "function", "function": {
             "name": "read_file", "arguments": "{\"path\": \"t.py\"}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "assert 1 == 2"},
        {"role": "user", "content": "Go on."},
    ],
    "tools": [{"type": "function", "function": {
        "name": "read_file", "description": "Read a file.", "parameters": SCHEMA}}],
}


def test_items_parse_into_chat_messages() -> None:
    req = parse_responses_request(RESPONSES)
    assert req.messages == (
        ChatMessage(role="user", content="Why do tests fail?"),
        ChatMessage(role="assistant", content="Reading.", reasoning_content="Read the test.",
                    tool_calls=(ToolCall("call_1", "read_file", '{"path": "t.py"}'),)),
        ChatMessage(role="tool", content="assert 1 == 2", tool_call_id="call_1"),
        ChatMessage(role="user", content="Go on."),
    )
    chat = chat_request(req, ())
    assert chat.messages[0] == ChatMessage(role="system", content="You are an agent.")
    assert chat.tools == tuple(CHAT["tools"])
    assert req.store and req.parallel_tool_calls and req.parse_tools


def test_same_conversation_renders_the_same_prompt_as_chat() -> None:
    tpl = ChatTemplate((VENDOR_TEMPLATES / "chatml-tools-think.jinja").read_text(),
                       origin="test")
    assert render_chat(tpl, chat_request(parse_responses_request(RESPONSES), ())) == \
        render_chat(tpl, parse_chat_request(CHAT))


def test_string_input_developer_role_and_reasoning_sent_back_encrypted() -> None:
    assert parse_responses_request({"input": "hi"}).messages == (
        ChatMessage(role="user", content="hi"),)
    req = parse_responses_request({"input": [
        {"role": "developer", "content": "rules"},
        # only encrypted_content came back (as the Codex CLI sends it): ours is read ...
        {"type": "reasoning", "summary": [], "encrypted_content": REASONING_MARK + "mine"},
        {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "d", "name": "g", "arguments": "{}"},
        # ... another server's is not
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "s"}],
         "encrypted_content": "gAAAA..."},
        {"role": "assistant", "content": "done"},
    ]})
    assert req.messages == (
        ChatMessage(role="system", content="rules"),
        ChatMessage(role="assistant", content="", reasoning_content="mine",
                    tool_calls=(ToolCall("c", "f", "{}"), ToolCall("d", "g", "{}"))),
        ChatMessage(role="assistant", content="done"),
    )


def test_sampling_and_options() -> None:
    req = parse_responses_request({
        "input": "x", "max_output_tokens": 20, "temperature": 0, "top_p": 0.5,
        "store": False, "parallel_tool_calls": False, "stream": True, "user": "u",
        "reasoning": {"effort": "none"}, "tool_choice": {"type": "function", "name": "f"},
        "tools": [{"type": "function", "name": "f"}],
        "metadata": {"k": "v"}, "text": {"format": {"type": "text"}}, "truncation": "auto"})
    s = req.sampling
    assert (req.max_tokens, s.temperature, s.top_p) == (20, 0.0, 0.5)
    assert not req.store and not req.parallel_tool_calls and req.stream
    assert req.thinking == Thinking(on=False) and dict(req.template_kwargs) == {}
    assert req.tool_choice == {"type": "function", "function": {"name": "f"}}
    head = response_head("resp_1", "m", req)
    assert head["tool_choice"] == {"type": "function", "name": "f"}
    assert head["max_output_tokens"] == 20 and head["metadata"] == {"k": "v"}


def test_namespace_tools_are_offered_by_name_and_calls_carry_the_namespace() -> None:
    # The Codex CLI groups its sub-agent tools in a namespace.
    req = parse_responses_request({"input": "x", "tools": [
        RESPONSES["tools"][0],
        {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [
            {"type": "function", "name": "spawn", "parameters": {"type": "object"}}]}]})
    assert req.tools is not None
    assert [t["function"]["name"] for t in req.tools] == ["read_file", "spawn"]
    assert req.namespaces == {"spawn": "agents"}
    reply = parse_reply('x</think><tool_call>{"name": "spawn", "arguments": {}}</tool_call>'
                        '<tool_call>{"name": "read_file", "arguments": {}}</tool_call>',
                        starts_in_reasoning=True)
    calls = [i for i in output_items(reply, req.namespaces) if i["type"] == "function_call"]
    assert [(c["name"], c.get("namespace")) for c in calls] == [
        ("spawn", "agents"), ("read_file", None)]


@pytest.mark.parametrize(("body", "param", "words"), [
    ({}, "input", "string or a non-empty list"),
    ({"input": "x", "tools": [RESPONSES["tools"][0], RESPONSES["tools"][0]]}, "tools",
     "given more than once: read_file"),
    ({"input": "x", "tools": [{"type": "namespace", "name": "n", "tools": [
        {"type": "mcp", "server_label": "s"}]}]}, "tools[0].tools[0].type", "'mcp'"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "'item_reference'"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input[0].type", "'web_search_call'"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "'web_search'"),
    ({"input": "x", "tools": [{"type": "file_search", "vector_store_ids": []}]},
     "tools[0].type", "'file_search'"),
    ({"input": "x", "tools": [{"type": "computer_use_preview"}]}, "tools[0].type",
     "'computer_use_preview'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0]", "'input_image'"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[0].call_id", "string"),
    ({"input": [{"role": "wizard", "content": "x"}]}, "input[0].role", "'wizard'"),
    ({"input": "x", "background": True}, "background", "not supported"),
    ({"input": "x", "max_output_tokens": -1}, "max_output_tokens", ">= 0"),
    ({"input": "x", "tool_choice": "sometimes"}, "tool_choice", "'required'"),
])
def test_bad_requests_name_their_parameter(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ApiError) as err:
        parse_responses_request(body, hosted_tools="reject")
    assert err.value.param == param
    assert words in str(err.value)


def _msgs(*texts: str) -> tuple[ChatMessage, ...]:
    return tuple(ChatMessage(role="user", content=t) for t in texts)


def test_store_chains_responses_per_tenant() -> None:
    store = ResponseStore()
    store.put("r1", "", None, _msgs("a", "b"))
    store.put("r2", "", "r1", _msgs("c"))
    assert store.history("r2", "") == _msgs("a", "b", "c")
    with pytest.raises(ApiError, match="'r3' is not found") as err:
        store.history("r3", "")
    assert err.value.param == "previous_response_id"
    with pytest.raises(ApiError):
        store.history("r2", "other tenant")


def test_store_is_bounded_and_reading_touches_the_chain() -> None:
    store = ResponseStore(max_responses=3, max_chars=10)
    store.put("r1", "", None, _msgs("aa"))
    store.put("r2", "", "r1", _msgs("bb"))
    store.put("x", "", None, _msgs("cc"))
    store.history("r2", "")  # r1 and r2 are now the most recent: x goes first
    store.put("y", "", None, _msgs("dd"))
    assert len(store) == 3
    with pytest.raises(ApiError):
        store.history("x", "")
    store.put("big", "", None, _msgs("e" * 8))  # 2 + 2 + 2 + 8 chars > 10: drop the oldest
    assert len(store) == 2
    assert store.history("big", "") == _msgs("e" * 8)


REPLY = 'Think.</think>\n\nHello.\n<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
FIN = FinishEvent(reason="stop", usage=Usage(prompt_tokens=100, completion_tokens=7,
                                             cached_tokens=64))


def test_stream_events_and_the_final_response() -> None:
    req = parse_responses_request({"input": "x", "tools": RESPONSES["tools"]})
    head = response_head("resp_1", "m", req)
    events = ResponseEvents(head, StreamParser(starts_in_reasoning=True, make_id=lambda: "c1"),
                            req.namespaces)
    out = events.start()
    for ch in REPLY:
        out += events.text(ch)
    out += events.finish(FIN)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    kinds = [e["type"] for e in out]
    runs = [k for i, k in enumerate(kinds) if i == 0 or k != kinds[i - 1]]
    assert runs == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added",
        "response.reasoning_text.delta", "response.reasoning_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert [e["output_index"] for e in out if e["type"] == "response.output_item.done"] == \
        [0, 1, 2]
    final = out[-1]["response"]
    assert final is events.final and final["status"] == "completed"
    assert final["usage"]["input_tokens_details"]["cached_tokens"] == 64
    parser = StreamParser(starts_in_reasoning=True, make_id=lambda: "c1")
    reply = parser.feed(REPLY)
    reply.extend(parser.finish())
    strip = [{k: v for k, v in item.items() if k != "id"} for item in final["output"]]
    assert strip == [{k: v for k, v in item.items() if k != "id"}
                     for item in output_items(reply, {})]
    assert events.reply.reasoning == "Think." and events.reply.content == "Hello."
    assert assistant_message(events.reply).tool_calls == (ToolCall("c1", "f", '{"a": 1}'),)


def test_token_limit_makes_an_incomplete_response() -> None:
    req = parse_responses_request({"input": "x"})
    cut = FinishEvent(reason="length", usage=Usage(prompt_tokens=3, completion_tokens=2))
    body = finished(response_head("r", "m", req), [], cut)
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
