"""Reasoning and tool-call extraction, whole and streamed."""

from __future__ import annotations

import itertools
import json

import pytest

from proxy.api.reply import Delta, StreamParser, parse_reply, starts_in_reasoning

CALL = '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py", "n": 2}}\n</tool_call>'


def _ids() -> itertools.count[int]:
    return itertools.count()


def _stream(text: str, cuts: list[int], **kw: bool) -> tuple[Delta, list[Delta]]:
    """Feed ``text`` cut at ``cuts``; return the merged result and each delta."""
    counter = _ids()
    p = StreamParser(make_id=lambda: f"call_{next(counter)}", **kw)
    deltas = []
    prev = 0
    for c in [*cuts, len(text)]:
        deltas.append(p.feed(text[prev:c]))
        prev = c
    deltas.append(p.finish())
    merged = Delta()
    for d in deltas:
        merged.extend(d)
    return merged, deltas


def _whole(text: str, **kw: bool) -> Delta:
    return _stream(text, [], **kw)[0]


def _splits(n: int, max_piece: int = 3) -> list[list[int]]:
    """Every way to cut a string of length n into pieces of 1..max_piece characters."""
    out: list[list[int]] = []

    def walk(pos: int, cuts: list[int]) -> None:
        if pos == n:
            out.append(cuts[:-1])
            return
        for k in range(1, min(max_piece, n - pos) + 1):
            walk(pos + k, [*cuts, pos + k])

    walk(0, [])
    return out


def test_reasoning_then_content() -> None:
    d = parse_reply("<think>\nLet me see.\n</think>\n\nThe answer is 4.")
    assert (d.reasoning, d.content, d.tool_calls) == ("Let me see.", "The answer is 4.", [])


def test_prompt_opened_think_only_close_appears() -> None:
    prompt = "<|im_start|>assistant\n<think>\n"
    assert starts_in_reasoning(prompt)
    d = parse_reply("I should add.\n</think>\n\n4", starts_in_reasoning=True)
    assert (d.reasoning, d.content) == ("I should add.", "4")


def test_closed_empty_think_in_prompt_is_not_reasoning() -> None:
    # Qwen3 with enable_thinking=false closes the block in the generation prompt.
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_reasoning("<start_of_turn>model\n")


def test_unfinished_reasoning_is_all_reasoning() -> None:
    d = parse_reply("<think>still going", parse_tools=True)
    assert (d.reasoning, d.content) == ("still going", "")


def test_think_after_content_is_text() -> None:
    d = parse_reply("Use <think> tags.</think>")
    assert (d.reasoning, d.content) == ("", "Use <think> tags.</think>")


def test_tool_call_extracted_with_json_arguments() -> None:
    d = parse_reply("<think>need the file</think>Reading it.\n" + CALL)
    assert d.reasoning == "need the file"
    assert d.content == "Reading it."
    (call,) = d.tool_calls
    assert call.name == "read_file"
    assert json.loads(call.arguments) == {"path": "a.py", "n": 2}
    assert call.id.startswith("call_") and len(call.id) > 10
    assert call.to_json()["function"] == {"name": "read_file", "arguments": call.arguments}


def test_two_tool_calls_and_no_whitespace_content() -> None:
    d = parse_reply(CALL + "\n" + CALL.replace("read_file", "grep") + "\n")
    assert [c.name for c in d.tool_calls] == ["read_file", "grep"]
    assert d.content == ""
    assert d.tool_calls[0].id != d.tool_calls[1].id


