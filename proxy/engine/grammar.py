"""GBNF pieces for constrained replies: literals, free text that avoids a literal, the
reasoning a thinking model writes first, and JSON schemas through llama.cpp's converter.

A schema is checked before it is converted: llama.cpp's converter silently ignores
keywords it cannot enforce (``minimum``, ``uniqueItems``, ``not`` ...), which would let
a reply through that does not validate. Any keyword outside ``HANDLED`` and
``ANNOTATIONS``, and the few combinations the converter drops a part of, are a
``SchemaError`` naming the part (a JSON path such as ``schema.properties.age``).

This module is the HTTP side's face of the engine for grammars: it checks a client's GBNF
text (``check_grammar``, llama.cpp's parser through the binding) and builds the reply
grammars, so proxy/api imports nothing else of the engine for them.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.engine.binding import SchemaRules, check_grammar

__all__ = ["ANNOTATIONS", "HANDLED", "SchemaError", "check_grammar", "check_schema",
           "literal", "schema_rules", "text_without", "after_reasoning", "may_reason_first",
           "SchemaPart"]

# Keywords the converter enforces, and those that only describe (safe to ignore).
HANDLED = frozenset({"type", "properties", "required", "additionalProperties", "items",
                     "prefixItems", "minItems", "maxItems", "enum", "const", "anyOf",
                     "oneOf", "allOf", "$ref", "$defs", "definitions", "pattern", "format",
                     "minLength", "maxLength"})
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id",
                         "$comment", "deprecated", "readOnly", "writeOnly", "discriminator"})
TYPES = frozenset({"object", "array", "string", "number", "integer", "boolean", "null"})
MAX_REPEAT = 512  # maxLength / maxItems: the converter nests one group per allowed item
MAX_GRAMMAR_BYTES = 256 * 1024
MAX_SCHEMA_VALUES = 20_000  # JSON values in a request's schemas: converted on the event loop


class SchemaError(ValueError):
    """A JSON schema the grammar cannot enforce; ``path`` is the part at fault."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"'{path}': {message}")
        self.path = path


def literal(text: str) -> str:
    """``text`` as a GBNF string literal."""
    return '"' + "".join(_char(c) for c in text) + '"'


def _char(c: str) -> str:
    """One character as GBNF writes it inside a literal or a class: letters and digits as
    they are, anything else escaped, so no character can end or change the construct."""
    if c.isascii() and c.isalnum():
        return c
    code = ord(c)
    return f"\\x{code:02X}" if code < 0x100 else f"\\u{code:04X}" if code < 0x10000 \
        else f"\\U{code:08X}"


def text_without(name: str, lit: str) -> str:
    """Rules ``name`` matching any text (possibly empty) that does not contain ``lit``.

    A right-recursive automaton over how much of ``lit`` the text ends with (the
    Knuth-Morris-Pratt states): from state k a character of ``lit`` moves to the state it
    leads to, any other character back to 0, and the one that would complete ``lit`` is
    not allowed.
    """
    assert lit, "an empty literal"
    fail = [0] * len(lit)
    k = 0
    for i in range(1, len(lit)):
        while k and lit[i] != lit[k]:
            k = fail[k - 1]
        k += lit[i] == lit[k]
        fail[i] = k

    def step(state: int, c: str) -> int:
        while state and lit[state] != c:
            state = fail[state - 1]
        return state + 1 if lit[state] == c else 0

    rules = [f"{name} ::= {name}-0"]
    for state in range(len(lit)):
        moves = {c: step(state, c) for c in sorted(set(lit))}
        moves = {c: to for c, to in moves.items() if to}  # the rest go back to 0
        others = "".join(_char(c) for c in moves)
        # the empty alternative first: the text may end in any state (GBNF reads a
        # trailing "|" as going on over the newline)
        alts = ["", f"[^{others}] {name}-0"]
        alts += [f"{literal(c)} {name}-{to}" for c, to in moves.items() if to < len(lit)]
        rules.append(f"{name}-{state} ::= " + " | ".join(alts))
    return "\n".join(rules)


def after_reasoning(grammar: str, close: str, root: str = "root") -> tuple[str, str]:
    """The grammar for a reply that starts inside a reasoning block: free reasoning (any
    text without ``close``), ``close``, a little whitespace, then ``root``. Returns the
    grammar text and the name of its new root rule."""
    rules = [grammar, text_without("reasoning-text", close),
             f"reasoned-root ::= reasoning-text {literal(close)} [ \\t\\n]{{0,4}} {root}"]
    return "\n".join(rules), "reasoned-root"


