"""How one call is written, learned from the template, for grammars that force calls.

The template renders an assistant turn with one call of a probe tool, with one string
argument and with none (probe.py's renders). Where the arguments show up as one JSON
text, the call is ``prefix NAME middle ARGUMENTS suffix`` (Hermes, DeepSeek, Kimi,
Mistral, Harmony ...). Where they do not, the two renders differ by one parameter, and
that difference is ``param_open KEY param_middle VALUE param_close`` (Qwen's XML, GLM,
MiniMax, DSML ...). The prefix starts at the family's block opener (the reasoning a
template renders before the call is left to the reasoning rule). A form is kept only
when the family's own parser reads a call written by it back (``check_form``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from proxy.api.syntax.calls import Syntax
from proxy.api.syntax.probe import PROBE_TOOLS, Render, probe_reply
from proxy.api.syntax.stream import parse

NAME, KEY, VALUE = "read_file", "path", "zqp1.py"


@dataclass(slots=True, frozen=True)
class CallForm:
    prefix: str  # from the block's opener to the function's name
    middle: str  # between the name and the arguments (or the first parameter)
    suffix: str  # after the arguments (or the last parameter)
    json_args: bool  # arguments as one JSON text; else parameters one by one
    param_open: str = ""  # before a parameter's name
    param_middle: str = ""  # between its name and its value
    param_close: str = ""  # after its value

    def write(self, name: str, args: dict[str, Any]) -> str:
        """One call as the template writes it (strings verbatim, other values JSON)."""
        if self.json_args:
            return self.prefix + name + self.middle + json.dumps(args) + self.suffix
        params = "".join(self.param_open + k + self.param_middle
                         + (v if isinstance(v, str) else json.dumps(v)) + self.param_close
                         for k, v in args.items())
        return self.prefix + name + self.middle + params + self.suffix


def _opener_at(syntax: Syntax, text: str) -> int:
    found = [i for i in (text.find(b.open) for b in syntax.blocks) if i >= 0]
    return min(found) if found else -1


def derive_form(render: Render, syntax: Syntax, stops: tuple[str, ...] = ()) -> CallForm | None:
    """The form of one call in ``syntax`` as the template renders it, or None."""
    one = probe_reply(render, (("zqcA1b2C3", {KEY: VALUE}),), stops, reasoning=None)
    none = probe_reply(render, (("zqcA1b2C3", {}),), stops, reasoning=None)
    if one is None or none is None:
        return None
    start = _opener_at(syntax, one) if syntax.blocks else 0
    at_name = one.find(NAME, max(start, 0))
    if start < 0 or at_name < 0:
        return None
    prefix = one[start:at_name]
    after = at_name + len(NAME)
    for args_text in (json.dumps({KEY: VALUE}), json.dumps({KEY: VALUE}, separators=(",", ":"))):
        at_args = one.find(args_text, after)
        if at_args >= 0:
            form = CallForm(prefix, one[after:at_args], one[at_args + len(args_text):], True)
            return form if check_form(form, syntax) else None
    # parameters one by one: the one-parameter render less the empty one
    lo = 0
    while lo < min(len(one), len(none)) and one[lo] == none[lo]:
        lo += 1
    hi = 0
    while hi < min(len(one), len(none)) - lo and one[-1 - hi] == none[-1 - hi]:
        hi += 1
    chunk = one[lo:len(one) - hi]
    at_key, at_value = chunk.find(KEY), chunk.find(VALUE)
    if lo <= after or at_key < 0 or at_value < at_key:
        return None
    form = CallForm(prefix, one[after:lo], one[len(one) - hi:], False, chunk[:at_key],
                    chunk[at_key + len(KEY):at_value], chunk[at_value + len(VALUE):])
    return form if check_form(form, syntax) else None


def check_form(form: CallForm, syntax: Syntax) -> bool:
    """Whether the family's parser reads calls written in ``form`` back as written."""
    tools = [*PROBE_TOOLS, {"type": "function", "function": {"name": "zq_other"}}]
    for name, args in ((NAME, {KEY: "a b\nc", "limit": 7}), ("zq_other", {})):
        got = parse(syntax, form.write(name, args), tools=tools, quiet=True).tool_calls
        if [(c.name, json.loads(c.arguments)) for c in got] != [(name, args)]:
            return False
    return True
