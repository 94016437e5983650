"""Grammars for structured output and forced tool calls, in the format reply.py parses.

- JSON output (``response_format`` json_object / json_schema, Anthropic's
  ``output_config.format``, Responses' ``text.format``): the reply is one JSON value that
  validates against the schema (json_object: any JSON object).
- Forced tool calls (``tool_choice`` "required" or a named function): the reply is
  ``<tool_call>\\n{"name": ..., "arguments": ...}\\n</tool_call>`` blocks, one line apart
  (as the ChatML and Gemma templates here write them), whose arguments validate against
  the tool's parameters; several when parallel tool calls are allowed, else exactly one.
- ``parallel_tool_calls: false`` with tools the model may call or not: free text (that
  does not open a call) and at most one call, which must validate.
- JSON output while tools may be called: either the JSON or the calls.

A thinking template's reasoning may come first: the engine lets the reply reason until
``</think>`` when the prompt leaves it inside a ``<think>`` block (``REASONING``).

``constraint``, ``json_format`` and ``constrained`` are the three APIs' way in: a schema
the grammar cannot enforce is a 400 naming the request field at fault.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.api.chat import ChatRequest, Constraint
from proxy.api.fields import ApiError
from proxy.api.forced import family_grammar
from proxy.api.reply import CALL_CLOSE, CALL_OPEN, THINK_CLOSE, THINK_OPEN
from proxy.api.syntax.calls import Syntax
from proxy.api.syntax.forms import CallForm
from proxy.engine.grammar import (
    SchemaError,
    SchemaPart,
    check_schema,
    literal,
    schema_rules,
    text_without,
)
from proxy.engine.types import SamplingParams

REASONING = (THINK_OPEN, THINK_CLOSE)
ANY_OBJECT: Mapping[str, Any] = {"type": "object"}
# Omitted parameters mean a function without any (OpenAI's rule): arguments are {}.
NO_PARAMETERS: Mapping[str, Any] = {"type": "object", "properties": {}}


def forced_tool(tool_choice: object) -> str | None:
    """The name a ``{"type": "function", "function": {"name": ...}}`` choice forces."""
    if isinstance(tool_choice, Mapping):
        fn = tool_choice.get("function")
        if isinstance(fn, Mapping) and isinstance(fn.get("name"), str):
            return str(fn["name"])
    return None


def reply_grammar(*, json_schema: Mapping[str, Any] | None, json_path: str,
                  tools: Sequence[Mapping[str, Any]] | None, tool_choice: object,
                  parallel: bool, tools_path: str = "tools",
                  params_key: str = "function.parameters",
                  choice_path: str = "tool_choice", form: CallForm | None = None) -> str:
    """The GBNF (rule ``root``) a reply must match, or "" when nothing constrains it;
    ``form``: how the family writes one call (None: Hermes JSON). SchemaError names the
    part of the request at fault."""
    name = forced_tool(tool_choice)
    forced = tool_choice == "required" or name is not None
    offered = tools if tool_choice != "none" else None
    if forced and not tools:
        raise SchemaError(choice_path, "a forced tool call needs 'tools'")
    if forced and json_schema is not None:
        raise SchemaError(json_path, "cannot be combined with a forced tool call (the "
                          "reply is the call)")
    callable_ = _callable(tools or (), name, tools_path, choice_path) if offered else []
    if json_schema is None and not forced and (parallel or not callable_):
        return ""
    for k, t in callable_:  # checked where they sit, before they are wrapped in a call
        check_schema(_parameters(t), f"{tools_path}[{k}].{params_key}")
    if form is not None:
        return family_grammar(form, [(k, _name(t), _parameters(t)) for k, t in callable_],
                              json_schema, json_path, forced, parallel, tools_path,
                              params_key)
    parts = [SchemaPart(_call_schema(t), f"{tools_path}[{k}].{params_key}",
                        f"call-{k}") for k, t in callable_]
    if json_schema is not None:
        parts.append(SchemaPart(json_schema, json_path, "json-reply"))
    names, rules = schema_rules(parts, prop_order=("name", "arguments"))
    out = [rules]
    if callable_:
        calls = names[:len(callable_)]
        out.append(f"tool-call ::= {' | '.join(calls)}")
        out.append(f"tool-call-block ::= {literal(CALL_OPEN + chr(10))} tool-call "
                   f"{literal(chr(10) + CALL_CLOSE)}")
        many = f" ( {literal(chr(10))} tool-call-block )*" if parallel else ""
        out.append(f"tool-calls ::= tool-call-block{many}")
    if forced:
        out.append("root ::= tool-calls")
    elif json_schema is not None:
        out.append(f"root ::= {names[-1]}" + (" | tool-calls" if callable_ else ""))
    else:  # parallel_tool_calls false: text, then at most one call
        out.append(text_without("free-text", CALL_OPEN))
        out.append("root ::= free-text tool-call-block?")
    return "\n".join(out)


def _callable(tools: Sequence[Mapping[str, Any]], name: str | None, tools_path: str,
              choice_path: str) -> list[tuple[int, Mapping[str, Any]]]:
    """(index, tool) of the tools the reply may call."""
    out = [(k, t) for k, t in enumerate(tools) if name is None or _name(t) == name]
    if name is not None and not out:
        raise SchemaError(choice_path, f"no tool named {name!r} among '{tools_path}'")
    return out


def _name(tool: Mapping[str, Any]) -> str:
    return str(tool["function"]["name"])


def _parameters(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    params = tool["function"].get("parameters")
    if params is None:
        return NO_PARAMETERS
    if not isinstance(params, Mapping):
        raise SchemaError("tools", f"the parameters of {_name(tool)!r} must be an object")
    return params


def _call_schema(tool: Mapping[str, Any]) -> dict[str, Any]:
    """The JSON of one call of ``tool``, as reply.py reads it: name, then arguments."""
    return {"type": "object",
            "properties": {"name": {"const": _name(tool)},
                           "arguments": _rebase(_parameters(tool), "/properties/arguments")},
            "required": ["name", "arguments"]}


def _rebase(node: Any, at: str) -> Any:
    """``node`` with its local ``$ref``s pointing into it where it now sits (``at``)."""
    if isinstance(node, Mapping):
        return {k: (f"#{at}{v[1:]}" if k == "$ref" and isinstance(v, str) and v.startswith("#")
                    else _rebase(v, at)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rebase(v, at) for v in node]
    return node


def constraint(*, json_schema: Mapping[str, Any] | None, json_path: str,
               tools: tuple[Mapping[str, Any], ...] | None = None, tool_choice: object = None,
               parallel: bool = True, params_key: str = "function.parameters",
               form: CallForm | None = None) -> str:
    """``reply_grammar`` with its errors as 400s naming the field at fault."""
    try:
        return reply_grammar(json_schema=json_schema, json_path=json_path, tools=tools,
                             tool_choice=tool_choice, parallel=parallel,
                             params_key=params_key, form=form)
    except SchemaError as e:
        raise ApiError(str(e), _top(e.path)) from None


def spec(*, json_schema: Mapping[str, Any] | None, json_path: str,
         tools: tuple[Mapping[str, Any], ...] | None, tool_choice: object, parallel: bool,
         params_key: str, grammar: str) -> Constraint | None:
    """The request's constraint, kept to build in the family's syntax (None: none)."""
    if not grammar:
        return None
    return Constraint(json_schema, json_path, tools, tool_choice, parallel, params_key)


def in_family(chat: ChatRequest, syntax: Syntax, form: CallForm | None,
              reasoning: tuple[str, str] | None = None) -> ChatRequest:
    """``chat`` with its grammar in the template's own syntax: calls as the family writes
    them, after the reasoning its template opens (lazy, as llama.cpp's grammars are);
    ``reasoning``: the template's (ChatTemplate.grammar_reasoning)."""
    c = chat.constraint
    if c is None:
        return chat
    calls = c.tools is not None and c.tool_choice != "none" and (
        c.tool_choice == "required" or forced_tool(c.tool_choice) is not None
        or not c.parallel)
    if form is None and calls and syntax.name not in ("hermes", "none"):
        raise ApiError(f"this model writes tool calls in the {syntax.name} syntax, which "
                       "cannot be forced by a grammar here", "tool_choice")
    grammar = constraint(json_schema=c.json_schema, json_path=c.json_path, tools=c.tools,
                         tool_choice=c.tool_choice, parallel=c.parallel,
                         params_key=c.params_key, form=form if calls else None)
    return dataclasses.replace(chat, sampling=dataclasses.replace(
        chat.sampling, grammar=grammar, reasoning=reasoning))


def _top(path: str) -> str:
    """The request field a JSON path starts with ("response_format.json_schema" ->
    "response_format")."""
    for i, c in enumerate(path):
        if c in ".[":
            return path[:i]
    return path


def constrained(sampling: SamplingParams, grammar: str) -> SamplingParams:
    """``sampling`` with the reply grammar of a chat request (structured output or a
    forced tool call), which a thinking template's reasoning may precede."""
    if not grammar:
        return sampling
    if sampling.grammar:
        raise ApiError("'grammar' and 'json_schema' cannot be combined with "
                       "'response_format' or a forced 'tool_choice'", "grammar")
    return dataclasses.replace(sampling, grammar=grammar, reasoning=REASONING)


def json_format(fmt: object, param: str, *, nested: bool = True) -> Mapping[str, Any] | None:
    """The JSON schema a reply format asks for: None for text, any object for
    json_object; ``nested``: json_schema's schema sits in a "json_schema" object (chat's
    ``response_format``), else beside "type" (Responses' ``text.format``)."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return ANY_OBJECT
    if kind == "json_schema":
        assert isinstance(fmt, dict)
        spec, where = (fmt.get("json_schema"), f"{param}.json_schema") if nested \
            else (fmt, param)
        if not isinstance(spec, dict):
            raise ApiError(f"'{where}' must be an object with the 'schema'", _top(param))
        schema = spec.get("schema", ANY_OBJECT)
        if not isinstance(schema, dict):
            raise ApiError(f"'{where}.schema' must be an object (a JSON schema)", _top(param))
        return schema
    raise ApiError(f"'{param}.type' must be 'text', 'json_object' or 'json_schema'",
                   _top(param))
