"""Render chat messages to a prompt with the model's own Jinja template.

The template comes from, in order: a configured override file, the GGUF's
``tokenizer.chat_template``, or the vendored Gemma 3 fallback (the bundled model
is a base model without one). Rendering follows Hugging Face's conventions, as
llama-cpp-python's ``Jinja2ChatFormatter`` does: an immutable sandbox,
``trim_blocks``/``lstrip_blocks``, ``tojson`` with ``ensure_ascii=False``,
``raise_exception`` and ``strftime_now`` globals, ``{% generation %}`` ignored.

Messages reach the template the way HF templates read them: content as one
string, ``reasoning_content`` as a field, tool-call arguments parsed to a dict
when they are a JSON object (Qwen3 reads ``tool_call.function.arguments``,
others a top-level ``arguments``; both are set).

Reasoning is kept in the history by default, as llama-server does: when the template
reads a variable that keeps it (Qwen's ``preserve_thinking``, GLM's ``clear_thinking``),
that variable is set to keep it unless the request's template kwargs set it. Otherwise the
reasoning of earlier turns vanishes from the prompt once a new user turn arrives, and the
next request can no longer resume from the end of the previous reply.

Rendering is deterministic for templates that do not call ``strftime_now``.

System and developer messages after the first, and messages of one role in a row: the
template is probed once when it is loaded, and such messages are kept as sent where it
renders them, else folded or merged (proxy/api/inner.py, ``server.inner_system``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import SandboxedEnvironment

from proxy.api.chat import ChatMessage, ChatRequest, ToolCall
from proxy.api.conventions import (
    SUPPLIED,
    Conventions,
    adapt,
    probe_conventions,
    probe_trailer,
    reads,
    supplied_vars,
)
from proxy.api.fields import RESERVED_TEMPLATE_VARS
from proxy.api.inner import (
    fold_inner_system,
    merge_runs,
    probe_inner_system,
    should_fold,
    takes_runs,
)
from proxy.api.syntax.forms import derive_form
from proxy.api.syntax.probe import PROBE_TOOLS, grammar_reasoning, syntax_for
from proxy.api.thinking import switches_of, template_switches

VENDOR_TEMPLATES = Path(__file__).resolve().parents[2] / "vendor" / "templates"
FALLBACK_TEMPLATE = VENDOR_TEMPLATES / "gemma3.jinja"
# Template variables that keep reasoning in the history, and the value that keeps it.
KEEP_THINKING = {"preserve_thinking": True, "clear_thinking": False}


def keep_thinking_defaults(source: str) -> dict[str, bool]:
    """The variables of ``KEEP_THINKING`` that the template reads, set to keep reasoning."""
    return {name: keep for name, keep in KEEP_THINKING.items()
            if re.search(rf"\b{name}\b", source)}


class _IgnoreGeneration(jinja2.ext.Extension):
    """HF's ``{% generation %}…{% endgeneration %}`` marks training spans: render the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        parser.stream.skip(1)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Same signature and defaults as transformers' chat-template tojson; a generator (a
    # template's ``tools | map(attribute='function')``) is written as the list it yields,
    # as llama.cpp's Jinja engine does
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys, default=_listed)


def _listed(x: Any) -> Any:
    if isinstance(x, Iterator):
        return list(x)
    raise TypeError(f"Object of type {type(x).__name__} is not JSON serializable")


