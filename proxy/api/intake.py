"""Reading request bodies with bounded memory.

A request holds one of ``server.parse_concurrency`` slots from before its body is read
until its prompt is tokenized (``release``, or the end of the request): the bodies of
waiting requests stay in the socket, unread, so memory grows with the slots, not with
the number of clients. A body over ``server.max_body`` is refused (413) before it is
read when its length is declared, else as soon as the limit is passed. JSON nested
deeper than ``MAX_DEPTH`` and the non-standard ``NaN``/``Infinity`` are refused (400).
"""

from __future__ import annotations

import asyncio
import json
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
