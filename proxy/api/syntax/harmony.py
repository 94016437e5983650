"""gpt-oss's Harmony format: a reply is messages, each a header then a body.

    <|channel|>analysis<|message|>reasoning...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.NAME json<|message|>{...}<|call|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

The recipient may also stand in the role part (``<|start|>assistant to=functions.NAME
<|channel|>commentary json<|message|>``, as the template renders a past call). Bodies
of the ``analysis`` channel are reasoning, of ``final`` (and ``commentary`` without a
recipient: a preamble) content; a body addressed ``to=functions.NAME`` is a call whose
arguments are the body's JSON. The stop tokens (``<|call|>``, ``<|return|>``) may be
cut off the reply. Written from the template and the Harmony spec (openai-harmony's
own parser needs its vocabulary file, which is fetched from the network at run time).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable

from proxy.api.syntax.calls import Delta, ParsedToolCall, Syntax, Tools, new_call_id
from proxy.api.syntax.stream import partial_len

log = logging.getLogger(__name__)

MESSAGE, ENDS = "<|message|>", ("<|end|>", "<|call|>", "<|return|>", "<|start|>")
_RECIPIENT = re.compile(r"to=(?:functions\.)?([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


class HarmonyParser:
    def __init__(self, syntax: Syntax, *, starts_in_reasoning: bool = False,
                 parse_tools: bool = True, tools: Tools | None = None,
                 make_id: Callable[[], str] = new_call_id, quiet: bool = False) -> None:
        self.syntax = syntax
        self._quiet = quiet
        self._parse_tools = parse_tools
        self._make_id = make_id
        self._buf = ""
        self._mode = "header"  # header | body | plain
        self._kind = ""  # reasoning | content | call
        self._name = ""
        self._lead = {"reasoning": True, "content": True}
        self._held = {"reasoning": "", "content": ""}

    def feed(self, text: str) -> Delta:
        self._buf += text
        out = Delta()
        while self._step(out, final=False):
            pass
        return out

    def finish(self, cut: bool = False) -> Delta:
        out = Delta()
        while self._step(out, final=True):
            pass
        rest, self._buf = self._buf, ""
        if self._mode == "body" and self._kind == "call":
            self._call(out, rest, cut)
        elif self._mode == "body":
            self._emit(out, self._kind, rest, final=True)
        elif rest.strip():
            self._emit(out, "content", rest, final=True)
        for kind in ("reasoning", "content"):
            self._held[kind] = ""
        return out

    def _emit(self, out: Delta, kind: str, text: str, final: bool) -> None:
        if self._lead[kind]:
            text = text.lstrip()
            if not text:
                return
            self._lead[kind] = False
        text = self._held[kind] + text
        body = text.rstrip()
        self._held[kind] = "" if final else text[len(body):]
        if kind == "reasoning":
            out.reasoning += body
        else:
            out.content += body

    def _call(self, out: Delta, body: str, cut: bool) -> None:
        args: object = None
        if not cut:
            try:
                args = json.loads(body) if body.strip() else {}
            except ValueError:
                args = None
        if isinstance(args, dict):
            out.tool_calls.append(ParsedToolCall(self._make_id(), self._name,
                                                 json.dumps(args, ensure_ascii=False)))
        else:
            if not cut and not self._quiet:
                log.warning("a Harmony call to %r did not parse; returned as content",
                            self._name)
            self._emit(out, "content", body, final=True)

    def _step(self, out: Delta, final: bool) -> bool:
        buf = self._buf
        if self._mode == "plain":
            self._buf = ""
            self._emit(out, "content", buf, final=False)
            return False
        if self._mode == "header":
            at = buf.find(MESSAGE)
            if at < 0:
                s = buf.lstrip()
                if not final and (not s or s.startswith(("<|", " to=", "to=", "assistant"))
                                  or "<|channel|>".startswith(s) or "<|start|>".startswith(s)):
                    return False
                self._mode = "plain"
                return True
            head, self._buf = buf[:at], buf[at + len(MESSAGE):]
            channel = _CHANNEL.search(head)
            recipient = _RECIPIENT.search(head)
            if recipient is not None and self._parse_tools and \
                    not recipient.group(1).startswith("assistant"):
                self._kind, self._name = "call", recipient.group(1)
            elif channel is not None and channel.group(1) == "analysis":
                self._kind = "reasoning"
            else:
                self._kind = "content"
            self._mode = "body"
            return True
        # body
        ends = [(buf.find(e), e) for e in ENDS if e in buf]
        if ends:
            at, end = min(ends)
            body, self._buf = buf[:at], buf[at + (0 if end == "<|start|>" else len(end)):]
            if self._kind == "call":
                self._call(out, body, cut=False)
            else:
                self._emit(out, self._kind, body, final=False)
            self._mode = "header"
            return True
        if self._kind == "call" or final:
            return False
        hold = partial_len(buf, ENDS)
        self._buf = buf[len(buf) - hold:] if hold else ""
        self._emit(out, self._kind, buf[:len(buf) - hold], final=False)
        return False


HARMONY = Syntax("harmony", (), (), parser=HarmonyParser, models="gpt-oss")