def test_arguments_given_as_json_string_are_kept() -> None:
    d = parse_reply('<tool_call>{"name": "f", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert d.tool_calls[0].arguments == '{"x": 1}'


def test_non_ascii_arguments_stay_readable() -> None:
    d = parse_reply('<tool_call>{"name": "say", "arguments": {"t": "héllo"}}</tool_call>')
    assert d.tool_calls[0].arguments == '{"t": "héllo"}'


@pytest.mark.parametrize("body", [
    '{"name": "f", "arguments": {"x": 1}',  # truncated JSON
    '{"arguments": {}}',  # no name
    '["f"]',
    'f(x=1)',
])
def test_malformed_tool_call_stays_in_content(body: str) -> None:
    text = f"Calling.<tool_call>{body}</tool_call>"
    d = parse_reply(text)
    assert d.tool_calls == []
    assert d.content == f"Calling.<tool_call>{body}</tool_call>"


def test_unclosed_tool_call_stays_in_content() -> None:
    d = parse_reply('<tool_call>{"name": "f"')
    assert (d.content, d.tool_calls) == ('<tool_call>{"name": "f"', [])


def test_tool_calls_not_parsed_without_tools() -> None:
    d = parse_reply(CALL, parse_tools=False)
    assert d.tool_calls == [] and d.content == CALL


# Short texts: every split into deltas of 1..3 characters (T(16) = 10609 ways).
SHORT = [
    ("<think>a</think>b", False),  # 17 characters; the longest one
    ("a</think> b <t", True),
    (" <think>x</th", False),
    ("x </tool_call>", False),
    ("a<tool_call>", False),
    ("<to<think>", False),
]
# Longer texts: every split into one, two or three pieces, and every stride of 1..3.
LONG = [
    ("<think>a b</think> x <tool_call>{\"name\":\"f\",\"arguments\":{}}</tool_call> y", False),
    (" \n<think>\n r \n</think>\n\nhi <to", False),
    ("r</think>c<tool_call>bad</tool_call>\n<tool_call>{\"name\":\"g\"}</tool_call>", True),
    ("</thin</think><think></think>", True),
    ("a < b <= c </tool_call> <tool_ca", False),
]


def _few_cuts(n: int) -> list[list[int]]:
    cuts = [[i] for i in range(1, n)] + [[i, j] for i in range(1, n) for j in range(i + 1, n)]
    return cuts + [list(range(k, n, k)) for k in (1, 2, 3)]


def _check_stream(text: str, in_reasoning: bool, splits: list[list[int]]) -> None:
    whole = _whole(text, starts_in_reasoning=in_reasoning)
    clean = "<" not in whole.reasoning + whole.content
    for cuts in splits:
        merged, deltas = _stream(text, cuts, starts_in_reasoning=in_reasoning)
        assert merged == whole, cuts
        if clean:  # then no delta may carry any piece of a tag
            assert all("<" not in d.reasoning + d.content for d in deltas), cuts


@pytest.mark.parametrize(("text", "in_reasoning"), SHORT)
def test_stream_equals_whole_for_every_split(text: str, in_reasoning: bool) -> None:
    _check_stream(text, in_reasoning, _splits(len(text)))


@pytest.mark.parametrize(("text", "in_reasoning"), LONG)
def test_stream_equals_whole_long_texts(text: str, in_reasoning: bool) -> None:
    _check_stream(text, in_reasoning, _few_cuts(len(text)))


def test_whole_results_of_the_stream_texts() -> None:
    # What the texts above parse to, so the equality checks compare the right thing.
    assert _whole("<think>a</think>b") == Delta("a", "b")
    assert _whole("a</think> b <t", starts_in_reasoning=True) == Delta("a", "b <t")
    assert _whole(" <think>x</th") == Delta("x</th", "")
    assert _whole("x </tool_call>") == Delta("", "x </tool_call>")
    # an opener the reply ends on holds no call: dropped, never content (canitoolcall's
    # mistral/v13think-stop-at-open-marker)
    assert _whole("a<tool_call>") == Delta("", "a")
    d = _whole(LONG[0][0])
    # text around a call is content as written (canitoolcall's rule): " y" after " x "
    assert (d.reasoning, d.content, [c.name for c in d.tool_calls]) == ("a b", "x  y", ["f"])
    d = _whole(LONG[2][0], starts_in_reasoning=True)
    assert (d.reasoning, d.content) == ("r", "c<tool_call>bad</tool_call>")
    assert [(c.name, c.arguments) for c in d.tool_calls] == [("g", "{}")]
    assert _whole(LONG[3][0], starts_in_reasoning=True) == Delta("</thin", "<think></think>")


def test_split_tag_is_held_back_then_resolved() -> None:
    p = StreamParser(parse_tools=True)
    assert p.feed("Hello <tool").content == "Hello"
    assert p.feed("_c").content == ""
    d = p.feed('all>{"name": "f", "arguments": {}}</tool_c')
    assert (d.content, d.tool_calls) == ("", [])
    d = p.feed("all>")
    assert [c.name for c in d.tool_calls] == ["f"]
    assert p.finish() == Delta()


def test_false_alarm_prefix_is_released() -> None:
    p = StreamParser()
    assert p.feed("a <t").content == "a"
    assert p.feed("ea").content == " <tea"
