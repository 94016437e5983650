"""How one call is written, learned from the template, for grammars that force calls.

The template renders an assistant turn with one call of a probe tool, with no argument,
with one argument of each JSON type, and with two (probe.py's renders). Where the
arguments show up as one JSON text, the call is ``prefix NAME middle ARGUMENTS suffix``
(Hermes, DeepSeek, Kimi, Mistral ...). Where they do not, each one-argument render less
the empty one is ``open KEY middle VALUE close`` for that value's type (Qwen's XML, GLM,
MiniMax, DSML's ``string="true"``, Kimi K3's ``type="number"``, Gemma 4's quotes around
text only, LFM2's pythonic ``key="text"``), and the two-argument render shows what
stands between two arguments (Gemma 4's and LFM2's commas). A type whose value the
template writes in a notation of its own (Gemma 4's bare-keyed objects) is written as
JSON in the form of text, which the family's parser reads by the tool's schema. The
prefix starts at the family's block opener (the reasoning a template renders before the
call is left to the reasoning rule). A form is kept only when the family's own parser
reads calls written in it back (``check_form``). Families whose calls the template does
not write as one call in a block have their form written here (``OWN_FORMS``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.api.syntax.calls import Syntax
from proxy.api.syntax.probe import PROBE_TOOLS, Render, probe_reply
from proxy.api.syntax.stream import parse
from proxy.api.syntax.values import type_of

NAME, KEY, VALUE = "read_file", "path", "zqp1.py"
_DECODER = json.JSONDecoder()
# a key and a value of each JSON type, rendered one at a time
SAMPLES: dict[str, tuple[str, Any]] = {
    "string": (KEY, VALUE), "integer": ("limit", 5), "number": ("zqnum", 2.5),
    "boolean": ("zqflag", True), "array": ("zqlist", [1, 2]), "object": ("zqobj", {"zqk": 1}),
    "null": ("zqnone", None)}


KEY_SLOT = "\x00key\x00"  # the parameter's name again (MiniMax M3's closing tag)


@dataclass(slots=True, frozen=True)
class ParamForm:
    open: str  # before the parameter's name
    middle: str  # between its name and its value
    close: str  # after its value
    json_value: bool = False  # the value as JSON even for text (pythonic's "...")

    def open_for(self, key: str) -> str:
        return self.open.replace(KEY_SLOT, key)

    def middle_for(self, key: str) -> str:
        return self.middle.replace(KEY_SLOT, key)

    def close_for(self, key: str) -> str:
        return self.close.replace(KEY_SLOT, key)


NAME_SLOT = "\x00name\x00"  # the name again, where a form writes it twice (ATEM)


@dataclass(slots=True, frozen=True)
class CallForm:
    prefix: str  # from the block's opener to the function's name
    middle: str  # between the name and the arguments (or the first parameter)
    suffix: str  # after the arguments (or the last parameter)
    json_args: bool  # arguments as one JSON text; else parameters one by one
    params: tuple[tuple[str, ParamForm], ...] = ()  # by JSON type; "string" always
    sep: str = ""  # between two parameters
    # another call may follow in the same reply (Harmony's ends at <|call|>, a stop token)
    repeats: bool = True

    def param(self, kind: str) -> ParamForm:
        """How a parameter of JSON type ``kind`` is written; a type without a form of its
        own is written as a bare value is (its value JSON), else as text."""
        forms = dict(self.params)
        for k in (kind, "integer", "number", "boolean", "string"):
            if k in forms:
                return forms[k]
        raise RuntimeError("a form of parameters has one for text")

    def head(self, name: str) -> str:
        """What comes before a call's arguments."""
        return self.prefix + name + self.middle.replace(NAME_SLOT, name)

    def write(self, name: str, args: Mapping[str, Any]) -> str:
        """One call as the template writes it (text verbatim, other values JSON)."""
        if self.json_args:
            return self.head(name) + json.dumps(dict(args)) + self.suffix
        parts = []
        for k, v in args.items():
            p = self.param(type_of(v))
            text = v if isinstance(v, str) and not p.json_value else json.dumps(v)
            parts.append(p.open_for(k) + k + p.middle_for(k) + text + p.close_for(k))
        return self.head(name) + self.sep.join(parts) + self.suffix


def _opener_at(syntax: Syntax, text: str) -> int:
    found = [i for i in (text.find(b.open) for b in syntax.blocks) if i >= 0]
    return min(found) if found else -1


def _diff(one: str, none: str) -> tuple[int, int]:
    """(start, end) of what ``one`` has that ``none`` has not."""
    lo = 0
    while lo < min(len(one), len(none)) and one[lo] == none[lo]:
        lo += 1
    hi = 0
    while hi < min(len(one), len(none)) - lo and one[-1 - hi] == none[-1 - hi]:
        hi += 1
    return lo, len(one) - hi


def _written(value: Any) -> tuple[str, ...]:
    """The ways a template may write ``value``."""
    if isinstance(value, str):
        return (value,)
    return (json.dumps(value), json.dumps(value, separators=(",", ":")), str(value))


