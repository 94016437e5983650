"""The tool-call syntax a chat template writes, for ``statecache models``: the probe the
server runs when it loads a template (proxy/api/syntax/probe.py), which renders it with
known tool calls and recognises the syntax it writes. A model without a template is
"none"; a template that does not compile is "unknown".
"""

from __future__ import annotations

from proxy.api.render import ChatTemplate


def tool_syntax(template_source: str) -> str:
    """The name of the tool-call syntax ``template_source`` (Jinja) writes."""
    if not template_source:
        return "none"
    try:
        template = ChatTemplate(template_source, origin="the model's header")
    except ValueError:
        return "unknown"
    return template.syntax.name
