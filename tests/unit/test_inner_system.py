"""System and developer messages after the first (proxy/api/inner.py): what each template
does with them, learned by rendering, and the one folding rule where it refuses them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from proxy.api.anthropic import parse_messages_request
from proxy.api.chat import ChatMessage
from proxy.api.inner import OPEN, InnerSystem, fold_inner_system, probe_inner_system
from proxy.api.openai import parse_chat_request
from proxy.api.render import ChatTemplate, load_chat_template, render_chat
from proxy.api.responses import chat_request, parse_responses_request

TEMPLATES = Path(__file__).resolve().parents[2] / "vendor" / "templates"
FILES = {"gemma3": "gemma3.jinja", "qwen-guard": "chatml-system-first.jinja",
         "chatml": "chatml-tools-think.jinja", "llama3": "llama3.jinja"}
# a template that collects every system message into the first turn, and one that drops
# them: both get the inner ones folded
MOVES = ("{% for m in messages if m.role == 'system' %}{{ m.content }}{% endfor %}"
         "{% for m in messages if m.role != 'system' %}|{{ m.role }}:{{ m.content }}"
         "{% endfor %}")
DROPS = "{% for m in messages if m.role != 'system' %}|{{ m.role }}:{{ m.content }}{% endfor %}"


def _template(name: str, mode: str = "auto") -> ChatTemplate:
    return ChatTemplate((TEMPLATES / FILES[name]).read_text(), bos_token="<s>", origin=name,
                        inner_system=mode)


@pytest.mark.parametrize(("name", "found"), [
    ("gemma3", InnerSystem.REFUSED), ("qwen-guard", InnerSystem.REFUSED),
    ("chatml", InnerSystem.IN_PLACE), ("llama3", InnerSystem.IN_PLACE)])
def test_probe_learns_what_each_template_does(name: str, found: InnerSystem) -> None:
    t = _template(name)
    assert t.inner is found
    assert t.fold_inner is (found is not InnerSystem.IN_PLACE)


def test_probe_tells_moved_and_dropped_apart() -> None:
    assert ChatTemplate(MOVES).inner is InnerSystem.MOVED
    assert ChatTemplate(DROPS).inner is InnerSystem.DROPPED
    assert ChatTemplate(MOVES).fold_inner and ChatTemplate(DROPS).fold_inner


def test_the_switch() -> None:
    assert not _template("gemma3", "keep").fold_inner
    assert _template("chatml", "fold").fold_inner
    with pytest.raises(ValueError, match="inner_system"):
        _template("chatml", "sometimes")
    assert probe_inner_system(lambda ms: "".join(m["content"] for m in ms)) is \
        InnerSystem.IN_PLACE


def _m(role: str, content: str) -> ChatMessage:
    return ChatMessage(role=role, content=content)


def _marked(text: str) -> str:
    return f"{OPEN}{text}\n</system>"


def test_fold_rule() -> None:
    # a leading run of system messages joins the first one
    assert fold_inner_system([_m("system", "A"), _m("system", "B"), _m("user", "u")]) == (
        _m("system", "A\n\nB"), _m("user", "u"))
    # after a user message: appended to it
    assert fold_inner_system([_m("system", "S"), _m("user", "u"), _m("system", "E")]) == (
        _m("system", "S"), _m("user", "u\n\n" + _marked("E")))
    # after a reply: put before the next user message
    assert fold_inner_system([_m("user", "u"), _m("assistant", "a"), _m("developer", "x"),
                              _m("system", "D"), _m("user", "v")])[2:] == (
        _m("developer", "x"), _m("user", _marked("D") + "\n\nv"))
    # after a reply, nothing after it: a user message of its own
    assert fold_inner_system([_m("user", "u"), _m("assistant", "a"), _m("system", "D")])[2:] \
        == (_m("user", _marked("D")),)
    # between a tool result and a reply: its own user message before the reply
    assert fold_inner_system([_m("user", "u"), _m("tool", "r"), _m("system", "D"),
                              _m("assistant", "a")])[2:] == (
        _m("user", _marked("D")), _m("assistant", "a"))
    messages = (_m("system", "S"), _m("user", "u"))
    assert fold_inner_system(messages) == messages


# Turn by turn, as Claude Code and Codex send them: each request is the one before, its
# reply and new messages; system messages inside the conversation in every position.
TURNS: list[list[dict[str, Any]]] = [
    [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "Fix it."},
     {"role": "system", "content": "Environment: linux, /repo."}],
    [{"role": "assistant", "content": "Reading the file."},
     {"role": "developer", "content": "Approval: never."}],
    [{"role": "assistant", "content": "Done reading."},
     {"role": "system", "content": "Reminder: be brief."},
     {"role": "user", "content": "Go on."}],
]


@pytest.mark.parametrize("name", list(FILES))
def test_turn_after_turn_the_prompt_before_grows_only(name: str) -> None:
    """Each turn's prompt is the last one's with the reply after it: the tokens before
    a system message never change from one turn to the next, so the cache keeps working;
    each system text reaches the prompt where the client put it."""
    t = _template(name)
    sent: list[dict[str, Any]] = []
    prompts: list[str] = []
    for turn in TURNS:
        new = [dict(m) for m in turn]
        if prompts:
            reply = new[0]["content"]
            if prompts[-1].endswith("<think>\n"):  # a thinking template: the reply reasons
                new[0] = {"role": "assistant", "content": "", "reasoning_content": reply}
            assert render_chat(t, parse_chat_request({"messages": sent + new[:1]}),
                               add_generation_prompt=False).startswith(prompts[-1] + reply)
        sent += new
        prompts.append(render_chat(t, parse_chat_request({"messages": sent})))
    last = prompts[-1]
    order = ["You are an agent.", "Fix it.", "Environment: linux, /repo.", "Reading the file.",
             "Approval: never.", "Done reading.", "Reminder: be brief.", "Go on."]
    at = [last.index(text) for text in order]
    assert at == sorted(at), (name, last)


@pytest.mark.parametrize("name", list(FILES))
def test_every_api_renders_them(name: str) -> None:
    """Anthropic system blocks and inner system messages, Responses developer items and chat
    developer messages give the same prompt."""
    t = _template(name)
    chat = parse_chat_request({"messages": [
        {"role": "system", "content": "You are an agent."},
        {"role": "developer", "content": "Approval: never."},
        {"role": "user", "content": "Fix it."},
        {"role": "developer", "content": "Environment: linux."}]})
    anthropic = parse_messages_request({
        "max_tokens": 4, "system": [{"type": "text", "text": "You are an agent."}],
        "messages": [{"role": "system", "content": "Approval: never."},
                     {"role": "user", "content": [{"type": "text", "text": "Fix it."}]},
                     {"role": "system", "content": "Environment: linux."}]})
    responses = chat_request(parse_responses_request({
        "instructions": "You are an agent.",
        "input": [{"type": "message", "role": "developer",
                   "content": [{"type": "input_text", "text": "Approval: never."}]},
                  {"role": "user", "content": "Fix it."},
                  {"role": "developer", "content": "Environment: linux."}]}), ())
    texts = {render_chat(t, r) for r in (chat, anthropic, responses)}
    assert len(texts) == 1
    text = texts.pop()
    assert text.index("Approval") < text.index("Fix it.") < text.index("Environment")


def test_gemma_fallback_folds_by_default() -> None:
    t = load_chat_template(None, bos_token="<bos>", eos_token="<eos>")
    req = parse_chat_request({"messages": [{"role": "user", "content": "hi"},
                                           {"role": "system", "content": "env"}]})
    assert render_chat(t, req) == ("<bos><start_of_turn>user\nhi\n\n<system>\nenv\n</system>"
                                   "<end_of_turn>\n<start_of_turn>model\n")


def test_runs_of_one_role_are_merged_where_the_template_refuses_them() -> None:
    assert _template("gemma3").merge_runs  # "Conversation roles must alternate"
    assert not _template("chatml").merge_runs and not _template("llama3").merge_runs
    # Codex: its environment and its prompt are two user messages in a row
    codex = parse_chat_request({"messages": [
        {"role": "developer", "content": "You are Codex."},
        {"role": "developer", "content": "Approval: never."},
        {"role": "user", "content": "<environment_context/>"},
        {"role": "user", "content": "Fix it."}]})
    assert render_chat(_template("gemma3"), codex) == (
        "<s><start_of_turn>user\nYou are Codex.\n\nApproval: never.\n\n"
        "<environment_context/>\n\nFix it.<end_of_turn>\n<start_of_turn>model\n")
    # Claude Code resuming a session whose replies were cut by max_tokens
    claude = parse_messages_request({"max_tokens": 4, "messages": [
        {"role": "user", "content": "Write it."},
        {"role": "assistant", "content": [{"type": "text", "text": "def f("}]},
        {"role": "assistant", "content": [{"type": "text", "text": "x):"}]},
        {"role": "user", "content": "Go on."}]})
    assert "<start_of_turn>model\ndef f(x):<end_of_turn>" in render_chat(_template("gemma3"),
                                                                         claude)
