"""Readers of the calls that families write in a notation of their own, not JSON: pythonic
lists of calls (LFM2, Llama 4), Gemma 4's bare-keyed objects, Kimi K3's XTML elements.
Values are typed by what the notation says, else by the tool's schema (values.py).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from typing import Any

from proxy.api.syntax.bodies import arguments_of
from proxy.api.syntax.calls import RawCall, Tools
from proxy.api.syntax.values import tool_parameters, typed

# -- pythonic calls (LFM2, Llama 4): [name(a=1, b="x"), other()] ------------------------

def _literal(node: ast.expr) -> object:
    value = ast.literal_eval(node)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, (set, bytes, complex)):
        raise ValueError("not a JSON value")
    return value


def _escape_newlines(text: str) -> str:
    """Line breaks inside string literals escaped: templates render text values as they
    are (LFM2's ``path='two\nlines'`` with a real line break), which Python refuses."""
    out, quote, i = [], "", 0
    while i < len(text):
        c = text[i]
        if quote and c == "\\":
            out.append(text[i:i + 2])
            i += 2
            continue
        if c in "'\"" and (not quote or c == quote):
            quote = "" if quote else c
        out.append("\\n" if quote and c == "\n" else c)
        i += 1
    return "".join(out)


def pythonic_calls(text: str, tools: Tools | None) -> list[RawCall] | None:
    t = text.strip()
    if not (t.startswith("[") and t.endswith("]")):
        return None
    try:
        tree = ast.parse(_escape_newlines(t), mode="eval")
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


# a bare key, spaces allowed (or a JSON one, as a grammar writes objects)
_GEMMA_KEY = re.compile(r'\s*"?([^:{}\[\],<>"]+?)"?\s*:')
_DECODER = json.JSONDecoder()
_GEMMA_WORD = re.compile(r"[^,}\]]*")


class _Gemma:
    def __init__(self, text: str) -> None:
        self.t, self.i = text, 0

    def value(self) -> object:
        t = self.t
        while self.i < len(t) and t[self.i].isspace():
            self.i += 1  # ", " between items, as models write them
        if t.startswith(_Q, self.i):
            end = t.find(_Q, self.i + len(_Q))
            if end < 0:
                raise ValueError("unclosed string")
            s = t[self.i + len(_Q):end]
            self.i = end + len(_Q)
            return s
        if t.startswith('"', self.i):  # a JSON string
            text, self.i = _DECODER.raw_decode(t, self.i)
            return text
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
        m = _GEMMA_WORD.match(t, self.i)
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
            m = _GEMMA_KEY.match(t, self.i)
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


# -- Kimi K3's XTML: <|open|>call tool="NAME" index="1"<|sep|> arguments <|close|>call<|sep|>

_XTML_CALL = re.compile(
    r'\s*<\|open\|>call tool="(?P<name>[^"]*)"[^<]*?<\|sep\|>(?P<inner>.*?)<\|close\|>call'
    r"<\|sep\|>(?=\s*(?:<\|open\|>call|\Z))", re.S)
_XTML_ARG = re.compile(
    r'\s*<\|open\|>argument key="(?P<key>[^"]*)"(?: type="(?P<type>\w+)")?<\|sep\|>'
    r"(?P<value>.*?)<\|close\|>argument<\|sep\|>(?=\s*(?:<\|open\|>argument|\Z))", re.S)
_XTML_JSON = re.compile(r"\s*<\|open\|>json[^<]*?<\|sep\|>(?P<json>.*)<\|close\|>json<\|sep\|>\s*",
                        re.S)


def _unescape_attr(text: str) -> str:
    """An XTML attribute as the template escapes it (``&amp;`` and ``&quot;``)."""
    return text.replace("&quot;", '"').replace("&amp;", "&")


def _xtml_args(inner: str, params: Mapping[str, Any]) -> dict[str, Any] | None:
    whole = _XTML_JSON.fullmatch(inner)
    if whole is not None:
        value = arguments_of(whole.group("json"))
        return dict(value) if value is not None else None
    props = params.get("properties") if isinstance(params, Mapping) else None
    props = props if isinstance(props, Mapping) else {}
    out: dict[str, Any] = {}
    at = 0
    for m in _XTML_ARG.finditer(inner):
        if inner[at:m.start()].strip():
            return None
        at = m.end()
        key, text, kind = _unescape_attr(m.group("key")), m.group("value"), m.group("type")
        if kind == "string":
            out[key] = text  # the value's own type, as the model wrote it
        elif kind is not None:
            try:
                out[key] = json.loads(text)
            except ValueError:
                out[key] = typed(text, props.get(key))
        else:
            out[key] = typed(text, props.get(key))
    return out if not inner[at:].strip() else None


class XtmlCalls:
    """Kimi K3's calls: each argument with its key and JSON type, or one JSON object. A
    closer counts only where the structure goes on after it, so a value may hold the
    markers' text."""

    def __call__(self, text: str, tools: Tools | None) -> list[RawCall] | None:
        calls, rest = self._read(text, tools)
        if rest.strip():
            return None
        return calls

    def leading(self, text: str, tools: Tools | None) -> list[RawCall]:
        return self._read(text, tools)[0]

    def _read(self, text: str, tools: Tools | None) -> tuple[list[RawCall], str]:
        out: list[RawCall] = []
        at = 0
        for m in _XTML_CALL.finditer(text):
            if text[at:m.start()].strip():
                break
            name = _unescape_attr(m.group("name"))
            args = _xtml_args(m.group("inner"), tool_parameters(tools, name))
            if args is None:
                break
            out.append(RawCall(name, args))
            at = m.end()
        return out, text[at:]


# -- MiniMax M3: every tag after the namespace token, values nested as elements ---------
# ]<]minimax[>[<invoke name="NAME">]<]minimax[>[<key>value]<]minimax[>[</key>...
# ]<]minimax[>[</invoke>; a list is <item> elements, an object its keys' elements

MINIMAX_NS = "]<]minimax[>["
_M3_TAG = re.compile(r"<(/?)([^<>\s/]+)>")


class _M3:
    def __init__(self, text: str) -> None:
        self.t, self.i = text, 0

    def tag(self) -> tuple[bool, str] | None:
        """The element tag at the cursor (closing?, name), read past."""
        if not self.t.startswith(MINIMAX_NS, self.i):
            return None
        m = _M3_TAG.match(self.t, self.i + len(MINIMAX_NS))
        if m is None:
            return None
        self.i = m.end()
        return m.group(1) == "/", m.group(2)

    def value(self, name: str, schema: object) -> object:
        """The value of element ``name`` whose opening tag was read, with its closer."""
        start = self.i
        children: list[tuple[str, object]] = []
        while True:
            if not children:  # text runs to the next namespace token
                nxt = self.t.find(MINIMAX_NS, self.i)
                self.i = len(self.t) if nxt < 0 else nxt
            at = self.i
            t = self.tag()
            if t is None:
                raise ValueError("expected an element")
            closing, tag = t
            if closing:
                if tag != name:
                    raise ValueError("mismatched element")
                if not children:  # text: up to the closer
                    return typed(self.t[start:at], schema)
                if all(k == "item" for k, _ in children):
                    return [v for _, v in children]
                return dict(children)
            if self.t[start:at].strip() and not children:
                raise ValueError("text before an element")
            children.append((tag, self.value(tag, _sub(schema, tag))))
            start = self.i


def _sub(schema: object, key: str) -> object:
    if not isinstance(schema, Mapping):
        return None
    if key == "item":
        return schema.get("items")
    props = schema.get("properties")
    return props.get(key) if isinstance(props, Mapping) else None


_M3_INVOKE = re.compile(r'\s*' + re.escape(MINIMAX_NS) + r'<invoke name="(?P<name>[^"]*)">')


class MinimaxM3Calls:
    """MiniMax M3's calls: values as nested elements, each tag after the namespace token
    (so a value may hold tag-like text), typed by the tool's schema."""

    def __call__(self, text: str, tools: Tools | None) -> list[RawCall] | None:
        calls, rest = self._read(text, tools)
        return calls if calls and not rest.strip() else None

    def leading(self, text: str, tools: Tools | None) -> list[RawCall]:
        return self._read(text, tools)[0]

    def _read(self, text: str, tools: Tools | None) -> tuple[list[RawCall], str]:
        out: list[RawCall] = []
        at = 0
        while True:
            m = _M3_INVOKE.match(text, at)
            if m is None:
                return out, text[at:]
            p = _M3(text)
            p.i = m.end()
            name = m.group("name")
            try:
                value = p.value("invoke", tool_parameters(tools, name))
            except (ValueError, RecursionError):
                return out, text[at:]
            if value == "":
                value = {}
            if not isinstance(value, dict):
                return out, text[at:]
            out.append(RawCall(name, value))
            at = p.i
