"""Markdown tables of the bench reports."""

from __future__ import annotations


def md_table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def streams(c: str) -> str:
    """"1 stream", "2 streams"."""
    return f"{c} stream{'s' if c != '1' else ''}"
