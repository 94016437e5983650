"""``statecache serve``: load the model, start the engine, serve the app."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from aiohttp import web

from proxy.api.app import Limits, create_app
from proxy.engine.scheduler import Engine
from proxy.models import resolve_model
from statecache.config import Config

log = logging.getLogger("statecache")


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)


def build_app(cfg: Config) -> web.Application:
    """The app with an engine whose lifetime is the app's (closed on shutdown)."""
    engine = Engine(cfg, resolve_model(cfg.model.path))
    limits = Limits(default_max_tokens=cfg.server.max_tokens_default,
                    request_timeout=cfg.server.request_timeout or None)
    app = create_app(engine, template_path=cfg.model.chat_template or None, limits=limits)

    async def engine_ctx(_app: web.Application) -> AsyncIterator[None]:
        yield
        log.info("shutting down: keeping lane states, writing checkpoints to disk")
        engine.close()

    app.cleanup_ctx.append(engine_ctx)
    return app


def serve(cfg: Config) -> int:
    setup_logging(cfg.log.level)
    try:
        app = build_app(cfg)
    except (FileNotFoundError, ValueError, RuntimeError) as e:
        log.error("%s", e)
        return 1
    log.info("listening on http://%s:%d", cfg.server.host, cfg.server.port)
    web.run_app(app, host=cfg.server.host, port=cfg.server.port, print=None,
                shutdown_timeout=10.0, handle_signals=True)
    return 0