def derive_form(render: Render, syntax: Syntax, stops: tuple[str, ...] = ()) -> CallForm | None:
    """The form of one call in ``syntax`` as the template renders it, or None."""
    own = OWN_FORMS.get(syntax.name)
    if own is not None:
        return own if check_form(own, syntax) else None
    form = _derived(render, syntax, stops)
    if form is None and syntax.name in FALLBACK_FORMS:
        form = FALLBACK_FORMS[syntax.name]
        return form if check_form(form, syntax) else None
    return form


def _derived(render: Render, syntax: Syntax, stops: tuple[str, ...]) -> CallForm | None:

    def reply(args: dict[str, Any]) -> str | None:
        return probe_reply(render, (("zqcA1b2C3", args),), stops, reasoning=None)

    one, none = reply({KEY: VALUE}), reply({})
    if one is None or none is None:
        return None
    start = _opener_at(syntax, one) if syntax.blocks else 0
    at_name = one.find(NAME, max(start, 0))
    if start < 0 or at_name < 0:
        return None
    prefix = one[start:at_name]
    after = at_name + len(NAME)
    span = _json_args(one, after)
    if span is not None:
        middle = one[after:span[0]].replace(NAME, NAME_SLOT)
        form = CallForm(prefix, middle, one[span[1]:], True)
        return form if check_form(form, syntax) else None
    lo, hi = _diff(one, none)
    if lo <= after:
        return None
    params = []
    for kind, (key, value) in SAMPLES.items():
        p = _param(reply({key: value}) or "", none, key, value) if kind != "string" else \
            _param(one, none, key, value)
        if p is not None:
            params.append((kind, p))
    if not params or params[0][0] != "string":
        return None
    string = params[0][1]
    middle = one[after:lo].replace(NAME, NAME_SLOT)
    form = CallForm(prefix, middle, one[hi:], False, tuple(params))
    two = reply({KEY: VALUE, "limit": 5})
    if two is not None:  # what stands between two parameters, in either order
        lo2, hi2 = _diff(two, none)
        chunk = two[lo2:hi2]
        text = json.dumps(VALUE) if string.json_value else VALUE
        a = string.open_for(KEY) + KEY + string.middle_for(KEY) + text + string.close_for(KEY)
        n = form.param("integer")
        b = n.open_for("limit") + "limit" + n.middle_for("limit") + "5" + n.close_for("limit")
        for first, last in ((a, b), (b, a)):
            if chunk.startswith(first) and chunk.endswith(last) and \
                    len(chunk) >= len(first + last):
                sep = chunk[len(first):len(chunk) - len(last)]
                form = CallForm(prefix, middle, one[hi:], False, tuple(params), sep)
                break
    return form if check_form(form, syntax) else None


def _json_args(text: str, after: int) -> tuple[int, int] | None:
    """Where the probe call's arguments stand as one JSON object after ``after``."""
    at = text.find("{", after)
    while at >= 0:
        try:
            value, end = _DECODER.raw_decode(text, at)
        except ValueError:
            value, end = None, at
        if value == {KEY: VALUE}:
            return at, end
        at = text.find("{", at + 1)
    return None


def _param(one: str, none: str, key: str, value: Any) -> ParamForm | None:
    lo, hi = _diff(one, none)
    chunk = one[lo:hi]
    at_key = chunk.find(key)
    if at_key < 0:
        return None
    for text in _written(value):
        at_value = chunk.find(text, at_key + len(key))
        if at_value < 0:
            continue
        p = ParamForm(chunk[:at_key], chunk[at_key + len(key):at_value].replace(key, KEY_SLOT),
                      chunk[at_value + len(text):].replace(key, KEY_SLOT))
        quote = p.middle[-1:]
        if isinstance(value, str) and quote in ('"', "'") and p.close.startswith(quote):
            # text written as a quoted literal: JSON text, whose escapes it reads
            p = ParamForm(p.open, p.middle[:-1], p.close[1:], json_value=True)
        return p
    return None


def check_form(form: CallForm, syntax: Syntax) -> bool:
    """Whether the family's parser reads calls written in ``form`` back as written."""
    tools = [*PROBE_TOOLS, {"type": "function", "function": {"name": "zq_other"}}]
    for name, args in ((NAME, {KEY: "a b\nc", "limit": 7}), ("zq_other", {})):
        got = parse(syntax, form.write(name, args), tools=tools, quiet=True).tool_calls
        if [(c.name, json.loads(c.arguments)) for c in got] != [(name, args)]:
            return False
    return True


# Harmony writes a call as a message addressed to the function (the template renders a
# past call with the recipient in the role; a model writes it after the channel)
OWN_FORMS: dict[str, CallForm] = {
    "harmony": CallForm("<|channel|>commentary to=functions.", " <|constrain|>json<|message|>",
                        "", True, repeats=False),
}

# A template that renders no calls of past turns (LFM2 8B-A1B lists the tools only)
FALLBACK_FORMS: dict[str, CallForm] = {
    "lfm2": CallForm("<|tool_call_start|>[", "(", ")]<|tool_call_end|>", False,
                     (("string", ParamForm("", "=", "", json_value=True)),
                      ("integer", ParamForm("", "=", ""))), ", "),
}
