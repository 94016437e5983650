"""Argument values typed by the tool's JSON schema.

XML and pythonic syntaxes write every parameter value as text: ``<parameter=limit>5``
means the integer 5 when the tool declares ``limit`` an integer, and the string "5" when
it declares a string. The rule, as llama.cpp and vLLM apply it:

- a value the schema types as a string (only) stays verbatim, multi-line included;
- integer, number, boolean, null, object and array values are read as JSON (Python's
  ``True``/``False``/``None`` too, which pythonic calls write); one that does not read
  as its type stays a string, so nothing the model wrote is lost;
- a parameter the schema does not describe is read as JSON where it parses as JSON,
  else kept as a string.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

_PY_LITERALS = {"True": True, "False": False, "None": None}


def tool_parameters(tools: Sequence[Mapping[str, Any]] | None, name: str) -> Mapping[str, Any]:
    """The ``parameters`` schema of the tool called ``name`` (empty if unknown)."""
    for t in tools or ():
        fn = t.get("function") if isinstance(t, Mapping) else None
        if isinstance(fn, Mapping) and fn.get("name") == name:
            params = fn.get("parameters")
            return params if isinstance(params, Mapping) else {}
    return {}


def _types(schema: object) -> set[str]:
    """The JSON types a schema allows (``anyOf``/``oneOf`` branches included)."""
    if not isinstance(schema, Mapping):
        return set()
    out: set[str] = set()
    kind = schema.get("type")
    if isinstance(kind, str):
        out.add(kind)
    elif isinstance(kind, list):
        out.update(k for k in kind if isinstance(k, str))
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or ():
            out |= _types(branch)
    if "enum" in schema and not out:
        out |= {type_of(v) for v in schema["enum"]}
    if "const" in schema and not out:
        out.add(type_of(schema["const"]))
    return out


def type_of(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    return "array" if isinstance(value, list) else "object"


def _fits(value: object, types: set[str]) -> bool:
    kind = type_of(value)
    return kind in types or (kind == "integer" and "number" in types)


def _read(text: str) -> tuple[bool, object]:
    try:
        return True, json.loads(text)
    except ValueError:
        pass
    if text in _PY_LITERALS:
        return True, _PY_LITERALS[text]
    return False, None


def typed(text: str, schema: object) -> object:
    """``text`` (a parameter's value as written) as the schema types it."""
    types = _types(schema)
    if types == {"string"}:
        return text
    ok, value = _read(text.strip())
    if not types:
        return value if ok else text
    if ok and _fits(value, types):
        return value
    return text


def typed_arguments(pairs: Sequence[tuple[str, str]], params: Mapping[str, Any]
                    ) -> dict[str, object]:
    """(name, text) pairs as an arguments object, each value typed by ``params``."""
    props = params.get("properties") if isinstance(params, Mapping) else None
    props = props if isinstance(props, Mapping) else {}
    return {k: typed(v, props.get(k)) for k, v in pairs}
