"""The aiohttp app: OpenAI chat completions and completions, Anthropic Messages and
OpenAI Responses over one engine.

A chat request is parsed (``openai``), rendered (``render``), tokenized by the
engine, checked against the context, generated, and its text split into
reasoning, content and tool calls (``reply``), as one JSON reply or as SSE.
Messages (``anthropic``) and Responses (``responses``) requests parse into the same
chat request (``chat``), so they share rendering, tokenizing, planning and the cache;
one handler serves the three, and only their event writers differ (``routes``,
``openai_events``, ``anthropic_events``, ``responses_events``).

Where the rest lives: ``appstate`` (the engine's face, limits, the app's keys),
``generation`` (tenant, session, ``max_tokens``, the engine's request), ``streaming``
(collect or stream the engine's events), ``errors`` (the error middleware, the request
log), ``admin`` (models, health, metrics, admin listings).

Choices:
- Memory per request is bounded: ``server.max_body``, ``server.parse_concurrency``
  requests read and tokenized at once (proxy/api/intake.py), a prompt past the context
  refused before it is tokenized (proxy/api/prompt.py).
- Hosted tools (Responses' web search, Anthropic's server tools) are left out of the
  prompt with one warning per type and a counter (``server.hosted_tools``).
- Every response echoes the ``X-Statecache-Session`` header and names the proxy that
  answered (``X-Statecache-Proxy``), for routing by conversation.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy.api import routes
from proxy.api.admin import (
    get_checkpoint,
    get_model,
    health,
    index,
    list_checkpoints,
    list_misses,
    list_models,
    list_requests,
    metrics,
)
from proxy.api.appstate import (
    ACCESS,
    APP_LOG,
    ENGINE,
    HOSTED_TOOLS,
    LIMITS,
    METER,
    PROMPTS,
    PROXY_HEADER,
    RECENT,
    RESPONSES,
    SEEN,
    SESSION_HEADER,
    STARTED,
    TEMPLATE,
    VOLATILE,
    WARNED,
    EngineLike,
    Limits,
)
from proxy.api.auth import Access
from proxy.api.errors import auth, errors
from proxy.api.intake import BODY_LIMIT, SLOTS
from proxy.api.misses import SeenConversations
from proxy.api.prompt_memo import PromptMemo
from proxy.api.render import load_chat_template
from proxy.api.response_store import ResponseStore
from proxy.api.ui import add_ui
from proxy.api.volatile import Volatile
from proxy.meters import ApiMeter
from statecache.config import VolatileRule

# server.py and the tests read the engine and the template through these
__all__ = ["ENGINE", "TEMPLATE", "EngineLike", "Limits", "create_app"]

log = logging.getLogger(APP_LOG)

MAX_RECENT = 256  # requests kept for GET /admin/requests


async def _routing_headers(request: web.Request, resp: web.StreamResponse) -> None:
    session = request.headers.get(SESSION_HEADER)
    if session is not None and len(session) <= 256:
        resp.headers[SESSION_HEADER] = session
    sock = request.transport.get_extra_info("sockname") if request.transport else None
    port = sock[1] if isinstance(sock, tuple) and len(sock) > 1 else ""
    resp.headers[PROXY_HEADER] = f"{socket.gethostname()}:{port}"


def create_app(engine: EngineLike, *, admin: bool = True,
               template_path: str | Path | None = None,
               limits: Limits | None = None, access: Access | None = None,
               volatile: Sequence[VolatileRule] = (), page_size: int = 32,
               inner_system: str = "auto", hosted_tools: str = "ignore",
               tool_format: str = "auto") -> web.Application:
    """The app over a started engine; ``template_path`` overrides the chat template;
    ``inner_system`` and ``hosted_tools`` are the ``[server]`` keys of those names."""
    limits = limits or Limits()
    access = access or Access()
    app = web.Application(client_max_size=limits.max_body, middlewares=[errors, auth])
    app[ENGINE] = engine
    app[LIMITS] = limits
    app[ACCESS] = access
    app[BODY_LIMIT] = limits.max_body
    app[SLOTS] = asyncio.Semaphore(limits.parse_concurrency)
    app[TEMPLATE] = load_chat_template(engine.chat_template, bos_token=engine.bos_token,
                                       eos_token=engine.eos_token, override=template_path,
                                       inner_system=inner_system, tool_format=tool_format)
    app[HOSTED_TOOLS] = hosted_tools
    app[METER] = ApiMeter()
    app[WARNED] = set()
    recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_RECENT)
    app[RECENT] = recent
    app[RESPONSES] = ResponseStore()
    app[PROMPTS] = PromptMemo()
    model = engine.tokenizer.model
    app[SEEN] = SeenConversations(page=page_size,
                                  text=lambda ids: model.detokenize(ids.tolist()))
    app[VOLATILE] = Volatile(volatile)
    app[STARTED] = int(time.time())
    app.on_response_prepare.append(_routing_headers)
    tpl = app[TEMPLATE]
    log.info("chat template: %s; tool calls and reasoning: %s syntax (%s); a system "
             "message after the first: %s by the template, %s; "
             "messages of one role in a row: %s", tpl.origin, tpl.syntax.name,
             "model.tool_format" if tool_format != "auto" else "probed from the template",
             tpl.inner.value,
             "folded into the conversation" if tpl.fold_inner else "rendered as sent",
             "merged" if tpl.merge_runs else "rendered as sent")
    app.router.add_get("/", index)
    app.router.add_post("/v1/chat/completions", routes.chat_completions)
    app.router.add_post("/v1/completions", routes.completions)
    app.router.add_post("/v1/messages", routes.messages)
    app.router.add_post("/v1/messages/count_tokens", routes.count_tokens)
    app.router.add_post("/v1/responses", routes.responses)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    if admin and access.admin_routes:
        app.router.add_get("/admin/checkpoints", list_checkpoints)
        app.router.add_get("/admin/checkpoints/{id}", get_checkpoint)
        app.router.add_get("/admin/misses", list_misses)
        app.router.add_get("/admin/requests", list_requests)
        add_ui(app, page_size)  # GET /ui and the JSON it polls
    return app