def may_reason_first(grammar: str, open_: str, close: str, root: str = "root"
                     ) -> tuple[str, str]:
    """The grammar for a reply that may open a reasoning block itself before ``root``
    (a thinking model whose template leaves the choice to it): the grammar starts at
    what follows the reasoning, as llama.cpp's lazy grammars start at their trigger."""
    rules = [grammar, text_without("reasoning-text", close),
             f"reasoned-root ::= ( {literal(open_)} reasoning-text {literal(close)} "
             f"[ \\t\\n]{{0,4}} )? {root}"]
    return "\n".join(rules), "reasoned-root"


# -- JSON schemas ---------------------------------------------------------------------

@dataclass(slots=True, frozen=True)
class SchemaPart:
    """One JSON schema of a grammar: where it sits in the request, and its rule's name."""

    schema: object
    path: str
    name: str


def schema_rules(parts: Sequence[SchemaPart], *, prop_order: Sequence[str] = ()
                 ) -> tuple[list[str], str]:
    """The rule matching each part's schema, and the grammar text of all of them (one
    converter, so rules the parts share are written once). SchemaError names the part
    that cannot be enforced."""
    values = 0
    for part in parts:
        if not isinstance(part.schema, Mapping):
            raise SchemaError(part.path, "a JSON schema must be an object")
        values += _values(part.schema)
        if values > MAX_SCHEMA_VALUES:
            raise SchemaError(part.path, f"the schemas hold more than {MAX_SCHEMA_VALUES:,} "
                              "JSON values")
        check_schema(part.schema, part.path)
    rules = SchemaRules(prop_order)
    names: list[str] = []
    for i, part in enumerate(parts):
        assert isinstance(part.schema, Mapping)
        schema = _unique_refs(part.schema, part.path, f"statecache-ref-{i}")
        try:
            names.append(rules.add(schema, part.name, f"s{i}"))
        except (AssertionError, ValueError, KeyError, TypeError, AttributeError,
                RecursionError) as e:
            raise SchemaError(part.path, "llama.cpp's JSON-schema converter cannot handle "
                              f"it: {_short(e)}") from None
    text = rules.text()
    if len(text) > MAX_GRAMMAR_BYTES:
        raise SchemaError(parts[0].path if len(parts) == 1 else "schemas",
                          f"the grammar would be {len(text):,} bytes, over "
                          f"{MAX_GRAMMAR_BYTES:,}")
    return names, text


def _unique_refs(schema: Mapping[str, Any], path: str, prefix: str) -> dict[str, Any]:
    """A copy of ``schema`` whose local ``$ref``s all point to ``#/$defs/{prefix}-N``, one
    entry per distinct reference: the converter names a reference's rule after its last
    segment, so two references ending alike (or two schemas' "Item") would share a rule."""
    copy: dict[str, Any] = json.loads(json.dumps(schema))
    names: dict[str, str] = {}

    def collect(node: object) -> None:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref not in names:
                names[ref] = f"{prefix}-{len(names)}"
                collect(_resolve(copy, ref, path))
            for v in node.values():
                collect(v)
        elif isinstance(node, list):
            for v in node:
                collect(v)

    def rewrite(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (f"#/$defs/{names[v]}" if k == "$ref" else rewrite(v))
                    for k, v in node.items()}
        if isinstance(node, list):
            return [rewrite(v) for v in node]
        return node

    collect(copy)
    targets = {names[ref]: _resolve(copy, ref, path) for ref in names}
    out: dict[str, Any] = rewrite(copy)
    if targets:
        out["$defs"] = {**out.get("$defs", {}), **rewrite(targets)}
    return out


def _resolve(root: Mapping[str, Any], ref: str, path: str) -> Any:
    if not ref.startswith("#"):
        raise SchemaError(path, f"only local references ('#/...') are supported, not {ref!r}")
    node: Any = root
    for seg in ref[1:].split("/")[1:] if ref != "#" else []:
        seg = seg.replace("~1", "/").replace("~0", "~")
        if isinstance(node, list) and seg.isdigit() and int(seg) < len(node):
            node = node[int(seg)]
        elif isinstance(node, Mapping) and seg in node:
            node = node[seg]
        else:
            raise SchemaError(path, f"the reference {ref!r} points to nothing")
    return node


def _values(node: object) -> int:
    """JSON values in ``node``, itself included."""
    n, stack = 0, [node]
    while stack:
        v = stack.pop()
        n += 1
        if isinstance(v, Mapping):
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)
    return n


