"""Every failure as the API's error JSON, and each request counted and kept for
``GET /admin/requests``: the app's two middlewares (``errors`` outside ``auth``).

Errors are OpenAI JSON, Anthropic's shape on ``/v1/messages*``; each rejected request is
logged at info (method, path, status, reason); never a traceback to the client.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from proxy.api.anthropic_events import error_body as anthropic_error_body
from proxy.api.appstate import (
    ACCESS,
    APP_LOG,
    FINISHED,
    LIMITS,
    METER,
    REASON,
    RECENT,
    TENANT,
)
from proxy.api.auth import AuthError, identify
from proxy.api.fields import ApiError
from proxy.api.intake import release
from proxy.api.openai_events import error_body
from proxy.engine.types import QueueFull, RequestStats

log = logging.getLogger(APP_LOG)

_UNLOGGED = ("/admin/", "/metrics", "/health")  # not kept there (polled)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def error_response(status: int, message: str, *, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None
                   ) -> web.Response:
    return web.json_response(error_body(status, message, param=param, code=code),
                             status=status, headers=headers)


def _http_error(request: web.Request, e: web.HTTPException) -> web.Response:
    headers: dict[str, str] = {}
    if isinstance(e, web.HTTPMethodNotAllowed):
        allowed = ", ".join(sorted(e.allowed_methods))
        headers["Allow"] = allowed
        msg = f"method {request.method} is not allowed on {request.path}; use {allowed}"
    elif isinstance(e, web.HTTPNotFound):
        msg = f"no such endpoint: {request.method} {request.path}"
    elif isinstance(e, web.HTTPRequestEntityTooLarge):
        msg = f"request body too large (the limit is {request.app[LIMITS].max_body:,} bytes)"
    else:
        msg = e.text or e.reason
    return error_response(e.status, msg, headers=headers)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure becomes OpenAI's error JSON; never a traceback to the client."""
    try:
        resp = await handler(request)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        resp = _http_error(request, e)
    except AuthError as e:
        resp = error_response(e.status, str(e), code="invalid_api_key" if e.status == 401
                              else "permission_denied")
    except ApiError as e:
        resp = error_response(400, str(e), param=e.param, code=e.code)
    except ValueError as e:
        resp = error_response(400, str(e))
    except QueueFull as e:
        resp = error_response(503, str(e),
                              headers={"Retry-After": str(max(1, math.ceil(e.retry_after)))})
    except TimeoutError:
        resp = error_response(504, "timed out waiting for the engine")
    except ConnectionResetError:
        log.info("%s %s: client went away", request.method, request.path)
        resp = web.Response(status=499)  # nginx's "client closed request"; nobody reads it
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        resp = error_response(500, "internal error (see the server log)")
    finally:
        release(request)
    if resp.status >= 400 and resp.status != 499 and isinstance(resp, web.Response):
        resp = _rejected(request, resp)
    route = request.match_info.route.resource
    name = route.canonical if route is not None else "unmatched"
    request.app[METER].http.inc(name, str(resp.status))
    if not request.path.startswith(_UNLOGGED):
        request.app[RECENT].append(_record(request, resp.status))
    return resp


def _record(request: web.Request, status: int) -> dict[str, Any]:
    """One request as ``GET /admin/requests`` lists it."""
    out: dict[str, Any] = {"time": time.time(), "method": request.method,
                           "path": request.path, "status": status,
                           "error": request.get(REASON)}
    done = request.get(FINISHED)
    if done is not None:
        request_id, fin = done
        out.update(request_id=request_id, prompt_tokens=fin.usage.prompt_tokens,
                   cached_tokens=fin.usage.cached_tokens, prefilled=fin.stats.prefilled,
                   output_tokens=fin.usage.completion_tokens,
                   ttft_s=round(fin.stats.ttft_s, 4), finish_reason=fin.reason,
                   # the engine's own rate, first token to last (a client's is the
                   # stream's: writes batched every server.stream_interval_ms)
                   decode_tps=round(fin.stats.decode_tps, 2),
                   drafted=fin.stats.drafted, accepted=fin.stats.accepted,
                   miss=fin.stats.miss or None,
                   shared=fin.stats.shared if fin.stats.shared >= 0 else None,
                   # the exact path: what a cold server computes, bit for bit (docs/exact.md)
                   exact=not fin.stats.breaks, exact_breaks=list(fin.stats.breaks),
                   # where the TTFT went, in ms: outside_ms is all but llama_decode's part
                   outside_ms=_ms(fin.stats.outside_s), phases_ms=_phases(fin.stats),
                   # each prefill step before the first token: [its first position, its
                   # tokens, ms inside llama_decode] (how a step's size sets its cost)
                   steps_ms=[[p, n, _ms(t)] for p, n, t in fin.stats.step_log])
    return out


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 2)


def _phases(s: RequestStats) -> dict[str, float | int]:
    """A request's TTFT by part (``GET /admin/requests``): the HTTP side (body, render,
    tokenize), the queue, the plan (hand-off and restore in it), the prefill (its steps,
    the time inside llama_decode, the checkpoints saved)."""
    return {"http": _ms(s.http_s), "render": _ms(s.render_s), "tokenize": _ms(s.tokenize_s),
            "queue": _ms(s.queue_s), "plan": _ms(s.plan_s), "hand-off": _ms(s.handoff_s),
            "restore": _ms(s.restore_s), "prefill": _ms(s.prefill_s),
            "prefill_steps": s.prefill_steps, "llama_decode": _ms(s.decode_s),
            "checkpoints": _ms(s.publish_s)}


def _rejected(request: web.Request, resp: web.Response) -> web.Response:
    """Log a rejected request (one place for all); Anthropic's routes get its error shape."""
    try:
        error = json.loads(resp.text or "")["error"]
        reason = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        return resp  # not one of ours
    log.info("rejected %s %s: %d %s", request.method, request.path, resp.status, reason)
    request[REASON] = reason
    if not request.path.startswith("/v1/messages"):
        return resp
    keep = {k: v for k, v in resp.headers.items() if k in ("Allow", "Retry-After")}
    return web.json_response(anthropic_error_body(resp.status, reason), status=resp.status,
                             headers=keep)


@web.middleware
async def auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Who is calling (proxy/api/auth.py); inside ``errors``, so refusals are JSON."""
    caller = identify(request.app[ACCESS], request.path, request.headers)
    if caller.tenant is not None:
        request[TENANT] = caller.tenant
    return await handler(request)
