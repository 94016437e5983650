"""OpenAI-style JSON for the errors aiohttp answers before any app code runs.

A request that aiohttp's parser refuses (a header line over its limit, a malformed
request line) never reaches the app's middleware: aiohttp answers it itself, in plain
text. ``JsonErrorRunner`` serves an app with a request handler whose error answers are
OpenAI's error JSON instead, logged like every other rejected request.
"""

from __future__ import annotations

import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.http_exceptions import BadHttpMessage, LineTooLong
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from proxy.api.openai_events import error_body

log = logging.getLogger(__name__)


def _status_and_message(status: int, exc: BaseException | None) -> tuple[int, str]:
    if isinstance(exc, LineTooLong):
        return 431, f"request header too large: {exc.message}"
    if isinstance(exc, BadHttpMessage):
        return status, f"malformed HTTP request: {exc.message}"
    if status >= 500:
        return status, "internal error (see the server log)"
    try:
        return status, HTTPStatus(status).phrase
    except ValueError:
        return status, "bad request"


class _JsonErrorHandler(RequestHandler):
    def handle_error(self, request: BaseRequest, status: int = 500,
                     exc: BaseException | None = None,
                     message: str | None = None) -> web.StreamResponse:
        if request.writer.output_size > 0:  # as aiohttp: too late for another response
            raise ConnectionError("a response was already sent; cannot send the error")
        status, text = _status_and_message(status, exc)
        if status >= 500:
            log.error("%s %s failed", request.method, request.path, exc_info=exc)
        else:  # the request line was not parsed: no method or path to tell
            log.info("rejected a malformed request from %s: %d %s", request.remote, status, text)
        resp = web.json_response(error_body(status, text), status=status)
        resp.force_close()
        return resp


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class JsonErrorRunner(web.AppRunner):
    """An ``AppRunner`` whose transport-level errors are OpenAI error JSON."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        server.__class__ = _JsonErrorServer  # the same object, making JSON error handlers
        return server