def _short(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return text if len(text) <= 200 else text[:200] + "..."


def check_schema(node: object, path: str) -> None:
    """SchemaError for the first part of ``node`` the converter would not enforce."""
    if not isinstance(node, Mapping):
        raise SchemaError(path, "a schema here must be an object (true/false schemas are "
                          "not supported)")
    for key in node:
        if key not in HANDLED and key not in ANNOTATIONS:
            raise SchemaError(path, f"'{key}' is not supported: the grammar cannot enforce it")
    _check_combinations(node, path)
    _check_type(node, path)
    for key in ("minItems", "maxItems", "minLength", "maxLength"):
        v = node.get(key)
        if key in node and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise SchemaError(f"{path}.{key}", "must be a non-negative integer")
        if key.startswith("max") and isinstance(v, int) and v > MAX_REPEAT:
            raise SchemaError(f"{path}.{key}", f"values above {MAX_REPEAT} are not supported")
    if "enum" in node and (not isinstance(node["enum"], list) or not node["enum"]):
        raise SchemaError(f"{path}.enum", "must be a non-empty list")
    _check_children(node, path)


def _check_type(node: Mapping[str, Any], path: str) -> None:
    kind = node.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if k not in TYPES:
            raise SchemaError(f"{path}.type", f"unknown type {k!r}")
    if isinstance(kind, list):
        others = set(node) - ANNOTATIONS - {"type", "$defs", "definitions"}
        if others:
            raise SchemaError(path, f"a list of types with {', '.join(sorted(others))} beside "
                              "it is not supported (use anyOf)")


def _check_combinations(node: Mapping[str, Any], path: str) -> None:
    """Combinations in which the converter enforces one keyword and drops another."""
    keys = set(node) - ANNOTATIONS - {"$defs", "definitions"}
    for alone in ("$ref", "anyOf", "oneOf"):
        if alone in node and keys - {alone}:
            raise SchemaError(path, f"'{alone}' with {', '.join(sorted(keys - {alone}))} "
                              "beside it is not supported")
    if "allOf" in node and keys - {"allOf", "type"}:
        raise SchemaError(path, "'allOf' with other keywords beside it is not supported")
    if "items" in node and "prefixItems" in node:
        raise SchemaError(path, "'items' together with 'prefixItems' is not supported")
    if "prefixItems" in node and {"minItems", "maxItems"} & keys:
        raise SchemaError(path, "'prefixItems' with minItems/maxItems is not supported")
    if {"pattern", "format"} & keys and {"minLength", "maxLength"} & keys:
        raise SchemaError(path, "minLength/maxLength together with pattern or format is "
                          "not supported")
    if "pattern" in node:
        p = node["pattern"]
        if not isinstance(p, str) or not (p.startswith("^") and p.endswith("$")):
            raise SchemaError(f"{path}.pattern", "must be a string anchored with ^ and $ "
                              "(the whole value has to match it)")
    props = node.get("properties", {})
    if not isinstance(props, Mapping):
        raise SchemaError(f"{path}.properties", "must be an object")
    required = node.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise SchemaError(f"{path}.required", "must be a list of property names")
    missing = [r for r in required if r not in props]
    if missing:
        raise SchemaError(f"{path}.required", f"{', '.join(map(repr, missing))} is required "
                          "but not among the properties")


def _check_children(node: Mapping[str, Any], path: str) -> None:
    for key in ("properties", "$defs", "definitions"):
        sub = node.get(key)
        if isinstance(sub, Mapping):
            for name, child in sub.items():
                check_schema(child, f"{path}.{key}.{name}")
        elif sub is not None:
            raise SchemaError(f"{path}.{key}", "must be an object")
    for key in ("anyOf", "oneOf", "allOf", "prefixItems"):
        sub = node.get(key)
        if sub is None:
            continue
        if not isinstance(sub, list) or not sub:
            raise SchemaError(f"{path}.{key}", "must be a non-empty list of schemas")
        for i, child in enumerate(sub):
            check_schema(child, f"{path}.{key}[{i}]")
            if key == "allOf" and set(child) - ANNOTATIONS - {"type", "properties",
                                                             "required", "$ref"}:
                raise SchemaError(f"{path}.allOf[{i}]", "only object parts (properties, "
                                  "required) can be combined with allOf")
    if "items" in node:
        check_schema(node["items"], f"{path}.items")
    extra = node.get("additionalProperties")
    if extra is not None and not isinstance(extra, bool):
        check_schema(extra, f"{path}.additionalProperties")
