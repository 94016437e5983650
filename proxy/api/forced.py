"""Grammars that force tool calls in the family's own form (proxy/api/syntax/forms.py).

A call is the form's head (its opener and the function's name), its arguments, and its
suffix. Arguments written as one JSON text follow the tool's schema (llama.cpp's
converter). Arguments written one by one follow their property's schema each: text
(a string property) as any text without the form's closer of a parameter, an enum of
strings as its values, anything else as JSON by its schema (the family's parser types
the text by the schema again). A text parameter's pattern or length is not held to in a
form that writes text bare. Required properties come first and are always written,
the others may be left out, with the form's separator between any two written.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.api.syntax.forms import CallForm
from proxy.engine.grammar import SchemaError, SchemaPart, literal, schema_rules, text_without


def family_grammar(form: CallForm, callable_: Sequence[tuple[int, str, Mapping[str, Any]]],
                   json_schema: Mapping[str, Any] | None, json_path: str, forced: bool,
                   parallel: bool, tools_path: str, params_key: str) -> str:
    """The reply grammar (rule ``root``) for forced calls, a structured reply that may
    call instead, or text with at most one call, in ``form``; ``callable_``: (index in
    the request's tools, name, parameters schema) of each tool the reply may call."""
    parts: list[SchemaPart] = []
    texts: dict[str, str] = {}  # a parameter's closer -> its text rule
    calls: list[str] = []
    for k, name, params in callable_:
        path = f"{tools_path}[{k}].{params_key}"
        head = literal(form.head(name))
        if form.json_args:
            parts.append(SchemaPart(params, path, f"args-{k}"))
            calls.append(f"{head} @{len(parts) - 1} {literal(form.suffix)}")
            continue
        props = params.get("properties") or {}
        required = [p for p in props if p in set(params.get("required") or ())]
        optional = [p for p in props if p not in required]
        items = {}
        for p in (*required, *optional):
            items[p] = _param(form, p, props[p], f"{path}.properties.{p}", f"arg-{k}", parts,
                              texts)
        args = _sequence(form.sep, [items[p] for p in required], [items[p] for p in optional])
        calls.append(f"{head} {args} {literal(form.suffix)}")
    if json_schema is not None:
        parts.append(SchemaPart(json_schema, json_path, "json-reply"))
    names, rules = schema_rules(parts) if parts else ([], "")
    out = [rules, *(text_without(rule, closer) for closer, rule in texts.items())]
    if callable_:
        resolved = [re.sub(r"@(\d+)", lambda m: names[int(m.group(1))], c) for c in calls]
        out.append(f"tool-call-block ::= {' | '.join(f'( {c} )' for c in resolved)}")
        repeat = parallel and form.repeats
        many = f" ( {literal(chr(10))} tool-call-block )*" if repeat else ""
        out.append(f"tool-calls ::= tool-call-block{many}")
    if forced:
        out.append("root ::= tool-calls")
    elif json_schema is not None:
        out.append(f"root ::= {names[-1]}" + (" | tool-calls" if callable_ else ""))
    else:  # parallel_tool_calls false: text, then at most one call
        opener = form.prefix[:form.prefix.find(">") + 1] or form.prefix
        if not opener.strip():
            raise SchemaError("parallel_tool_calls", "this model's tool-call syntax cannot "
                              "be limited to one call by a grammar here")
        out.append(text_without("free-text", opener))
        out.append("root ::= free-text tool-call-block?")
    return "\n".join(r for r in out if r)


def _param(form: CallForm, key: str, schema: Any, path: str, prefix: str,
           parts: list[SchemaPart], texts: dict[str, str]) -> str:
    """One parameter: its opener and name, its value, its closer."""
    kind = _kind(schema)
    p = form.param(kind)
    value: str
    if kind == "string" and not p.json_value:
        choices = _choices(schema)
        if choices is not None:
            value = "( " + " | ".join(literal(c) for c in choices) + " )"
        else:
            close = p.close_for(key).strip()
            closer = close[:close.find(">") + 1] or close
            if not closer:
                raise SchemaError(path, "this model's tool-call syntax writes text "
                                  "parameters with no closer a grammar can keep out of them")
            value = texts.setdefault(closer, f"param-text-{len(texts)}")
    else:
        parts.append(SchemaPart(schema, path, f"{prefix}-{len(parts)}"))
        value = f"@{len(parts) - 1}"
    return f"( {literal(p.open_for(key) + key + p.middle_for(key))} {value} " \
           f"{literal(p.close_for(key))} )"


def _sequence(sep: str, required: list[str], optional: list[str]) -> str:
    """The required items in order, then any of the optional ones, ``sep`` between two."""
    s = f" {literal(sep)} " if sep else " "
    if required:
        return s.join(required) + "".join(f" ({s}{o} )?" for o in optional)
    if not optional:
        return ""
    # no item is certain to come first: each alternative starts at one of them
    alts = [o + "".join(f" ({s}{x} )?" for x in optional[i + 1:])
            for i, o in enumerate(optional)]
    return "( " + " | ".join(f"( {a} )" for a in alts) + " )?"


def _kind(schema: Any) -> str:
    """The JSON type a parameter is written as ("string" for text and enums of it)."""
    if not isinstance(schema, Mapping):
        return "object"
    kind = schema.get("type")
    if kind is None and _choices(schema) is not None:
        return "string"
    return kind if isinstance(kind, str) else "object"


def _choices(schema: Mapping[str, Any]) -> list[str] | None:
    values = schema.get("enum") if "enum" in schema else (
        [schema["const"]] if "const" in schema else None)
    if values and all(isinstance(v, str) for v in values):
        return list(values)
    return None
