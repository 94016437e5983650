"""Functionary v3.2's replies: messages, each a recipient on a line of its own and a body,
one after another, each after ``>>>`` (the generation prompt writes the first one's).

    all
    Some text for the user.>>>read_file
    {"path": "a.py"}>>>python
    print(1)

The body of ``all`` is content; any other recipient is a call whose arguments are the
body's JSON (``python``'s body is code: ``{"code": ...}``, as llama.cpp reads it). A
call goes out whole at the next ``>>>`` after its JSON, or at the reply's end; a body
that does not read stays content, with a warning; one the token limit cut is dropped.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable

from proxy.api.syntax.calls import Delta, ParsedToolCall, Syntax, Tools, new_call_id
from proxy.api.syntax.stream import partial_len

log = logging.getLogger(__name__)

SEP = ">>>"
_RECIPIENT = re.compile(r"[\w.\-]{1,128}")


class RecipientParser:
    def __init__(self, syntax: Syntax, *, starts_in_reasoning: bool = False,
                 parse_tools: bool = True, tools: Tools | None = None,
                 make_id: Callable[[], str] = new_call_id, quiet: bool = False) -> None:
        self.syntax = syntax
        self._parse_tools = parse_tools
        self._make_id = make_id
        self._quiet = quiet
        self._buf = ""
        self._mode = "head"  # head | content | call
        self._name = ""
        self._lead = True
        self._held = ""
        self._tried = 0  # where in a call's body the next separator is looked for

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
        if self._mode == "call":
            self._call(out, rest, cut)
        elif rest:
            self._content(out, rest)
        self._held = ""
        return out

    def _content(self, out: Delta, text: str, final: bool = True) -> None:
        if self._lead:
            text = text.lstrip()
            if not text:
                return
            self._lead = False
        text = self._held + text
        body = text.rstrip()
        self._held = "" if final else text[len(body):]
        out.content += body

    def _call(self, out: Delta, body: str, cut: bool) -> None:
        if cut:
            return  # a call the model never finished is never returned
        try:
            args = json.loads(body) if body.strip() else {}
        except ValueError:
            args = {"code": body} if self._name == "python" else None
        if isinstance(args, dict):
            out.tool_calls.append(ParsedToolCall(self._make_id(), self._name,
                                                 json.dumps(args, ensure_ascii=False)))
            return
        if not self._quiet:
            log.warning("a %s call to %r did not parse; returned as content",
                        self.syntax.name, self._name)
        self._content(out, f"{SEP}{self._name}\n{body}")

    def _step(self, out: Delta, final: bool) -> bool:
        buf = self._buf
        if self._mode == "head":
            nl = buf.find("\n")
            if nl < 0:
                if final or (buf and not _RECIPIENT.fullmatch(buf)):
                    self._mode = "content"  # no recipient line: text as it is
                    return not final
                return False
            name = buf[:nl].strip()
            if name == "all" or not self._parse_tools or not _RECIPIENT.fullmatch(name):
                self._mode = "content"
                self._buf = buf[nl + 1:] if name == "all" else buf
            else:
                self._mode, self._name, self._buf = "call", name, buf[nl + 1:]
            return True
        if self._mode == "call":
            while True:  # the first separator after which the body reads as JSON
                at = buf.find(SEP, self._tried)
                if at < 0:
                    return False
                body = buf[:at]
                if self._name == "python" or not body.strip() or _is_json(body):
                    self._call(out, body, cut=False)
                    self._buf, self._mode, self._tried = buf[at + len(SEP):], "head", 0
                    return True
                self._tried = at + 1
        at = buf.find(SEP)
        if at >= 0:
            self._content(out, buf[:at], final=False)
            self._buf, self._mode = buf[at + len(SEP):], "head"
            return True
        if final:
            return False
        hold = partial_len(buf, (SEP,))
        self._buf = buf[len(buf) - hold:]
        self._content(out, buf[:len(buf) - hold], final=False)
        return False


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


FUNCTIONARY_V32 = Syntax("functionary-v3.2", (), (), parser=RecipientParser,
                         models="Functionary v3.2")
