"""The routes that read rather than generate: ``/``, the model list, ``/health``,
``/metrics`` and the admin listings (checkpoints, misses, the last requests).

- ``GET /health`` answers 503 when the engine's health has ``"ok": false``.
- ``GET /`` and ``HEAD /`` (Claude Code probes it before every turn) answer a line naming
  the server and its endpoints.
- The last requests (``GET /admin/requests``): route, status and, for a generation, its
  tokens, cached tokens, TTFT and miss reason.
- ``GET /admin/checkpoints`` names the model and its disk directory beside the list, so
  ``statecache inspect --url`` reads that proxy's directory, not the default one.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from proxy.api.appstate import ENGINE, METER, RECENT, STARTED, TEMPLATE, VOLATILE
from proxy.api.errors import error_response
from proxy.meter import CONTENT_TYPE, render


def _model_card(request: web.Request) -> dict[str, object]:
    """The model as the user asked for it (``id``: what a client sends back as ``model``)
    and the file it is."""
    engine = request.app[ENGINE]
    return {"id": engine.model_name, "object": "model", "created": request.app[STARTED],
            "owned_by": "statecache", "file": engine.model_file,
            "tool_format": request.app[TEMPLATE].syntax.name}


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request)]})


async def get_model(request: web.Request) -> web.Response:
    engine = request.app[ENGINE]
    if request.match_info["model"] not in (engine.model_name, Path(engine.model_file).name):
        return error_response(404, f"no such model: {request.match_info['model']}",
                              param="model", code="model_not_found")
    return web.json_response(_model_card(request))


async def index(request: web.Request) -> web.Response:
    """``GET /`` and ``HEAD /``: what answers here."""
    text = (f"statecache serving {request.app[ENGINE].model_name}: POST /v1/chat/completions, "
            "/v1/completions, /v1/messages, /v1/messages/count_tokens, /v1/responses; "
            "GET /v1/models, /health, /metrics\n")
    return web.Response(text=text)


async def list_requests(request: web.Request) -> web.Response:
    """The last requests, oldest first: route, status, and a generation's usage."""
    recent = request.app[RECENT]
    return web.json_response({"requests": list(recent)})


async def health(request: web.Request) -> web.Response:
    body = request.app[ENGINE].health()
    return web.json_response(body, status=503 if body.get("ok") is False else 200)


async def metrics(request: web.Request) -> web.Response:
    """Prometheus' text format: the engine's families and the HTTP side's
    (proxy/meters.py)."""
    meter = request.app[METER]
    for rule, n in request.app[VOLATILE].counts().items():
        meter.volatile.put((rule,), n)
    text = render(request.app[ENGINE].metrics() + meter.families())
    return web.Response(body=text.encode(), headers={"Content-Type": CONTENT_TYPE})


async def list_checkpoints(request: web.Request) -> web.Response:
    """The pool's checkpoints (every tier), and whose they are and where its disk tier
    is: the model, its fingerprint, the directory (``statecache inspect`` reads it)."""
    engine = request.app[ENGINE]
    tiers = engine.tiers()
    return web.json_response({"checkpoints": engine.describe_checkpoints(),
                              **{k: tiers.get(k) for k in ("model", "fingerprint",
                                                           "disk_path", "disk")}})


async def list_misses(request: web.Request) -> web.Response:
    """The engine's last misses, newest first: where and why each request reused less."""
    return web.json_response({"misses": request.app[ENGINE].recent_misses()})


async def get_checkpoint(request: web.Request) -> web.Response:
    cid = request.match_info["id"]
    found = request.app[ENGINE].get_checkpoint(cid)
    if found is None:
        return error_response(404, f"no such checkpoint: {cid}", param="id")
    return web.json_response(found)
