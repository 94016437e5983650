"""tools.session_report without a server: what each API's client sends next, in its own
form, and the per-turn arithmetic."""

from __future__ import annotations

import pytest

from tools.session_report import (
    PRIOR_CALL,
    ChatClient,
    MessagesClient,
    ResponsesClient,
    add_next,
    main,
    row,
    shortfall,
    user_text,
)


def test_next_input_answers_calls_else_alternates_tool_results_and_user_messages() -> None:
    c = MessagesClient(port=1, max_tokens=8)
    add_next(c, 0, [PRIOR_CALL[0]], 10)
    assert c.messages[-1]["content"][0]["tool_use_id"] == "call_0"
    c.messages.append({"role": "assistant", "content": [{"type": "thinking", "thinking": "x"}]})
    add_next(c, 1, ["toolu_a", "toolu_b"], 10)  # both results in one user message
    assert [b["tool_use_id"] for b in c.messages[-1]["content"]] == ["toolu_a", "toolu_b"]
    c.messages.append({"role": "assistant", "content": [{"type": "thinking", "thinking": "y"}]})
    add_next(c, 2, [], 10)
    assert c.messages[-1] == {"role": "user",
                              "content": [{"type": "text", "text": user_text(2)}]}
    add_next(c, 3, [], 10)  # after a user text block: the same user message
    assert c.messages[-1]["content"][-1]["tool_use_id"] == "call_3"


def test_each_client_starts_from_the_same_exchange_in_its_own_form() -> None:
    chat = ChatClient(port=1, max_tokens=8)
    assert [m["role"] for m in chat.messages] == ["system", "user", "assistant"]
    assert chat.messages[-1]["tool_calls"][0]["id"] == PRIOR_CALL[0]
    resp = ResponsesClient(port=1, max_tokens=8)
    assert [i.get("type", "message") for i in resp.items] == [
        "message", "reasoning", "function_call"]
    add_next(resp, 1, [], 5)
    assert resp.items[-1] == {"type": "function_call_output", "call_id": "call_1",
                              "output": resp.items[-1]["output"]}
    assert len(resp.items[-1]["output"]) == 5


def test_rows_and_shortfall() -> None:
    a = row(1, None, 100, 0, 10, 0.5)
    b = row(2, a, 150, 105, 10, None)
    assert (b["new"], b["prefilled"], b["ttft"]) == (40, 45, 0.0)
    assert shortfall([a, b]) == 5


def test_api_choice_is_checked() -> None:
    with pytest.raises(SystemExit):
        main(["--api", "grpc"])
