"""Field validators the three APIs' parsers share (openai.py, anthropic.py, responses.py).

Every rejection is an ``ApiError`` (a ``ValueError``) that names the offending
parameter, so the app can answer 400 in the API's error shape. ``null`` on an optional
field means "absent", as OpenAI's own clients send it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

# Template variables the renderer sets itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_VARS = frozenset(
    {"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
     "raise_exception", "strftime_now"}
)
NOT_YET = "is not supported by this server yet; leave it out or send its default"
MAX_SESSION = 256


class ApiError(ValueError):
    """A request the client got wrong (HTTP 400), with the parameter at fault."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


def type_name(v: object) -> str:
    """A JSON value's type as the error messages name it ("null" for None)."""
    return "null" if v is None else type(v).__name__


def opt_str(body: Mapping[str, Any], key: str, param: str | None = None) -> str | None:
    v = body.get(key)
    if v is not None and not isinstance(v, str):
        raise ApiError(f"'{key}' must be a string, not {type_name(v)}", param or key)
    return v


def opt_bool(body: Mapping[str, Any], key: str, param: str | None = None) -> bool | None:
    v = body.get(key)
    if v is not None and not isinstance(v, bool):
        raise ApiError(f"'{key}' must be a boolean, not {type_name(v)}", param or key)
    return v


def opt_int(body: Mapping[str, Any], key: str, lo: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, float) and v.is_integer():
        v = int(v)  # JSON has one number type; 100.0 is 100
    if not isinstance(v, int) or isinstance(v, bool):
        raise ApiError(f"'{key}' must be an integer, not {type_name(v)}", key)
    if lo is not None and v < lo:
        raise ApiError(f"'{key}' must be >= {lo}, got {v}", key)
    return v


def opt_float(body: Mapping[str, Any], key: str, lo: float, hi: float,
              lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    if not isinstance(v, int | float) or isinstance(v, bool):
        raise ApiError(f"'{key}' must be a number, not {type_name(v)}", key)
    if not (lo < v if lo_open else lo <= v) or v > hi:
        bracket = "(" if lo_open else "["
        raise ApiError(f"'{key}' must be in {bracket}{lo:g}, {hi:g}], got {v}", key)
    return float(v)


def obj(v: object, param: str) -> Mapping[str, Any]:
    """``v`` when it is a JSON object."""
    if not isinstance(v, dict):
        raise ApiError(f"'{param}' must be an object, not {type_name(v)}", param)
    return v


def refuse_set(body: Mapping[str, Any], defaults: Iterable[tuple[str, object]]) -> None:
    """400 for a field (key, its default) that would not act here, set to anything but its
    default: such fields are refused by name, never accepted and ignored."""
    for key, default in defaults:
        v = body.get(key)
        if v is not None and v != default:
            raise ApiError(f"'{key}' {NOT_YET}", key)


def template_kwargs(body: Mapping[str, Any]) -> Mapping[str, Any]:
    """``chat_template_kwargs``: extra template variables, none of the renderer's own."""
    v = body.get("chat_template_kwargs")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise ApiError("'chat_template_kwargs' must be an object", "chat_template_kwargs")
    clash = sorted(RESERVED_TEMPLATE_VARS & v.keys())
    if clash:
        raise ApiError(f"'chat_template_kwargs' may not set {', '.join(clash)}",
                       "chat_template_kwargs")
    return dict(v)


def session_key(v: object, param: str) -> str | None:
    """A client's name for its conversation (``prompt_cache_key``, an agent id): a string
    of at most ``MAX_SESSION`` characters, or absent."""
    if v is None:
        return None
    if not isinstance(v, str):
        raise ApiError(f"'{param}' must be a string, not {type_name(v)}", param)
    if len(v) > MAX_SESSION:
        raise ApiError(f"'{param}' may be at most {MAX_SESSION} characters", param)
    return v or None
