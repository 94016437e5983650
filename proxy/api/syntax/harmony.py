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

MESSAGE = "<|message|>"
# what ends a message's body: <|call|> and <|return|> are stop tokens, so generation ends
# at the real one; written elsewhere (followed by more than a new message) they are text
ENDS, STOPS = ("<|end|>", "<|start|>"), ("<|call|>", "<|return|>")
# a call's JSON also ends where a new header begins without its <|start|> (kept for it)
CALL_ENDS = (*ENDS, *STOPS, "<|channel|>")
OPENS = ("<|start|>", "<|channel|>")
HEADS = ("<|channel|>", "<|start|>", "<|constrain|>", "to=", "assistant")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*(\w+)")


def _looks_like_head(text: str) -> bool:
    """Whether ``text`` may still become a message header (wait for more)."""
    s = text.lstrip()
    return any(s.startswith(h) or h.startswith(s) for h in HEADS)


def _is_head(text: str) -> bool:
    """Whether ``text`` is the start of a header (a reply that ends in it has no text)."""
    return text.lstrip().startswith(HEADS[:4])  # its markers, not a word


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
        self._kind = ""  # reasoning | content | call | builtin
        self._name = ""
        self._lead = {"reasoning": True, "content": True}
        self._held = {"reasoning": "", "content": ""}
        self._scan = (0, False, False)  # a call body's JSON read so far: (at, in string, escape)

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
        elif self._mode == "body" and self._kind != "builtin":
            self._emit(out, self._kind, rest, final=True)
        elif self._mode != "body" and rest.strip() and not (
                self._mode == "header" and _is_head(rest)):
            # (a header the reply ended in, before its message began, is no text)
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
        elif not cut:
            if not self._quiet:
                log.warning("a Harmony call to %r did not parse; returned as content",
                            self._name)
            self._emit(out, "content", body, final=True)

    def _head(self, head: str) -> None:
        channel = _CHANNEL.search(head)
        recipient = _RECIPIENT.search(head)
        to = recipient.group(1) if recipient is not None else ""
        if to.startswith("functions.") and self._parse_tools:
            self._kind, self._name = "call", to[len("functions."):]
        elif to and not to.startswith(("functions.", "assistant")):
            self._kind = "builtin"  # a built-in tool (python, browser): no function call
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = "reasoning"
        else:
            self._kind = "content"
        self._scan = (0, False, False)

    def _step(self, out: Delta, final: bool) -> bool:
        buf = self._buf
        if self._mode == "plain":
            self._buf = ""
            self._emit(out, "content", buf, final=False)
            return False
        if self._mode == "header":
            at = buf.find(MESSAGE)
            if at < 0:
                if final or _looks_like_head(buf):
                    return False  # (finish decides what a header never finished is)
                self._mode = "plain"
                return True
            self._head(buf[:at])
            self._buf, self._mode = buf[at + len(MESSAGE):], "body"
            return True
        end = self._call_end(buf, final) if self._kind == "call" else \
            self._text_end(buf, final)
        if end is not None:
            at, marker = end
            body, self._buf = buf[:at], buf[at + (0 if marker in OPENS else len(marker)):]
            if self._kind == "call":
                self._call(out, body, cut=False)
            elif self._kind != "builtin":
                self._emit(out, self._kind, body, final=False)
            self._mode = "header"
            return True
        if self._kind in ("call", "builtin") or final:
            return False
        hold = partial_len(buf, ENDS + STOPS)
        for stop in STOPS:  # a stop marker waits to see what follows it
            if buf.endswith(stop):
                hold = max(hold, len(stop))
        self._buf = buf[len(buf) - hold:] if hold else ""
        self._emit(out, self._kind, buf[:len(buf) - hold], final=False)
        return False

    def _text_end(self, buf: str, final: bool) -> tuple[int, str] | None:
        """Where a message of text ends: <|end|>, <|start|>, or a stop marker that nothing
        but a new message follows."""
        found = [(buf.find(e), e) for e in ENDS if e in buf]
        for stop in STOPS:
            at = buf.find(stop)
            while at >= 0:
                after = buf[at + len(stop):]
                if (final and not after.strip()) or after.startswith("<|start|>"):
                    found.append((at, stop))
                    break
                at = buf.find(stop, at + 1)
        return min(found) if found else None

    def _call_end(self, buf: str, final: bool) -> tuple[int, str] | None:
        """Where a call's JSON body ends: the first marker outside a JSON string (read on
        from where the last delta stopped)."""
        i, in_str, esc = self._scan
        n = len(buf)
        while i < n:
            c = buf[i]
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c == "<":
                for e in CALL_ENDS:
                    if buf.startswith(e, i):
                        self._scan = (i, in_str, esc)
                        return i, e
                if not final and any(e.startswith(buf[i:]) for e in CALL_ENDS):
                    break  # a marker may be arriving: wait for the next delta
            i += 1
        self._scan = (i, in_str, esc)
        return None


HARMONY = Syntax("harmony", (), (), parser=HarmonyParser, models="gpt-oss",
                 lazy=("<|channel|>analysis<|message|>", "<|end|><|start|>assistant"))
