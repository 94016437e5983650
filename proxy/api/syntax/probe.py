"""Which syntax a chat template writes, learned by rendering it (as proxy/api/inner.py
learns what it does with system messages).

The template renders a probe conversation whose last assistant message carries
reasoning and known tool calls (two, else one: Llama 3.1's template refuses two). The
text after the generation prompt is what the model would have written; each family's
parser reads it in turn, and the first that gets the probe's calls back exactly (names,
and arguments typed by the probe tool's schema) is the template's syntax. A template
that renders no calls gets the family whose marks it writes around the tools it offers
(LFM2's ``<|tool_list_start|>``), else ``none`` (reasoning only), unless
``model.tool_format`` names one.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from proxy.api.syntax.calls import Syntax
from proxy.api.syntax.families import BLOCK_SYNTAXES, PLAIN
from proxy.api.syntax.harmony import HARMONY
from proxy.api.syntax.recipients import FUNCTIONARY_V32
from proxy.api.syntax.stream import parse

log = logging.getLogger(__name__)

ALL: tuple[Syntax, ...] = (*BLOCK_SYNTAXES, HARMONY, FUNCTIONARY_V32)
BY_NAME: Mapping[str, Syntax] = {s.name: s for s in (*ALL, PLAIN)}
TOOL_FORMATS = ("auto", *BY_NAME)

PROBE_TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file",
    "parameters": {"type": "object", "properties": {
        "path": {"type": "string", "description": "the file"},
        "limit": {"type": "integer", "description": "lines at most"}},
        "required": ["path"]}}}]
_CALLS = (("zqcA1b2C3", {"path": "zqp1.py", "limit": 5}), ("zqcZ9y8X7", {"path": "zqp2.py"}))

Render = Callable[..., str]  # ChatTemplate.render
# Where a model's turn ends: generation stops at these tokens, so they are never part of
# a reply; a rendered turn is cut at the first (with the template's own eos_token).
END_MARKERS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "</s>", "<end_of_turn>",
               "<|endoftext|>", "<｜end▁of▁sentence｜>", "<|END_OF_TURN_TOKEN|>", "[e~[",
               "<turn|>", "<|end_of_text|>", "<seed:eos>", "<|call|>", "<|return|>",
               "<|role_end|>", "</assistant>", "<SPECIAL_12>",
               "<|eot|>", "<end_of_sentence>", "<｜hy_eos:opensource｜>",
               "<|end_of_msg|>", "<|tool_response>", "<sep>")


def _assistant(calls: Sequence[tuple[str, dict[str, Any]]],
               reasoning: str | None = "zqreason") -> dict[str, Any]:
    return {"role": "assistant", "content": "", "reasoning_content": reasoning,
            "tool_calls": [{"id": cid, "type": "function",
                            "function": {"name": "read_file", "arguments": args},
                            "arguments": args} for cid, args in calls]}


def _common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _after_prompt(prompt: str, text: str, at: int) -> int:
    """Where the reply starts in a turn that parts from the generation prompt at ``at``.
    A prompt that closes reasoning empty (thinking off: ``<think></think>``) is followed
    by what the turn writes after its own closer (the reasoning of past turns is not the
    model's to write now); else the turn parts from it inside a tag at most (an opened
    ``<think>`` written otherwise), so back to the last tag's or line's end."""
    start = at
    if prompt.rfind("<", 0, at) > prompt.rfind(">", 0, at):  # parted inside a tag
        start = prompt.rfind("<", 0, at)
    rest = prompt[start:]
    for k in range(len(rest)):
        closer = rest[k:]
        tag = closer.strip()
        if len(tag) >= 3 and tag[0] in "<[" and tag[-1] in ">]":  # whole tags only
            found = text.find(closer, start)
            if found >= 0:
                return found + len(closer)
    return max(text.rfind(">", 0, at), text.rfind("\n", 0, at), text.rfind("]", 0, at)) + 1


def probe_reply(render: Render, calls: Sequence[tuple[str, dict[str, Any]]],
                stops: Sequence[str] = (), reasoning: str | None = "zqreason") -> str | None:
    """The text the template renders for an assistant turn of ``calls``, from where its
    generation prompt ends (None: the template refuses the conversation)."""
    head = [{"role": "system", "content": "zqsys"}, {"role": "user", "content": "zquser"}]
    try:
        prompt = render(head, tools=PROBE_TOOLS)
        bare = render(head, tools=PROBE_TOOLS, add_generation_prompt=False)
        text = render([*head, _assistant(calls, reasoning)], tools=PROBE_TOOLS,
                      add_generation_prompt=False)
    except ValueError:
        return None
    # the turn starts where the text leaves the conversation before it; where it starts
    # with the generation prompt itself, the reply follows that
    gen = prompt[len(bare):] if prompt.startswith(bare) else ""
    split = _common(text, bare)
    at = text.rfind(gen, 0, split + len(gen)) if gen.strip() else -1
    if at >= 0 and at + len(gen) > split:
        at += len(gen)
    else:
        at = _common(prompt, text)
        if at < len(prompt):
            at = _after_prompt(prompt, text, at)
    reply = text[at:]
    # text the template writes after the last message (Command R+'s closing system
    # turn) is not the model's
    trailer = bare[bare.rfind("zquser") + len("zquser"):]
    for marker in END_MARKERS:
        trailer = trailer.removeprefix(marker)
    if len(trailer.strip()) >= 16 and trailer in reply:
        reply = reply[:reply.find(trailer)]
    ends = [i for i in (reply.find(m) for m in (*stops, *END_MARKERS) if m) if i >= 0]
    return reply[:min(ends)] if ends else reply


def probe_syntax(render: Render, stops: Sequence[str] = ()) -> Syntax:
    """The syntax the template writes its tool calls in (``PLAIN`` if none reads them);
    ``stops``: the model's end-of-turn texts (its eos_token)."""
    for calls in (_CALLS, _CALLS[:1]):
        reply = probe_reply(render, calls, stops)
        if reply is None:
            continue
        want = [("read_file", args) for _, args in calls]
        for syntax in ALL:
            got = parse(syntax, reply, tools=PROBE_TOOLS, quiet=True).tool_calls
            if [(c.name, json.loads(c.arguments)) for c in got] == want:
                return syntax
    try:
        offered = render([{"role": "user", "content": "zquser"}], tools=PROBE_TOOLS)
    except ValueError:
        return PLAIN
    return next((s for s in ALL if any(h in offered for h in s.hints)), PLAIN)


def syntax_for(render: Render, tool_format: str = "auto", stops: Sequence[str] = ()
               ) -> Syntax:
    """``model.tool_format``: "auto" probes the template, a family's name overrides."""
    if tool_format == "auto":
        return probe_syntax(render, stops)
    if tool_format not in BY_NAME:
        raise ValueError(f"model.tool_format must be one of {', '.join(TOOL_FORMATS)}, "
                         f"got {tool_format!r}")
    return BY_NAME[tool_format]


def grammar_reasoning(source: str, syntax: Syntax) -> tuple[str, str] | None:
    """The reasoning a grammar lets the model write before what it forces: none where
    the template never writes the family's reasoning opener (Gemma 3's fallback writes
    Hermes calls and no reasoning, as Qwen2.5's does). A model trained on such a template
    does not reason in those tags, and a grammar that let it would let a base model write
    "<think>" as text and ramble inside it to the token limit."""
    tags = syntax.grammar_reasoning
    if tags is None or syntax.lazy is not None:
        return tags
    return tags if any(o.strip() in source for o, _ in syntax.reasoning) else None
