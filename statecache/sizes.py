"""Byte sizes and durations written by people: "512MiB", "1.5GB", "2h"."""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")
_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1000,
    "kib": 1024,
    "m": 1024**2,
    "mb": 1000**2,
    "mib": 1024**2,
    "g": 1024**3,
    "gb": 1000**3,
    "gib": 1024**3,
    "t": 1024**4,
    "tb": 1000**4,
    "tib": 1024**4,
}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_size(value: object) -> int:
    """Bytes from an int or a string like "512MiB", "8GiB", "1.5GB" (KB = 1000, KiB = 1024)."""
    if isinstance(value, bool):
        raise ValueError(f'expected a size like "8GiB", got {value!r}')
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m is not None:
            unit = _UNITS.get(m.group(2).lower())
            if unit is not None:
                return int(float(m.group(1)) * unit)
    raise ValueError(f'expected a size like "8GiB", got {value!r}')


def format_size(nbytes: int) -> str:
    """Short human size: 0 B, 12.5 KiB, 3.1 GiB."""
    if nbytes < 1024:
        return f"{nbytes} B"
    size = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{size:.1f} {unit}"


def parse_duration(value: str) -> float:
    """Seconds from "45s", "30m", "2h", "1d", "1w" or a bare number of seconds."""
    m = _DURATION_RE.match(value)
    if m is None:
        raise ValueError(f'expected a duration like "2h" or "30m", got {value!r}')
    return float(m.group(1)) * _SECONDS[m.group(2) or "s"]


def format_age(seconds: float) -> str:
    """Short human age: 12s, 5m, 3h, 2d."""
    s = max(0.0, seconds)
    if s < 60:
        return f"{s:.0f}s"
    if s < 3600:
        return f"{s / 60:.0f}m"
    if s < 86400:
        return f"{s / 3600:.1f}h"
    return f"{s / 86400:.1f}d"
