"""``statecache serve``: load the model, start the engine, serve the app."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
import time
from collections.abc import AsyncIterator
from types import MappingProxyType

from aiohttp import web

from proxy.api.app import ENGINE, Limits, create_app
from proxy.api.auth import Access
from proxy.api.transport import JsonErrorRunner
from proxy.engine.engine import Engine
from proxy.models.names import resolve_model
from statecache.config import Config

log = logging.getLogger("statecache")

SHUTDOWN_GRACE_S = 5.0  # how long open responses may take to finish after a signal


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
    logging.getLogger("httpx2").setLevel(logging.WARNING)  # huggingface_hub's every request


def build_app(cfg: Config) -> web.Application:
    """The app with an engine whose lifetime is the app's (closed on shutdown)."""
    model = resolve_model(cfg.model.path, kv_budget=cfg.model.kv_budget)
    engine = Engine(cfg, model.path, name=model.name)
    sc = cfg.server
    limits = Limits(default_max_tokens=sc.max_tokens_default,
                    request_timeout=sc.request_timeout or None, max_body=sc.max_body,
                    parse_concurrency=sc.parse_concurrency)
    access = Access(api_keys=MappingProxyType(dict(sc.api_keys)), admin_key=sc.admin_key,
                    admin_routes=sc.admin)
    app = create_app(engine, template_path=cfg.model.chat_template or model.chat_template,
                     limits=limits, tool_format=cfg.model.tool_format,
                     access=access, volatile=cfg.server.volatile, page_size=cfg.cache.page_size,
                     inner_system=sc.inner_system, hosted_tools=sc.hosted_tools)

    async def engine_ctx(_app: web.Application) -> AsyncIterator[None]:
        yield
        log.info("shutting down: keeping lane states, writing checkpoints to disk")
        await asyncio.to_thread(engine.close)  # joins the engine thread: off the loop

    app.cleanup_ctx.append(engine_ctx)
    return app


def serve(cfg: Config) -> int:
    setup_logging(cfg.log.level)
    try:
        app = build_app(cfg)
    except (OSError, ValueError, RuntimeError) as e:  # no such model, a bad file, a refusal
        log.error("%s", e)
        return 1
    if not _is_loopback(cfg.server.host) and not cfg.server.api_keys:
        log.warning("listening on %s without server.api_keys: anyone who can reach the port "
                    "may use it and choose any tenant", cfg.server.host)
    return asyncio.run(_serve(app, cfg.server.host, cfg.server.port))


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


async def _serve(app: web.Application, host: str, port: int) -> int:
    """Serve until SIGINT or SIGTERM, then shut down gracefully and exit 0.

    On the first signal: stop admitting, end running generations at their next step
    with a final event, wait for their streams, save lane states and flush the pool.
    A second signal while that runs is noted and changes nothing: nothing is lost.
    """
    # handler_cancellation: a client that goes away cancels its handler, which stops
    # its generation, also while it is queued or prefilling.
    # JsonErrorRunner: what aiohttp refuses itself (a header too long) is JSON too.
    runner = JsonErrorRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port, shutdown_timeout=SHUTDOWN_GRACE_S)
    try:
        await site.start()
    except OSError as e:
        log.error("cannot listen on %s:%d: %s", host, port, e)
        await runner.cleanup()
        return 1
    log.info("listening on http://%s:%d", host, port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_signal(name: str) -> None:
        log.info("%s: shutting down (ending streams, saving the cache); further signals "
                 "are ignored until it is done", name)
        stop.set()
        # Ignored, not handled: a Python handler is reset to the default while the
        # interpreter exits, and a second signal then would kill it mid-flush.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal, sig.name)
    await stop.wait()
    t0 = time.monotonic()
    app[ENGINE].begin_shutdown()
    await runner.cleanup()  # waits for the streams' final events, then closes the engine
    log.info("shut down in %.1f s", time.monotonic() - t0)
    return 0
