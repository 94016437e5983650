"""The tool-call syntax a chat template writes, for ``statecache models``.

The one seam to the probe of issue 44 (proxy/api, not on main yet), which renders a
template with known tool calls and recognises the syntax it writes: once it is merged,
the body of ``tool_syntax`` becomes one call to it. Until then every template is
"unknown"; a model without a template is "none".
"""

from __future__ import annotations


def tool_syntax(template_source: str) -> str:
    """The name of the tool-call syntax ``template_source`` (Jinja) writes."""
    if not template_source:
        return "none"
    return "unknown"  # replaced by the probe of issue 44
