"""What the prompt memo takes from earlier prompts is what a prompt computed from scratch
has: the history without a second render where the template's generation prompt is an
ending, the first turn's marks placed once, a later breakpoint found where its message
stands; and where a template does not behave so, it renders as before."""

from __future__ import annotations

import re
from typing import Any

from proxy.api.anthropic import parse_messages_request
from proxy.api.chat import ChatRequest
from proxy.api.hints import marks_to_place, place
from proxy.api.literals import Literals
from proxy.api.openai import parse_chat_request
from proxy.api.prompt_memo import PromptMemo
from proxy.api.render import ChatTemplate, render_chat
from proxy.engine.binding.vocab import alternation

SPECIAL_RE = re.compile(alternation(["<|im_start|>", "<|im_end|>"]))
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# a template that writes its last user message otherwise when it adds the generation
# prompt: the prompt is then not its history and an ending
ODD = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
       "{% if loop.last and add_generation_prompt %} (answer now){% endif %}<|im_end|>\n"
       "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _chat(*turns: str) -> ChatRequest:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Be brief."}]
    for i, t in enumerate(turns):
        messages.append({"role": "user" if i % 2 == 0 else "assistant", "content": t})
    return parse_chat_request({"messages": messages})


def _history(memo: PromptMemo, tpl: ChatTemplate, req: ChatRequest) -> tuple[str, int]:
    renders = []

    def render_history() -> str:
        renders.append(1)
        return render_chat(tpl, req, add_generation_prompt=False)

    text = render_chat(tpl, req)
    return memo.history(req, text, render_history, "{}"), len(renders)


def test_the_history_is_the_prompt_less_its_ending_once_learned() -> None:
    memo, tpl = PromptMemo(), ChatTemplate(CHATML)
    first, second = _chat("Hi."), _chat("Hi.", "Hello.", "And now?")
    assert _history(memo, tpl, first) == (render_chat(tpl, first, add_generation_prompt=False),
                                          1)
    assert _history(memo, tpl, second) == (
        render_chat(tpl, second, add_generation_prompt=False), 0)  # no second render


def test_a_template_whose_prompt_is_not_history_and_ending_renders_twice() -> None:
    memo, tpl = PromptMemo(), ChatTemplate(ODD)
    for req in (_chat("Hi."), _chat("Hi.", "Hello.", "And now?")):
        assert _history(memo, tpl, req) == (
            render_chat(tpl, req, add_generation_prompt=False), 1)


def _claude(prompt: str, *more: dict[str, Any], last_text: str | None = None) -> ChatRequest:
    """Claude Code's shape: a system block with a breakpoint, a first user message of
    two parts, and a breakpoint on the last block of the last message (after ``more``:
    ``last_text``, by default the prompt again)."""
    last = {"type": "text", "text": prompt if last_text is None else last_text,
            "cache_control": {"type": "ephemeral"}}
    messages: list[dict[str, Any]] = [{"role": "user", "content": [
        {"type": "text", "text": "<system-reminder>context</system-reminder>"},
        {"type": "text", "text": prompt}]}, *more]
    if more:
        messages.append({"role": "user", "content": [last]})
    else:
        messages[0]["content"][1] = last
    return parse_messages_request({
        "model": "m", "max_tokens": 8, "messages": messages,
        "system": [{"type": "text", "text": "You are an agent.",
                    "cache_control": {"type": "ephemeral"}}]})


def _points(memo: PromptMemo | None, tpl: ChatTemplate, req: ChatRequest
            ) -> tuple[list[tuple[Any, int]], int]:
    table = Literals(SPECIAL_RE)
    renders = []

    def render(r: ChatRequest) -> str:
        renders.append(1)
        return render_chat(tpl, r, escape=table.escape)

    text = render_chat(tpl, req, escape=table.escape)
    marks = marks_to_place(req)
    if memo is None:
        return sorted(place(render, req, text, marks), key=lambda p: p[1]), len(renders)
    # token positions: here one "token" a character, to compare with the characters
    got = memo.points(render, req, text, marks, table.escape, SPECIAL_RE,
                      lambda chars, anchor=(0, 0): list(chars))
    return sorted(got, key=lambda p: p[1]), len(renders)


def test_the_first_turn_is_placed_once_and_a_late_breakpoint_where_it_stands() -> None:
    memo, tpl = PromptMemo(), ChatTemplate(CHATML)
    turn1 = _claude("Fix the bug.")
    more = [{"role": "assistant", "content": "Done."},
            {"role": "user", "content": "Thanks. Now the tests."},
            {"role": "assistant", "content": "Done too."}]
    turn2 = _claude("Fix the bug.", *more[:2])
    turn3 = _claude("Fix the bug.", *more)
    other = _claude("Write docs.")
    # turn 2 moves the breakpoint off the first turn, so its marks there are new; turn 3
    # has turn 2's and renders nothing; another task renders its own first turn
    for req, renders in ((turn1, 1), (turn2, 1), (turn3, 0), (other, 1)):
        want, _ = _points(None, tpl, req)
        got, n = _points(memo, tpl, req)
        assert got == want
        assert n == renders


def test_a_breakpoint_on_a_message_sent_again_is_placed_without_a_render() -> None:
    # Claude Code sends the same note each time a reply hit its output limit, so the
    # last message's text stands in the prompt more than once: it is found after the
    # messages before it, where the sentinel render puts it
    memo, tpl = PromptMemo(), ChatTemplate(CHATML)
    note = "Output token limit hit. Resume directly."
    more = [{"role": "assistant", "content": "Part one."},
            {"role": "user", "content": note},
            {"role": "assistant", "content": "Part two."}]
    _points(memo, tpl, _claude("Fix the bug.", *more[:2]))  # the first turn, learned
    # the last message (the breakpoint's) is the note, which stands before it once, then
    # twice and once in a reply
    for req in (_claude("Fix the bug.", *more, last_text=note),
                _claude("Fix the bug.", *more, {"role": "user", "content": note},
                        {"role": "assistant", "content": note + " Done."},
                        last_text=note)):
        want, _ = _points(None, tpl, req)
        got, n = _points(memo, tpl, req)
        assert got == want
        assert n == 0, "placed by a render"


def test_a_breakpoint_whose_text_stands_after_it_is_placed_by_a_render() -> None:
    # the last message's text stands again after its place, inside the template's
    # own ending: no search can tell which is the message, so the render decides
    tpl_text = CHATML.replace("<|im_start|>assistant\n{% endif %}",
                              "<|im_start|>assistant\nGo on.{% endif %}")
    memo, tpl = PromptMemo(), ChatTemplate(tpl_text)
    _points(memo, tpl, _claude("Fix the bug."))
    req = _claude("Fix the bug.", {"role": "assistant", "content": "Go on."},
                  {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                  last_text="Go on.")
    req2 = _claude("Go on.", {"role": "assistant", "content": "Go on."})
    for r in (req, req2):
        want, _ = _points(None, tpl, r)
        got, _ = _points(memo, tpl, r)
        assert got == want
