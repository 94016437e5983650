"""Volatile fragments: [[server.volatile]] rules, checked at config load, applied to
message text before rendering, counted per rule."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxy.api.chat import ChatRequest
from proxy.api.openai import parse_chat_request
from proxy.api.volatile import Volatile
from statecache.config import ConfigError, VolatileRule, load_config

REPO = Path(__file__).resolve().parents[2]
BILLING = "x-anthropic-billing-header: cc_version=2.1.117.48f; cc_entrypoint=cli; cch=71fea;"


def _request(system: str, user: str = "Run the tests.") -> ChatRequest:
    return parse_chat_request({"model": "m", "messages": [
        {"role": "system", "content": system},
        {"role": "user", "content": user},
        {"role": "assistant", "content": "ok", "reasoning_content": "id 42 seen",
         "tool_calls": [{"id": "c1", "type": "function",
                         "function": {"name": "f", "arguments": '{"id": 42}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "session 42 done"}]})


def test_rules_rewrite_every_message_text_in_order_and_count() -> None:
    v = Volatile([VolatileRule(r"session \d+", "session N", name="session"),
                  VolatileRule(r"N done", "finished")])
    req = parse_chat_request({"model": "m", "messages": [
        {"role": "system", "content": "You are in session 7."},
        {"role": "user", "content": "session 8 and session 9"},
        {"role": "tool", "tool_call_id": "c", "content": "session 1 done"}]})
    out = v.apply(req)
    assert [m.content for m in out.messages] == [
        "You are in session N.", "session N and session N", "session finished"]
    assert v.counts() == {"session": 4, "1": 1}  # the unnamed rule by its index


def test_reasoning_tool_arguments_and_tools_stay() -> None:
    v = Volatile([VolatileRule(r"42", "N")])
    req = _request("plain")
    out = v.apply(req)
    assert out.messages[2].reasoning_content == "id 42 seen"
    assert out.messages[2].tool_calls == req.messages[2].tool_calls
    assert out.messages[3].content == "session N done"


def test_nothing_matched_is_the_same_request_and_no_rules_is_off() -> None:
    req = _request("plain")
    v = Volatile([VolatileRule(r"zzz", "")])
    assert v.apply(req) is req and v.counts() == {"0": 0}
    off = Volatile()
    assert not off and off.apply(req) is req and off.counts() == {}


def test_the_agent_config_drops_claude_codes_billing_line_only() -> None:
    rules = load_config(REPO / "configs" / "hybrid-agent.toml").server.volatile
    v = Volatile(rules)
    # Messages joins the system blocks with "\n": the billing block is the first line
    req = parse_chat_request({"model": "m", "messages": [
        {"role": "system", "content": f"{BILLING}\nYou are Claude Code."},
        {"role": "user", "content": "quote: x-anthropic-billing-header: kept mid-line"}]})
    out = v.apply(req)
    assert out.messages[0].content == "You are Claude Code."
    assert out.messages[1].content == "quote: x-anthropic-billing-header: kept mid-line"
    assert v.counts() == {"claude-code-billing": 1}


def test_config_reads_array_of_tables(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[[server.volatile]]\npattern = "cch=[0-9a-f]+"\nreplace = "cch=0"\n'
                 '[[server.volatile]]\nname = "date"\npattern = "\\\\d{4}-\\\\d\\\\d-\\\\d\\\\d"\n')
    rules = load_config(f).server.volatile
    assert rules == (VolatileRule("cch=[0-9a-f]+", "cch=0"),
                     VolatileRule(r"\d{4}-\d\d-\d\d", "", "date"))
    assert load_config(None).server.volatile == ()  # off by default
    over = load_config(f, {"server.volatile": [{"pattern": "x+"}]}).server.volatile
    assert over == (VolatileRule("x+"),)


@pytest.mark.parametrize(("value", "message"), [
    ({"pattern": "a"}, "expected an array of tables"),
    (["a"], r"server.volatile\[0\]: expected a table"),
    ([{"pattern": "a"}, {"pattern": "b", "with": "c"}],
     r"server.volatile\[1\]: unknown key 'with'; valid keys: pattern, replace, name"),
    ([{"replace": "x"}], r"server.volatile\[0\]: a rule needs a pattern"),
    ([{"pattern": 5}], r"server.volatile\[0\].pattern: expected str"),
    ([{"pattern": "ok"}, {"pattern": "(unclosed"}],
     r"server.volatile\[1\] \('\(unclosed'\): missing \), unterminated subpattern"),
    ([{"pattern": "(a)", "replace": r"\2"}], r"server.volatile\[0\] .*invalid group reference"),
    ([{"pattern": "a", "replace": r"\g<name>"}], r"server.volatile\[0\] .*unknown group name"),
    ([{"pattern": "a*"}], r"server.volatile\[0\] \('a\*'\): the pattern matches the empty"),
    ([{"pattern": "(?m)^"}], r"matches the empty text"),
    ([{"pattern": "a", "name": "x"}, {"pattern": "b", "name": "x"}], "names must differ"),
])
def test_bad_rules_stop_the_load_naming_the_rule(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_config(None, {"server.volatile": value})


def test_bad_rule_in_a_file_names_it(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text('[[server.volatile]]\npattern = "fine"\n[[server.volatile]]\npattern = "[z-a]"\n')
    with pytest.raises(ConfigError, match=r"server.volatile\[1\] \('\[z-a\]'\): bad character"):
        load_config(f)
