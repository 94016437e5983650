"""What agents tell the server, parsed and kept: hosted tools left out, Anthropic cache
breakpoints and content parts as marks, where marks lie in the rendered prompt, sessions,
checkpoints kept for a breakpoint's ttl, the stop sequence that ended a reply."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.api.anthropic import parse_messages_request
from proxy.api.chat import TOOLS_END, Mark
from proxy.api.fields import ApiError
from proxy.api.hints import marks_to_place, place
from proxy.api.openai import parse_chat_request
from proxy.api.render import ChatTemplate, load_chat_template, render_chat
from proxy.api.responses import chat_request, parse_responses_request
from proxy.engine.detok import TextStream
from statecache.kvpages import REST_HEAD_BYTES
from statecache.records import Kind, Owner, Role
from statecache.tiers.policy import EvictionClass
from tests.unit.conftest import PoolFactory, put

CHATML = (Path(__file__).resolve().parents[2] / "vendor" / "templates"
          / "chatml-tools-think.jinja").read_text()
TOOL = {"name": "Read", "description": "Read a file", "input_schema": {"type": "object"}}
USER = {"role": "user", "content": "hi"}


def test_hosted_tools_are_left_out_and_named() -> None:
    body = {"max_tokens": 4, "messages": [USER],
            "tools": [TOOL, {"type": "web_search_20250305", "name": "web_search"},
                      {"type": "code_execution_20250825", "name": "code_execution"}]}
    req = parse_messages_request(body)
    assert [t["function"]["name"] for t in req.tools or ()] == ["Read"]
    assert req.ignored_tools == ("web_search_20250305", "code_execution_20250825")
    with pytest.raises(ApiError, match="web_search_20250305"):
        parse_messages_request(body, hosted_tools="reject")
    # Codex's default tools: functions and its hosted web search
    rbody = {"input": "x", "tools": [
        {"type": "function", "name": "shell", "parameters": {"type": "object"}},
        {"type": "web_search", "external_web_access": False},
        {"type": "image_generation"}]}
    r = parse_responses_request(rbody)
    assert [t["function"]["name"] for t in r.tools or ()] == ["shell"]
    assert r.ignored_tools == ("web_search", "image_generation")
    with pytest.raises(ApiError, match="'web_search'"):
        parse_responses_request(rbody, hosted_tools="reject")
    with pytest.raises(ApiError, match="'custom'"):  # a client tool we cannot offer: a 400
        parse_responses_request({"input": "x", "tools": [{"type": "custom", "name": "p"}]})


def test_cache_control_breakpoints_and_parts_become_marks() -> None:
    req = parse_messages_request({
        "max_tokens": 4, "metadata": {"user_id": "user_1_session_abc"},
        "system": [{"type": "text", "text": "Billing."},
                   {"type": "text", "text": "You are Claude.", "cache_control": {
                       "type": "ephemeral", "ttl": "1h"}}],
        "tools": [TOOL, {**TOOL, "name": "Bash", "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "<reminder>"},
            {"type": "text", "text": "Fix it.", "cache_control": {"type": "ephemeral"}}]}]})
    assert req.session == "user_1_session_abc"
    assert set(req.marks) == {
        Mark(0, 9), Mark(0, 24, 3600.0),  # "Billing.\nYou are Claude."
        Mark(TOOLS_END, 2, 300.0),  # after both tools
        Mark(1, 11), Mark(1, 18, 300.0)}  # "<reminder>\nFix it."


def test_a_top_level_cache_control_marks_the_last_block() -> None:
    req = parse_messages_request({"max_tokens": 4, "cache_control": {"type": "ephemeral"},
                                  "messages": [{"role": "user", "content": "Fix it."}]})
    assert req.marks == (Mark(0, 7, 300.0),)


@pytest.mark.parametrize("cc", [{"type": "persistent"}, {"type": "ephemeral", "ttl": "2h"},
                                "yes"])
def test_bad_cache_control_is_a_400(cc: Any) -> None:
    with pytest.raises(ApiError, match="cache_control"):
        parse_messages_request({"max_tokens": 4, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "x", "cache_control": cc}]}]})


def test_at_most_four_breakpoints() -> None:
    block = {"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}
    with pytest.raises(ApiError, match="at most 4"):
        parse_messages_request({"max_tokens": 4, "messages": [
            {"role": "user", "content": [block] * 5}]})


def test_sessions_are_bounded_strings() -> None:
    assert parse_responses_request({"input": "x", "prompt_cache_key": "t-1"}).session == "t-1"
    assert parse_chat_request({"messages": [USER], "prompt_cache_key": "k"}).session == "k"
    with pytest.raises(ApiError, match="prompt_cache_key"):
        parse_chat_request({"messages": [USER], "prompt_cache_key": "k" * 300})
    with pytest.raises(ApiError, match="prompt_cache_key"):
        parse_responses_request({"input": "x", "prompt_cache_key": 5})


def _placed(t: ChatTemplate, req: Any) -> dict[Mark, str]:
    """Each mark with the 12 characters of the prompt after it."""
    text = render_chat(t, req)
    return {m: text[c:c + 12] for m, c in place(lambda r: render_chat(t, r), req, text,
                                                 marks_to_place(req))}


@pytest.mark.parametrize("template", ["gemma", "chatml"])
def test_marks_lie_where_their_text_starts_or_ends(template: str) -> None:
    t = load_chat_template(None, bos_token="<bos>", eos_token="<eos>") \
        if template == "gemma" else ChatTemplate(CHATML)
    req = parse_messages_request({
        "max_tokens": 4,
        "system": [{"type": "text", "text": "Be terse."}],
        "tools": [{**TOOL, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "  <reminder>"},  # Gemma's template trims it
            {"type": "text", "text": "Fix it.", "cache_control": {"type": "ephemeral"}}]},
            {"role": "system", "content": "env: linux"}]})
    found = _placed(t, req)
    assert found[Mark(0, 0)].startswith("Be terse.")  # the first turn's messages
    assert found[Mark(1, 0)].lstrip(" ").startswith("<reminder>")
    assert found[Mark(1, 13)].startswith("Fix it.")  # its second part
    after_fix = found[Mark(1, 20, 300.0)]  # the end of the block with cache_control
    assert not after_fix.startswith("Fix") and after_fix.startswith(("\n", "<"))
    assert found[Mark(2, 0)].startswith("env: linux")  # folded or in place
    tools_end = found[Mark(TOOLS_END, 1, 300.0)]
    assert tools_end.startswith(("\n</tools>", "</tools>")), tools_end


def test_only_the_first_turn_gives_share_points() -> None:
    req = chat_request(parse_responses_request({"instructions": "I", "input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "a"},
                                          {"type": "input_text", "text": "b"}]},
        {"role": "user", "content": "u"},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "r"}]},
        {"role": "user", "content": [{"type": "input_text", "text": "c"},
                                     {"type": "input_text", "text": "d"}]}]}), ())
    assert marks_to_place(req) == [Mark(0, 0), Mark(1, 0), Mark(1, 2), Mark(2, 0)]


def test_kept_checkpoints_go_last_until_their_time_is_up(make_pool: PoolFactory) -> None:
    # each entry costs 10 state bytes + H (kept whole) + 4 x 4 token bytes = 26 + H; the
    # budget holds 3
    pool = make_pool(ram=3 * (26 + REST_HEAD_BYTES), disk=None)
    kept = pool.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=[1, 2, 3, 4],
                       role=Role.PERIODIC, data=b"k" * 10, keep_s=1000.0)
    assert kept is not None
    a = put(pool, [5, 6, 7, 8], b"a" * 10, role=Role.BRANCH)
    put(pool, [9, 10, 11, 12], b"b" * 10, role=Role.BRANCH)
    put(pool, [13, 14, 15, 16], b"c" * 10, role=Role.BRANCH)  # evicts the oldest unkept
    ids = {d["id"] for d in pool.describe()}
    assert kept.id in ids and a.id not in ids
    assert pool.stats().kept_entries == 1
    [desc] = [d for d in pool.describe() if d["id"] == kept.id]
    assert desc["kept_until"] > desc["created"] + 990
    # a breakpoint on a prefix the pool holds keeps it again; one it does not hold: False
    assert pool.keep(pool.chain([1, 2, 3, 4]), 4, 5.0) is True
    assert pool.keep(pool.chain([1, 2, 3, 9]), 4, 5.0) is False
    pool.sanity_check()


def test_a_kept_checkpoint_whose_time_is_up_is_evicted_as_usual(
        make_pool: PoolFactory) -> None:
    pool = make_pool(ram=3 * (26 + REST_HEAD_BYTES), disk=None)
    kept = pool.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=[1, 2, 3, 4],
                       role=Role.PERIODIC, data=b"k" * 10, keep_s=2.0)  # 2 clock ticks
    assert kept is not None
    for i in range(3):
        put(pool, [20 + i, 2, 3, 4], bytes([i]) * 10, role=Role.BRANCH)
    assert kept.id not in {d["id"] for d in pool.describe()}
    assert pool.stats().kept_entries == 0


def test_eviction_class_of_a_kept_entry() -> None:
    from statecache.tiers.policy import eviction_class
    assert eviction_class(Role.PERIODIC, 0, kept=True) is EvictionClass.KEPT
    assert max(EvictionClass) is EvictionClass.KEPT  # evicted last


def test_the_stop_string_that_ended_the_text_is_named() -> None:
    s = TextStream(("END", "STOP"))
    assert s.feed(b"abc STOP and END") == "abc "
    assert s.stopped and s.matched == "STOP"  # the earliest in the text, not the first listed
    assert TextStream(("x",)).matched is None