def _raise_exception(message: str) -> NoReturn:
    raise ValueError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template; ``origin`` says where its text came from."""

    def __init__(self, source: str, *, bos_token: str = "", eos_token: str = "",
                 origin: str = "inline", inner_system: str = "auto",
                 tool_format: str = "auto") -> None:
        # a sandbox that lets a template change its own lists (Kimi K2's templates
        # append to one, as llama.cpp's Jinja engine allows); unsafe attributes stay shut
        env = SandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True,
            extensions=[_IgnoreGeneration, jinja2.ext.loopcontrols],
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"chat template from {origin} does not compile: {e}") from e
        self.source = source
        self.origin = origin
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.defaults = keep_thinking_defaults(source)
        self.switches = switches_of(source)  # its reasoning variables (proxy/api/thinking.py)
        # how it wants a turn of tool calls written (proxy/api/conventions.py)
        self.conventions = Conventions()
        self.conventions = probe_conventions(self._render, reads(source, SUPPLIED))
        # what it writes after the last message whatever it is: not history to share
        self.trailer = probe_trailer(self._render, PROBE_TOOLS)
        # what the template does with a system message after the first, and so whether
        # such messages are folded (proxy/api/inner.py)
        self.inner = probe_inner_system(self.render)
        self.fold_inner = should_fold(inner_system, self.inner)
        # messages of one role in a row: merged where the template refuses them
        self.merge_runs = not takes_runs(self.render)
        # the family's tool-call and reasoning syntax, from what the template writes
        self.syntax = syntax_for(self.render, tool_format, (eos_token,))
        self.grammar_reasoning = grammar_reasoning(source, self.syntax)
        # how it writes one call: grammars that force calls write them so
        self.call_form = derive_form(self.render, self.syntax, (eos_token,))

    def render(self, messages: Sequence[Mapping[str, Any]], *,
               tools: Sequence[Mapping[str, Any]] | None = None,
               template_kwargs: Mapping[str, Any] | None = None,
               add_generation_prompt: bool = True) -> str:
        """The prompt text; any failure of the template is a ValueError (a 400)."""
        return self._render(adapt(messages, self.conventions), tools, add_generation_prompt,
                            self.conventions, template_kwargs)

    def _render(self, messages: Sequence[Mapping[str, Any]],
                tools: Sequence[Mapping[str, Any]] | None, add_generation_prompt: bool,
                conv: Conventions, template_kwargs: Mapping[str, Any] | None = None) -> str:
        extra = {**self.defaults, **(template_kwargs or {})}
        clash = RESERVED_TEMPLATE_VARS & extra.keys()
        if clash:
            raise ValueError(f"template kwargs may not set {', '.join(sorted(clash))}")
        extra = {**supplied_vars(conv, tools), **extra}
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                tools=[dict(t) for t in tools] if tools else None,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
                **extra,
            )
        except ValueError:
            raise  # raise_exception: the template's own message
        except (jinja2.TemplateError, TypeError, KeyError, IndexError, AttributeError) as e:
            # A template tripping over an unexpected message shape is the request's problem.
            raise ValueError(f"chat template failed: {type(e).__name__}: {e}") from e


def load_chat_template(gguf_template: str | None, *, bos_token: str, eos_token: str,
                       override: str | Path | None = None,
                       inner_system: str = "auto", tool_format: str = "auto") -> ChatTemplate:
    """The override file if given, else the GGUF's template, else the Gemma 3 fallback."""
    if override:
        path = Path(override).expanduser()
        source, origin = path.read_text(encoding="utf-8"), f"file {path}"
    elif gguf_template:
        source, origin = gguf_template, "the GGUF metadata"
    else:
        source = FALLBACK_TEMPLATE.read_text(encoding="utf-8")
        origin = f"fallback {FALLBACK_TEMPLATE.name}"
    return ChatTemplate(source, bos_token=bos_token, eos_token=eos_token, origin=origin,
                        inner_system=inner_system, tool_format=tool_format)


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


def _tool_call_json(c: ToolCall) -> dict[str, Any]:
    args = _arguments(c.arguments)
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": args},
            "arguments": args}


def template_message(m: ChatMessage) -> dict[str, Any]:
    """One message in the form HF chat templates read."""
    # Templates concatenate content with strings: an assistant turn with only
    # tool calls gets "" rather than None.
    out: dict[str, Any] = {"role": m.role, "content": m.content or ""}
    if m.name is not None:
        out["name"] = m.name
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_calls:
        out["tool_calls"] = [_tool_call_json(c) for c in m.tool_calls]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


def _same(value: Any) -> Any:
    return value


def render_chat(template: ChatTemplate, req: ChatRequest, *,
                add_generation_prompt: bool = True,
                escape: Callable[[Any], Any] = _same) -> str:
    """The prompt for a chat request, by default with the generation prompt.

    ``escape`` rewrites everything the client sent before the template sees it
    (``Literals.escape`` keeps special-token texts typed by a client plain).
    """
    messages = fold_inner_system(req.messages) if template.fold_inner else req.messages
    if template.merge_runs:
        messages = merge_runs(messages)
    kwargs = {**template_switches(req.thinking, template.switches), **req.template_kwargs}
    return template.render(escape([template_message(m) for m in messages]),
                           tools=escape(req.tools),
                           template_kwargs=escape(kwargs),
                           add_generation_prompt=add_generation_prompt)
