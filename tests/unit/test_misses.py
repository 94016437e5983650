"""The memory of rendered conversations and the reason it gives for each divergence.

Token ids here are made up: one id per character of a little rendering (role, then
text), so where two prompts part is where their texts part, as on the synthetic model.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

import numpy as np
import pytest

from proxy.api.misses import (
    Conversation,
    SeenConversations,
    Turn,
    chat_conversation,
    explain,
    prompt_conversation,
)
from proxy.api.openai import parse_chat_request
from statecache.pages import common_prefix

SYSTEM = "You are a coding agent. Read files and run the tests. " * 3


def render(turns: Sequence[Turn], tools: str = "") -> list[int]:
    # the tools render after the first message's text, as in ChatML templates
    text = "".join(f"<{t.role}>{t.reasoning}|{t.content}|{tools if i == 0 else ''}"
                   f"{''.join(n + a for n, a in t.calls)}" for i, t in enumerate(turns))
    return [ord(c) for c in text]


def conv(turns: Sequence[Turn], tenant: str = "", tools: str = "",
         tokens: list[int] | None = None) -> Conversation:
    ids = np.asarray(render(turns, tools) if tokens is None else tokens, dtype=np.int32)
    return Conversation(tenant, tuple(turns), tools, "{}", ids, len(ids))


def sys_(text: str = SYSTEM) -> Turn:
    return Turn("system", text)


def user(text: str) -> Turn:
    return Turn("user", text)


def replied(memory: SeenConversations, c: Conversation, reasoning: str, content: str) -> Turn:
    """Remember ``c`` with a reply (reasoning then content, as the model wrote it)."""
    reply = Turn("assistant", content, reasoning)
    text = f"{reasoning}|{content}|"
    memory.remember(c, f"<think>{reasoning}</think>{content}" if reasoning else content,
                    [ord(ch) for ch in f"<assistant>{text}"])
    return reply


def test_common_prefix_finds_the_first_difference() -> None:
    a = np.arange(5000, dtype=np.int32)
    for at in (0, 1, 63, 64, 65, 511, 575, 4999):
        b = a.copy()
        b[at] = -1
        assert common_prefix(a, b) == at
    assert common_prefix(a, a[:100]) == 100 and common_prefix(a[:0], a) == 0
    assert common_prefix(a, a.copy()) == 5000


def test_system_prompt_changed_names_the_token_message_and_text() -> None:
    m = SeenConversations(page=8)
    first = conv([sys_(SYSTEM + "git status: clean"), user("Run the tests.")])
    replied(m, first, "thinking", "done")
    second = conv([sys_(SYSTEM + "git status: M app.py"), user("Run the tests.")])
    d = m.divergence(second)
    at = len("<system>|") + len(SYSTEM) + len("git status: ")
    assert (d.cause, d.token, d.known, d.message, d.role) == \
        ("system prompt changed", at, at, 0, "system")
    assert (d.old, d.new) == ("…ts. git status: clean", "…ts. git status: M app.py")
    assert d.describe() == (f"system prompt changed at token {at} (message 0, system): "
                            f"{d.old!r} -> {d.new!r}")


def test_tools_changed_even_when_the_messages_are_the_same() -> None:
    m = SeenConversations(page=8)
    turns = [sys_(), user("Run the tests.")]
    replied(m, conv(turns, tools='[{"name":"run_tests"}]'), "", "ok")
    d = m.divergence(conv(turns, tools='[{"name":"run_all_tests"}]'))
    assert (d.cause, d.message, d.role) == ("tools changed", -1, "")
    assert "run_tests" in d.old and "run_all_tests" in d.new
    # the tools and the system prompt both changed: the system text renders first
    both = m.divergence(conv([sys_(SYSTEM + "!"), turns[1]], tools='[{"name":"x"}]'))
    assert (both.cause, both.message) == ("system prompt changed", 0)
    # ...and a later message differs too: the tools came first
    later = m.divergence(conv([turns[0], user("Other.")], tools='[{"name":"x"}]'))
    assert later.cause == "tools changed"


def test_earlier_message_edited_and_new_conversation() -> None:
    m = SeenConversations(page=8)
    first = [sys_(), user("Run the tests in tests/test_pool.py please.")]
    reply = replied(m, conv(first), "reason", "answer")
    edited = [sys_(), user("Run the tests in tests/test_ram.py please."), reply, user("More.")]
    d = m.divergence(conv(edited))
    assert (d.cause, d.message, d.role) == ("earlier message edited", 1, "user")
    assert d.old.endswith("tests/test_pool.py please.") and "test_ram" in d.new
    # the same system prompt and another first message: a subagent, a new task
    sub = m.divergence(conv([sys_(), user("Read the pool.")]))
    assert (sub.cause, sub.message, sub.role) == ("new conversation", 1, "user")
    # nothing shares more than a page
    fresh = m.divergence(conv([user("Hi.")]))
    assert (fresh.cause, fresh.token, fresh.message) == ("new conversation", 1, -1)
    assert SeenConversations().divergence(conv([user("hi")])) == \
        type(fresh)(0, "new conversation")


def test_reasoning_dropped_and_reply_re_rendered() -> None:
    m = SeenConversations(page=8)
    first = [sys_(), user("Run the tests.")]
    reply = replied(m, conv(first), "I should read the failing test first.", "Reading it.")
    dropped = Turn("assistant", "Reading it.")
    d = m.divergence(conv([*first, dropped, user("And?")]))
    assert (d.cause, d.message, d.role) == ("reasoning dropped", 2, "assistant")
    assert not d.replayed
    assert (d.old, d.new) == ("I should read the failin…", "")
    spaced = Turn("assistant", "Reading it.", "I should  read the failing test first.")
    d = m.divergence(conv([*first, spaced, user("And?")]))
    assert (d.cause, d.message) == ("reply re-rendered differently", 2)
    assert (d.old, d.new) == ("I should read the failing test fi…",
                              "I should  read the failing test f…")
    # the same text, tokens that differ inside the reply (a tokenizer's other split)
    tokens = render([*first, reply, user("And?")])
    n = len(render(first))
    tokens[n + 15] = 0
    d = m.divergence(conv([*first, reply, user("And?")], tokens=tokens))
    assert (d.cause, d.token, d.message, d.role) == \
        ("reply re-rendered differently", n + 15, 2, "assistant")
    # a reply the client rewrote is an edit
    rewritten = Turn("assistant", "Something else.", reply.reasoning)
    assert m.divergence(conv([*first, rewritten, user("And?")])).cause == \
        "earlier message edited"


def test_continuing_the_conversation_is_known_up_to_the_reply_end() -> None:
    m = SeenConversations(page=8)
    first = [sys_(), user("Run the tests.")]
    reply = replied(m, conv(first), "r", "a")
    follow = conv([*first, reply, user("And?")])
    d = m.divergence(follow)
    known = len(render([*first, reply]))
    assert (d.cause, d.known, d.token) == ("evicted", known, -1)  # the text agreed
    assert d.replayed  # the reply came back as generated
    # the same prompt again (a regenerate): all of it is known but the last token
    again = m.divergence(conv(first))
    assert (again.cause, again.known) == ("evicted", len(render(first)) - 1)
    assert not again.replayed
    # the prompt and the reply, nothing after them: not a continuation either
    assert not m.divergence(conv([*first, reply])).replayed


def test_other_tenant_says_so_without_their_text() -> None:
    m = SeenConversations(page=8)
    secret = [sys_(), user("Alice's secret plan: rewrite the pool.")]
    replied(m, conv(secret, tenant="alice"), "secret reasoning", "secret answer")
    bob = conv([sys_(), user("Run the tests.")], tenant="bob")
    d = m.divergence(bob)
    assert (d.cause, d.token, d.message, d.role, d.old, d.new) == \
        ("other tenant", 0, -1, "", "", "")
    assert d.known == common_prefix(np.asarray(render(secret), np.int32), bob.tokens)
    assert "secret" not in repr(d) and "Alice" not in d.describe()
    # once Bob's own conversation shares as much, it is Bob's own story
    replied(m, bob, "", "ok")
    assert m.divergence(conv([sys_(), user("Run the tests!")], tenant="bob")).cause == \
        "new conversation"


def test_a_conversation_that_continues_another_replaces_it() -> None:
    m = SeenConversations(page=8)
    turns: list[Turn] = [sys_(), user("Turn 0.")]
    for k in range(1, 6):
        reply = replied(m, conv(turns), f"r{k}", f"a{k}")
        turns += [reply, user(f"Turn {k}.")]
        assert len(m) == 1  # one agent session, one entry
    replied(m, conv([sys_(), user("Another task.")]), "", "x")
    assert len(m) == 2


def test_bounded_in_entries_per_tenant_and_bytes() -> None:
    m = SeenConversations(page=16, max_entries=5, per_tenant=3, max_bytes=1 << 20)
    for i in range(4):
        replied(m, conv([sys_(f"{i}. " + SYSTEM)], tenant="a"), "", "x")
    assert len(m) == 3  # per tenant: the oldest went
    assert m.divergence(conv([sys_("0. " + SYSTEM)], tenant="a")).cause == "new conversation"
    assert m.divergence(conv([sys_("1. " + SYSTEM)], tenant="a")).cause == "evicted"
    for t in "bcdefg":
        replied(m, conv([sys_(SYSTEM)], tenant=t), "", "x")
    assert len(m) == 5
    small = SeenConversations(page=8, max_bytes=4000)
    replied(small, conv([sys_("x" * 5000)]), "", "x")  # larger than all of memory
    assert len(small) == 0 and small.nbytes == 0
    for i in range(10):
        replied(small, conv([sys_(f"{i} " + "y" * 300)]), "", "x")
    assert 0 < small.nbytes <= 4000 and len(small) < 10


def test_hostile_tenants_cannot_grow_it() -> None:
    m = SeenConversations(page=8, max_entries=50, max_bytes=200_000)
    for i in range(400):
        replied(m, conv([sys_(f"{i} " + SYSTEM * 4)], tenant=f"t{i}"), "", "x" * 100)
    assert len(m) <= 50 and m.nbytes <= 200_000


def test_threads_remember_and_compare_at_once() -> None:
    m = SeenConversations(page=8, max_entries=40, max_bytes=1 << 20)
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            for i in range(60):
                c = conv([sys_(), user(f"worker {w} task {i % 7}")], tenant=f"t{w % 3}")
                m.divergence(c)
                replied(m, c, "r", f"a{i}")
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    entries = list(m._entries.values())
    assert len(entries) <= 40 and m.nbytes == sum(e.nbytes for e in entries)


def test_from_parsed_requests() -> None:
    body = {"model": "m", "messages": [
        {"role": "system", "content": "S"},
        {"role": "assistant", "content": "", "reasoning_content": "R",
         "tool_calls": [{"id": "c", "type": "function",
                         "function": {"name": "f", "arguments": '{"b": 1, "a": 2}'}}]}],
        "tools": [{"type": "function", "function": {"name": "f"}}]}
    c = chat_conversation("t", parse_chat_request(body), [1, 2, 3], "…<think>\n", None)
    assert c.turns[1] == Turn("assistant", "", "R", (("f", '{"a":2,"b":1}'),))
    assert c.opens_reasoning and c.parse_tools and c.history == 3 and c.tools
    p = prompt_conversation("t", "Once upon", [5, 6])
    assert p.turns == (Turn("prompt", "Once upon"),)


@pytest.mark.parametrize("continued", [True, False])
def test_raw_prompts_compare_as_text(continued: bool) -> None:
    m = SeenConversations(page=4)
    first = prompt_conversation("", "Once upon a time there was", [ord(c) for c in
                                                                 "Once upon a time there was"])
    m.remember(first, " a pool", [ord(c) for c in " a pool"])
    text = "Once upon a time there was a pool. More" if continued else \
        "Once upon a time there were two"
    tokens = [ord(c) for c in text]
    if continued:
        tokens[30] = 0  # the same text, another tokenization of the reply
    d = explain(m._entries[0].conv, prompt_conversation("", text, tokens), 30 if continued
                else common_prefix(m._entries[0].conv.tokens, np.asarray(tokens, np.int32)))
    assert d.cause == ("reply re-rendered differently" if continued
                       else "earlier message edited")


def _named(turns: Sequence[Turn], session: str | None) -> Conversation:
    ids = np.asarray(render(turns), dtype=np.int32)
    return Conversation("", tuple(turns), "", "{}", ids, len(ids), session=session)


def test_a_named_conversation_is_compared_with_itself_first() -> None:
    m = SeenConversations(page=8)
    first = [sys_(), user("Run the tests in tests/test_pool.py please.")]
    c = _named(first, "thread-1")
    m.remember(c, "answer", [ord(ch) for ch in "<assistant>|answer|"])
    # another conversation of the same agent: same system prompt, its own first message
    d = m.divergence(_named([sys_(), user("Run the tests in tests/test_pool.py today.")],
                            "thread-2"))
    assert d.cause == "new conversation"
    # the same conversation with its system prompt changed at the start (a header that
    # changes per request): never a new conversation, and it says where
    changed = [sys_("Billing: 42. " + SYSTEM), first[1], Turn("assistant", "answer"),
               user("And?")]
    d = m.divergence(_named(changed, "thread-1"))
    assert (d.cause, d.message) == ("system prompt changed", 0)


def test_a_reply_whose_text_came_back_in_other_tokens_is_named() -> None:
    # ids: one per character, and two more: a byte that a reply cut by max_tokens ended
    # with (streamed as U+FFFD), and U+FFFD as the client's text tokenizes it
    text_of = {ord(ch): ch for ch in "<>|abcdefghijklmnopqrstuvwxyz.?ARSTU enswr"}
    text_of.update({1000: "\ufffd", 1001: "\ufffd"})

    def text(ids: np.ndarray) -> str:
        return "".join(text_of.get(int(i), "?") for i in ids)

    m = SeenConversations(page=8, text=text)
    first = [sys_(), user("Run the tests.")]
    c = conv(first)
    n = len(c.tokens)
    reply_ids = [ord(ch) for ch in "<assistant>|caf"] + [1000]
    m.remember(c, "caf\ufffd", reply_ids)
    after = [ord(ch) for ch in "|<user>|And?|"]
    back = [*first, Turn("assistant", "caf\ufffd"), user("And?")]
    same_text = list(c.tokens) + reply_ids[:-1] + [1001] + after
    d = m.divergence(conv(back, tokens=same_text))
    assert (d.cause, d.token, d.message) == ("reply re-tokenized differently",
                                             n + len(reply_ids) - 1, 2)
    assert d.known == n + len(reply_ids)  # the whole reply could have been reused
    assert "reply re-tokenized differently at token" in d.describe()
    # other text in those tokens: not a re-tokenization
    other_text = list(c.tokens) + reply_ids[:-1] + [ord("e")] + after
    assert m.divergence(conv(back, tokens=other_text)).cause == "reply re-rendered differently"
    # without a way to read tokens it cannot tell
    blind = SeenConversations(page=8)
    blind.remember(c, "caf\ufffd", reply_ids)
    assert blind.divergence(conv(back, tokens=same_text)).cause == \
        "reply re-rendered differently"


def test_a_re_rendered_reply_names_the_family_and_where() -> None:
    from proxy.api.syntax.families import QWEN_XML

    m = SeenConversations(page=8, text=lambda ids: "".join(chr(int(i)) for i in ids))
    first = [sys_(), user("Read it.")]
    c = conv(first)
    reply = replied(m, dataclasses.replace(c, syntax=QWEN_XML), "", "<function=f>")
    tokens = render([*first, reply, user("And?")])
    n = len(render(first))
    tokens[n + 3] = ord("X")  # the template wrote the reply's tokens otherwise
    d = m.divergence(dataclasses.replace(conv([*first, reply, user("And?")], tokens=tokens),
                                         syntax=QWEN_XML))
    assert (d.cause, d.token, d.family) == ("reply re-rendered differently", n + 3,
                                            "qwen3-xml")
    assert "by the qwen3-xml template" in d.describe()
    assert (d.old, d.new) == ("<assistant>|<fu", "<asXistant>|<fu")
