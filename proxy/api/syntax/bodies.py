"""How each family writes the calls inside a block: small readers, declared as data
where the syntax allows (regular expressions for names and parameters).

Every reader returns the block's calls, or None when the text is not calls as the family
writes them (the block then stays content). JSON is read with the standard library;
XML-style and pythonic values are typed by the tool's schema (values.py).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.api.syntax.calls import RawCall, Tools
from proxy.api.syntax.values import tool_parameters, typed, typed_arguments

_DECODER = json.JSONDecoder()
NAME_KEYS = ("name", "tool_name", "function")
ARG_KEYS = ("arguments", "parameters", "args", "input")


def _json_values(text: str, seps: str = ",;") -> list[Any] | None:
    """Every JSON value of ``text``, one after another (whitespace or ``seps`` between)."""
    out: list[Any] = []
    i, n = 0, len(text)
    while True:
        while i < n and (text[i].isspace() or (out and text[i] in seps)):
            i += 1
        if i >= n:
            return out
        try:
            value, i = _DECODER.raw_decode(text, i)
        except ValueError:
            return None
        out.append(value)


def _arguments(value: object) -> Mapping[str, Any] | None:
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            return None
    return value if isinstance(value, Mapping) else None


def call_of(obj: object) -> RawCall | None:
    """``{"name": ..., "arguments": {...}}`` and its spellings (``parameters``,
    Command R's ``tool_name``, OpenAI's ``{"function": {...}}``)."""
    if not isinstance(obj, Mapping):
        return None
    if isinstance(obj.get("function"), Mapping):
        return call_of(obj["function"])
    name = next((obj[k] for k in NAME_KEYS if isinstance(obj.get(k), str)), None)
    if name is None:
        return None
    present = [k for k in ARG_KEYS if k in obj]
    args = _arguments(obj[present[0]]) if present else {}
    return RawCall(name, args) if args is not None else None


def json_calls(text: str, tools: Tools | None) -> list[RawCall] | None:
    """One or more JSON call objects, or lists of them (Hermes, Mistral v3, Command R)."""
    values = _json_values(text)
    if not values:
        return None
    out: list[RawCall] = []
    for v in values:
        for item in v if isinstance(v, list) else [v]:
            call = call_of(item)
            if call is None:
                return None
            out.append(call)
    return out or None


def keyed_calls(text: str, tools: Tools | None) -> list[RawCall] | None:
    """A JSON list of ``{"NAME": {arguments}}`` objects (Apertus)."""
    values = _json_values(text)
    if not values:
        return None
    out: list[RawCall] = []
    for v in values:
        for item in v if isinstance(v, list) else [v]:
            if not isinstance(item, Mapping) or len(item) != 1:
                return None
            ((name, args),) = item.items()
            if not isinstance(args, Mapping):
                return None
            out.append(RawCall(name, args))
    return out or None


def _unfence(text: str) -> str:
    """JSON inside a Markdown fence (DeepSeek R1 writes ```json ... ```)."""
    t = text.strip()
    if t.startswith("```"):
        t = t[3:]
        t = t[4:] if t.startswith("json") else t
        if t.rstrip().endswith("```"):
            t = t.rstrip()[:-3]
    return t


@dataclass(slots=True, frozen=True)
class NameThenJson:
    """Calls written as a head naming the function, then its arguments as JSON:
    ``head`` matches at the start of each call (group ``name``); ``split``, when set,
    separates several calls in one block."""

    head: re.Pattern[str]
    split: str = ""

    def __call__(self, text: str, tools: Tools | None) -> list[RawCall] | None:
        parts = text.split(self.split) if self.split else [text]
        out: list[RawCall] = []
        for part in parts:
            if not part.strip() and self.split:
                continue
            m = self.head.match(part.lstrip())
            if m is None:
                return None
            rest = _unfence(part.lstrip()[m.end():])
            values = _json_values(rest) if rest.strip() else [{}]
            if values is None or len(values) != 1:
                return None
            args = _arguments(values[0])
            if args is None:
                return None
            out.append(RawCall(m.group("name").strip(), args))
        return out or None


@dataclass(slots=True, frozen=True)
class Params:
    """Calls whose parameters are written one by one as text (XML-style): ``call``
    finds each call (group ``name``, and ``inner`` its parameters; without ``inner``
    the whole text is one call's), ``param`` each parameter (groups ``key``,
    ``value``, and an optional ``raw`` that says "true" for a verbatim string).
    ``trim``: the newlines a family writes around each value, taken off."""

    call: re.Pattern[str]
    param: re.Pattern[str]
    trim: bool = True

    def __call__(self, text: str, tools: Tools | None) -> list[RawCall] | None:
        out: list[RawCall] = []
        at = 0
        for m in self.call.finditer(text):
            if text[at:m.start()].strip():
                return None  # text between calls that is not a call
            at = m.end()
            name = m.group("name").strip()
            inner = m.group("inner") if "inner" in m.groupdict() else text[m.end():]
            if "inner" not in m.groupdict():
                at = len(text)
            args = self._params(inner or "", tool_parameters(tools, name))
            if args is None:
                return None
            out.append(RawCall(name, args))
        if not out or text[at:].strip():
            return None
        return out

    def _params(self, inner: str, params: Mapping[str, Any]) -> dict[str, Any] | None:
        pairs: list[tuple[str, str]] = []
        raw: set[str] = set()
        at = 0
        for m in self.param.finditer(inner):
            if inner[at:m.start()].strip():
                return None
            at = m.end()
            value = m.group("value")
            if self.trim:
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
            key = m.group("key").strip()
            pairs.append((key, value))
            if m.groupdict().get("raw") in ("true", "string"):
                raw.add(key)
        if inner[at:].strip():
            return None
        args = typed_arguments(pairs, params)
        for key in raw:
            args[key] = dict(pairs)[key]
        return args


# -- pythonic calls (LFM2, Llama 4): [name(a=1, b="x"), other()] ------------------------

def _literal(node: ast.expr) -> object:
    value = ast.literal_eval(node)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, (set, bytes, complex)):
        raise ValueError("not a JSON value")
    return value


def pythonic_calls(text: str, tools: Tools | None) -> list[RawCall] | None:
    t = text.strip()
    if not (t.startswith("[") and t.endswith("]")):
        return None
    try:
        tree = ast.parse(t, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    if not isinstance(tree.body, ast.List):
        return None
    out: list[RawCall] = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = ast.unparse(node.func)
        if not re.fullmatch(r"[\w.\-]+", name):
            return None
        props = tool_parameters(tools, name).get("properties") or {}
        args: dict[str, object] = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                value = _literal(kw.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
            if isinstance(value, str) and isinstance(props, Mapping):
                value = typed(value, props.get(kw.arg)) if _not_string(props.get(kw.arg)) \
                    else value
            args[kw.arg] = value
        out.append(RawCall(name, args))
    return out or None


def _not_string(schema: object) -> bool:
    return isinstance(schema, Mapping) and schema.get("type") not in (None, "string")


# -- Gemma 4: call:NAME{key:<|"|>text<|"|>,n:5,list:[1,2],obj:{k:v}} -------------------

_Q = '<|"|>'


class _Gemma:
    def __init__(self, text: str) -> None:
        self.t, self.i = text, 0

    def value(self) -> object:
        t = self.t
        if t.startswith(_Q, self.i):
            end = t.find(_Q, self.i + len(_Q))
            if end < 0:
                raise ValueError("unclosed string")
            s = t[self.i + len(_Q):end]
            self.i = end + len(_Q)
            return s
        if t.startswith("{", self.i):
            return self.obj()
        if t.startswith("[", self.i):
            self.i += 1
            items: list[object] = []
            while not t.startswith("]", self.i):
                items.append(self.value())
                if t.startswith(",", self.i):
                    self.i += 1
                elif not t.startswith("]", self.i):
                    raise ValueError("expected , or ]")
            self.i += 1
            return items
        m = re.compile(r"[^,}\]]*").match(t, self.i)
        assert m is not None
        self.i = m.end()
        word = m.group().strip()
        try:
            return json.loads(word)
        except ValueError:
            return word

    def obj(self) -> dict[str, object]:
        t = self.t
        if not t.startswith("{", self.i):
            raise ValueError("expected {")
        self.i += 1
        out: dict[str, object] = {}
        while not t.startswith("}", self.i):
            m = re.compile(r"\s*([^:{}\s,]+)\s*:").match(t, self.i)
            if m is None:
                raise ValueError("expected key:")
            self.i = m.end()
            out[m.group(1)] = self.value()
            if t.startswith(",", self.i):
                self.i += 1
            elif not t.startswith("}", self.i):
                raise ValueError("expected , or }")
        self.i += 1
        return out


def gemma_calls(text: str, tools: Tools | None) -> list[RawCall] | None:
    t = text.strip()
    m = re.match(r"call:([\w.\-]+)", t)
    if m is None:
        return None
    p = _Gemma(t)
    p.i = m.end()
    try:
        args = p.obj() if p.i < len(t) else {}
    except (ValueError, RecursionError):
        return None
    if t[p.i:].strip():
        return None
    return [RawCall(m.group(1), args)]
