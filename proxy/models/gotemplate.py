"""Ollama's template layer, where a GGUF carries no chat template of its own.

That layer is a Go ``text/template`` (``{{ .System }}``, ``{{ range .Messages }}``), which
no Jinja renderer can run, and statecache does not translate one language into the other.
It only recognises the turn format a Go template writes, by its markers, and uses the
vendored Jinja template of that format (vendor/templates/). A Go template of no known
format is not used: the server falls back as for any GGUF without a template, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

VENDOR_TEMPLATES = Path(__file__).resolve().parents[2] / "vendor" / "templates"


@dataclass(slots=True, frozen=True)
class Mapping:
    markers: tuple[str, ...]  # text the Go template writes, all of it
    jinja: str  # the vendored template of that turn format


# The first whose markers the Go template holds.
MAPPINGS = (
    Mapping(("<|start_header_id|>",), "llama3.jinja"),  # Llama 3.x
    Mapping(("<start_of_turn>",), "gemma3.jinja"),  # Gemma 2 and 3
    Mapping(("<|im_start|>", "<think>"), "chatml-tools-think.jinja"),  # ChatML, thinking
    Mapping(("<|im_start|>",), "chatml-tools.jinja"),  # ChatML (Qwen2.5, Hermes, ...)
)


def jinja_for(go_template: str) -> Path | None:
    """The vendored Jinja template of the Go template's turn format, None if unknown."""
    for m in MAPPINGS:
        if all(marker in go_template for marker in m.markers):
            return VENDOR_TEMPLATES / m.jinja
    return None
