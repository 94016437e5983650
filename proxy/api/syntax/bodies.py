"""How each family writes the calls inside a block: small readers, declared as data
where the syntax allows (regular expressions for names and parameters).

Every reader returns the block's calls, or None when the text is not calls as the family
writes them (the block then stays content). JSON is read with the standard library;
XML-style values are typed by the tool's schema (values.py); notations.py reads the
families that write calls in a notation of their own (pythonic, Gemma 4, Kimi K3).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from proxy.api.syntax.calls import RawCall, Tools
from proxy.api.syntax.values import tool_parameters, typed_arguments

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


def arguments_of(value: object) -> Mapping[str, Any] | None:
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
    args = arguments_of(obj[present[0]]) if present else {}
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


_FENCE = re.compile(r"\s*```(?:json)?")
_FENCE_END = re.compile(r"\s*```")


@dataclass(slots=True, frozen=True)
class NameThenJson:
    """Calls written as a head naming the function, then its arguments as JSON, one after
    another: ``head`` matches at the start of each call (group ``name``), ``end`` may
    follow each call's JSON (DeepSeek's ``<｜tool▁call▁end｜>``, Kimi's
    ``<|tool_call_end|>``). The JSON is read as JSON, so a marker written inside one of
    its strings is text. ``noise``: text between calls is skipped (Kimi's section)."""

    head: re.Pattern[str]
    end: str = ""
    noise: bool = False

    def __call__(self, text: str, tools: Tools | None) -> list[RawCall] | None:
        calls, rest = self._read(text)
        if rest.strip() and not self.noise:
            return None
        if not calls:
            # an empty block of a family whose blocks hold calls one by one: no calls
            return [] if self.end and not text.strip() else None
        return calls

    def leading(self, text: str, tools: Tools | None) -> list[RawCall]:
        """The calls read whole from the start of a block the token limit cut."""
        return self._read(text)[0]

    def _read(self, text: str) -> tuple[list[RawCall], str]:
        out: list[RawCall] = []
        at = 0
        while True:
            start = len(text) - len(text[at:].lstrip())
            m = self.head.search(text, at) if self.noise else self.head.match(text, start)
            if m is None:
                return out, text[at:]
            j = m.end()
            fence = _FENCE.match(text, j)
            j = fence.end() if fence else j
            k = len(text) - len(text[j:].lstrip())
            if k >= len(text) or (self.end and text.startswith(self.end, k)):
                args: object = {}  # no arguments written
                j = k
            else:
                try:
                    args, j = _DECODER.raw_decode(text, k)
                except ValueError:
                    return out, text[at:]
            if fence:
                close = _FENCE_END.match(text, j)
                j = close.end() if close else j
            k = len(text) - len(text[j:].lstrip())
            if self.end and text.startswith(self.end, k):
                j = k + len(self.end)
            mapping = arguments_of(args)
            if mapping is None:
                return out, text[at:]
            out.append(RawCall(m.group("name").strip(), mapping,
                               (m.groupdict().get("id") or "").strip()))
            at = j


@dataclass(slots=True, frozen=True)
class Params:
    """Calls whose parameters are written one by one as text (XML-style): ``call``
    finds each call (group ``name``, and ``inner`` its parameters; without ``inner``
    the whole text is one call's), ``param`` each parameter (groups ``key``,
    ``value``, and an optional ``raw`` that says "true" for a verbatim string).
    ``trim``: the newlines a family writes around each value, taken off. ``closed``:
    each call ends with a closer of its own (else the block's closer ends it, and a block
    the token limit cut keeps none)."""

    call: re.Pattern[str]
    param: re.Pattern[str]
    trim: bool = True
    closed: bool = True

    def __call__(self, text: str, tools: Tools | None) -> list[RawCall] | None:
        calls, rest = self._read(text, tools)
        return calls if calls and not rest.strip() else None

    def leading(self, text: str, tools: Tools | None) -> list[RawCall]:
        """The calls read whole from the start of a block the token limit cut."""
        return self._read(text, tools)[0] if self.closed else []

    def _read(self, text: str, tools: Tools | None) -> tuple[list[RawCall], str]:
        out: list[RawCall] = []
        at = 0
        for m in self.call.finditer(text):
            if text[at:m.start()].strip():
                break  # text between calls that is not a call
            name = m.group("name").strip()
            whole = "inner" not in m.groupdict()
            inner = text[m.end():] if whole else m.group("inner")
            args = self._params(inner or "", tool_parameters(tools, name))
            if args is None:
                break
            out.append(RawCall(name, args))
            at = len(text) if whole else m.end()
        return out, text[at:]

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
            if value.startswith("<![CDATA[") and value.endswith("]]>"):
                value = value[9:-3]  # text MiniCPM wraps (a value with a line break)
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
