"""Reading request bodies with bounded memory.

A request holds one of ``server.parse_concurrency`` slots from before its body is read
until its prompt is tokenized (``release``, or the end of the request): the bodies of
waiting requests stay in the socket, unread, so memory grows with the slots, not with
the number of clients. A body over ``server.max_body`` is refused (413) before it is
read when its length is declared, else as soon as the limit is passed. JSON nested
deeper than ``MAX_DEPTH`` and the non-standard ``NaN``/``Infinity`` are refused (400),
and so is a string (a key or a value) that holds a lone UTF-16 surrogate: JSON's
``"\\ud800"`` parses, but it is no character and no text can be made of it (the
tokenizer and the cache's hashes encode text as UTF-8). Bodies are searched for one only
when their bytes could hold one (a ``\\u`` escape of a surrogate, the bytes of one, or a
body that is not UTF-8).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import NoReturn

from aiohttp import web

from proxy.api.fields import ApiError

MAX_DEPTH = 64  # OpenAI's own schemas nest a few levels; tool schemas a dozen at most
BODY_TIMEOUT_S = 60.0  # a client that sends its body slower than this frees its slot

SLOTS = web.AppKey("parse_slots", asyncio.Semaphore)
BODY_LIMIT = web.AppKey("body_limit", int)  # server.max_body, also the app's client_max_size
_HELD = web.RequestKey("parse_slot_held", bool)


async def read_json(request: web.Request) -> object:
    """The body as JSON, read while holding a parse slot (kept until ``release``)."""
    limit = request.app[BODY_LIMIT]
    if request.content_length is not None and request.content_length > limit:
        raise web.HTTPRequestEntityTooLarge(max_size=limit, actual_size=request.content_length)
    if not request.get(_HELD):
        await request.app[SLOTS].acquire()
        request[_HELD] = True
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            raw = await request.read()  # HTTPRequestEntityTooLarge past the limit
    except TimeoutError:
        raise web.HTTPRequestTimeout(
            text=f"the request body did not arrive within {BODY_TIMEOUT_S:g} s") from None
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise ApiError(f"the request body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as e:
        raise ApiError(f"the request body is not valid JSON: {e}") from None
    check_depth(body)
    if may_hold_surrogates(raw):
        check_text(body)
    return body


def release(request: web.Request) -> None:
    """Give the request's parse slot back (idempotent): its prompt is tokenized."""
    if request.get(_HELD):
        request[_HELD] = False
        request.app[SLOTS].release()


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def check_depth(value: object, limit: int = MAX_DEPTH) -> None:
    """ApiError when lists and objects nest deeper than ``limit`` (iterative: no recursion)."""
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, dict):
            children: list[object] = list(v.values())
        elif isinstance(v, list):
            children = v
        else:
            continue
        if depth > limit:
            raise ApiError(f"the request body nests deeper than {limit} levels")
        stack.extend((c, depth + 1) for c in children)


# A JSON escape of a surrogate (\ud800 to \udfff, any case), and the bytes of one (UTF-8
# forbids them; json.loads lets them through). About 2 ms a MB of code on one core, a
# fourth to a half of json.loads; the bytes' search runs only where \xed occurs at all.
_ESCAPED = re.compile(rb"\\u[dD][89a-fA-F]")
_ENCODED = re.compile(rb"\xed[\xa0-\xbf]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_KEY_CHARS = 64  # of a key, in the parameter an error names


def may_hold_surrogates(raw: bytes) -> bool:
    """Whether a JSON body's bytes could parse into a string with a lone surrogate."""
    return (_ESCAPED.search(raw) is not None
            or (b"\xed" in raw and _ENCODED.search(raw) is not None)
            or json.detect_encoding(raw) not in ("utf-8", "utf-8-sig"))


def check_text(value: object) -> None:
    """ApiError naming the first string (a key or a value) that holds a lone surrogate
    (json.loads joins the halves of a pair, so any surrogate left is alone)."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            _check_str(v, f"'{at}'" if at else "the body", at or None)
        elif isinstance(v, dict):
            for key in v:
                _check_str(key, f"a key of '{at}'" if at else "a top-level key", at or None)
            stack.extend((c, f"{at}.{k[:_KEY_CHARS]}" if at else k[:_KEY_CHARS])
                         for k, c in reversed(v.items()))
        elif isinstance(v, list):
            stack.extend((c, f"{at}[{i}]") for i, c in reversed(list(enumerate(v))))


def _check_str(s: str, where: str, param: str | None) -> None:
    found = _SURROGATE.search(s)
    if found is not None:
        raise ApiError(f"{where} holds a lone UTF-16 surrogate (U+{ord(found[0]):04X}), "
                       "which is not a character: send text as UTF-8, and surrogates only "
                       "in pairs", param)
