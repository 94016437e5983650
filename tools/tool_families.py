"""The table of tool-call families over the vendored templates (docs/tool-calls.md).

    python -m tools.tool_families

One row per family (templates grouped by the syntax their probe finds): how many
templates, whether their calls are read back (parse), whether a forced call has a
grammar in their form (constrained), and how much of turn N the next turn reuses after
a call: turn N's prompt plus the reply the model wrote (the template's own rendering of
an assistant turn with reasoning and a call), against turn N+1 (the same conversation
with that call and its result). ``prompt`` when all of turn N's prompt is a prefix of
turn N+1's, ``prompt+reply`` when the reply is too; otherwise the first text that
differs. Streaming is the same parser (canitoolcall checks it per family:
python -m tools.toolcall_conformance).
"""

from __future__ import annotations

import collections
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from proxy.api.render import ChatTemplate
from proxy.api.reply import parse_reply, starts_in_reasoning
from proxy.api.syntax.probe import PROBE_TOOLS, probe_reply

TEMPLATES = Path(__file__).resolve().parents[1] / "vendor" / "templates" / "llama.cpp"
CALL = (("zqcA1b2C3", {"path": "zqp1.py", "limit": 5}),)


def reuse(t: ChatTemplate) -> str:
    """What turn N+1 keeps of turn N's prompt and reply."""
    head = [{"role": "system", "content": "zqsys"}, {"role": "user", "content": "zquser"}]
    prompt = t.render(head, tools=PROBE_TOOLS)
    reply = probe_reply(t.render, CALL, (t.eos_token,)) or ""
    if not reply and t.call_form is not None:  # a template that renders no past calls
        reply = t.call_form.write("read_file", CALL[0][1])
    # the client sends back what it got: the reply as the server parsed it
    got = parse_reply(reply, syntax=t.syntax, tools=PROBE_TOOLS,
                      starts_in_reasoning=starts_in_reasoning(prompt, t.syntax))
    sent = {"role": "assistant", "content": got.content, "tool_calls": [
        {"id": "zqcA1b2C3", "type": "function",
         "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
        for c in got.tool_calls]}
    if got.reasoning:
        sent["reasoning_content"] = got.reasoning
    turn = [*head, sent, {"role": "tool", "tool_call_id": "zqcA1b2C3",
                          "content": "zqresult"}]
    try:
        nxt = t.render(turn, tools=PROBE_TOOLS)
    except ValueError as e:
        return f"turn N+1 refused: {e}"
    old = prompt + reply
    at = 0
    while at < min(len(old), len(nxt)) and old[at] == nxt[at]:
        at += 1
    if at >= len(old):
        return "prompt+reply"
    where = f"{old[at:at + 24]!r} -> {nxt[at:at + 24]!r}"
    if at >= len(prompt):
        return f"prompt, {100 * (at - len(prompt)) // max(len(reply), 1)}% of reply ({where})"
    bare = t.render(head, tools=PROBE_TOOLS, add_generation_prompt=False)
    if prompt.startswith(bare) and at >= len(bare) - len(t.trailer):
        part = "the generation prompt" if at >= len(bare) else "the turn it writes last"
        return f"prompt to {part} ({where})"
    return f"{100 * at // len(prompt)}% of prompt ({where})"


def lost_chars(t: ChatTemplate) -> int:
    """Characters at the end of turn N's prompt that turn N+1 renders otherwise: the
    generation prompt, and what the template writes after the last message (a bound on
    what a checkpoint before them leaves to prefill again, as text)."""
    head = [{"role": "system", "content": "zqsys"}, {"role": "user", "content": "zquser"}]
    prompt = t.render(head, tools=PROBE_TOOLS)
    bare = t.render(head, tools=PROBE_TOOLS, add_generation_prompt=False)
    gen = len(prompt) - len(bare) if prompt.startswith(bare) else len(prompt)
    return gen + len(t.trailer)


def rows() -> list[tuple[str, list[str], str, str, list[str]]]:
    groups: dict[str, list[tuple[str, ChatTemplate]]] = collections.defaultdict(list)
    for f in sorted(TEMPLATES.glob("*.jinja")):
        t = ChatTemplate(f.read_text(encoding="utf-8"), bos_token="<s>", eos_token="</s>",
                         origin=f.name)
        groups[t.syntax.name].append((f.stem, t))
    out = []
    for name, items in sorted(groups.items(), key=lambda kv: (kv[0] == "none", kv[0])):
        forms = sum(1 for _, t in items if t.call_form is not None)
        parse = "yes" if name != "none" else "no (renders no calls we read)"
        forced = f"{forms}/{len(items)}" if name != "none" else "-"
        reuses = [reuse(t) for _, t in items] if name != "none" else []
        out.append((name, [n for n, _ in items], parse, forced, reuses))
    return out


def _kind(r: str) -> str:
    if r == "prompt+reply":
        return r
    if r.startswith("prompt to"):
        return r.split(" (")[0]
    return "prompt" if r.startswith("prompt") else "part of prompt"


def main(argv: Sequence[str] | None = None) -> int:
    print("| family | templates | parse + stream | constrained (form) | reuse after a call |")
    print("|---|---|---|---|---|")
    for name, names, parse, forced, reuses in rows():
        counts: dict[str, int] = collections.Counter(_kind(r) for r in reuses)
        summary = ", ".join(f"{k} {v}" for k, v in counts.items()) or "-"
        print(f"| {name} | {len(names)}: {', '.join(names)} | {parse} | {forced} | "
              f"{summary} |")
    print()
    for name, names, _, _, reuses in rows():
        for n, r in zip(names, reuses, strict=False):
            if r != "prompt+reply":
                print(f"- {name} / {n}: {r}")
    return 0


if __name__ == "__main__":
    args: Any = sys.argv[1:]
    sys.exit(main(args))
