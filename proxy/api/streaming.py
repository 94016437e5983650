"""A generation's events from the engine to the client: collected into one reply, or
written as server-sent events.

A stream waits for the engine's first event before it sends its headers, so that a full
queue (503) or a refused request (400) still gets its status. A failure after that goes
out as the API's error event. A client that goes away closes the engine's generator,
which stops generation; a finished reply is remembered with its conversation (the miss
reasons of proxy/api/misses.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, Protocol

from aiohttp import web

from proxy.api.appstate import APP_LOG, CONVERSATION, ENGINE, FINISHED, LIMITS, SEEN
from proxy.engine.types import (
    Event,
    FinishEvent,
    GenerationRequest,
    StartEvent,
    TokenEvent,
    TokenLogprob,
)

log = logging.getLogger(APP_LOG)

JSON = dict[str, Any]


class Chunks(Protocol):
    """What one streaming endpoint sends: at the start, per text delta, at the end, and
    on a failure once the stream is open; and how.

    ``early``: the start goes out once the request has a lane and its plan (Anthropic's
    ``message_start`` carries the cached tokens); else with the first token, so a
    client's first chunk stays its first token. ``named``: each event is named after its
    ``type`` (Anthropic, Responses), else bare ``data:`` lines (OpenAI). ``end``: written
    after the last event (OpenAI's ``data: [DONE]``)."""

    early: bool
    named: bool
    end: bytes

    def start(self, started: StartEvent | None = None) -> list[JSON]: ...
    def text(self, text: str, logprobs: tuple[TokenLogprob, ...] = ()) -> list[JSON]: ...
    def finish(self, fin: FinishEvent) -> list[JSON]: ...
    def error(self, status: int, message: str) -> JSON: ...


async def generate(request: web.Request, gen: GenerationRequest) -> AsyncIterator[Event]:
    """The engine's events; a finished reply is remembered with its conversation."""
    ids: list[int] = []
    parts: list[str] = []
    async with closing(request.app[ENGINE].generate(gen)) as events:
        async for ev in events:
            if isinstance(ev, TokenEvent):
                ids.extend(ev.token_ids)
                parts.append(ev.text)
            elif isinstance(ev, FinishEvent):
                request[FINISHED] = (gen.request_id, ev)
                if CONVERSATION in request:
                    request.app[SEEN].remember(request[CONVERSATION], "".join(parts), ids)
            yield ev


@asynccontextmanager
async def closing(events: AsyncIterator[Event]) -> AsyncIterator[AsyncIterator[Event]]:
    """Close the engine's generator however we leave: that is what stops generation."""
    try:
        yield events
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()


def _gone(request: web.Request) -> bool:
    return request.transport is None or request.transport.is_closing()


def _log_finish(gen: GenerationRequest, fin: FinishEvent) -> None:
    # Debug only: the engine writes the one info line per request.
    u, s = fin.usage, fin.stats
    log.debug("%s prompt=%d cached=%d completion=%d finish=%s source=%s role=%s prefilled=%d "
             "ttft=%.3fs tenant=%r", gen.request_id, u.prompt_tokens, u.cached_tokens,
             u.completion_tokens, fin.reason, s.source, s.role or "-", s.prefilled, s.ttft_s,
             gen.tenant)


async def collect(request: web.Request, gen: GenerationRequest
                  ) -> tuple[str, FinishEvent, list[TokenLogprob] | None]:
    """The whole reply's text, its end, and its tokens' logprobs if the request asked."""
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    async with asyncio.timeout(request.app[LIMITS].request_timeout), \
            closing(generate(request, gen)) as events:
        async for ev in events:
            if isinstance(ev, FinishEvent):
                _log_finish(gen, ev)
                return "".join(parts), ev, (logprobs if gen.sampling.logprobs is not None
                                            else None)
            if isinstance(ev, TokenEvent):
                parts.append(ev.text)
                logprobs.extend(ev.logprobs)
            if _gone(request):
                raise ConnectionResetError("client went away")
    raise RuntimeError("the engine's event stream ended without a FinishEvent")


# one encoder for every stream event (json.dumps with arguments builds one per call)
_EVENT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


async def _send(resp: web.StreamResponse, obj: JSON, named: bool = False) -> None:
    data = _EVENT_JSON.encode(obj)
    head = f"event: {obj['type']}\n" if named else ""
    await resp.write(f"{head}data: {data}\n\n".encode())


async def stream(request: web.Request, gen: GenerationRequest, chunks: Chunks
                 ) -> web.StreamResponse:
    """The reply as server-sent events, written by ``chunks``."""
    async with closing(generate(request, gen)) as events:
        # Wait for the first event before sending headers, so that QueueFull and
        # ValueError still become a 503 / 400 status.
        async with asyncio.timeout(request.app[LIMITS].request_timeout):
            ev: Event | None = await anext(events, None)
            started = ev if isinstance(ev, StartEvent) else None
            if started is not None and not chunks.early:
                ev = await anext(events, None)  # the stream opens with the first token
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache",
                                           "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        try:
            for obj in chunks.start(started):
                await _send(resp, obj, chunks.named)
            if isinstance(ev, StartEvent):
                ev = await anext(events, None)
            while ev is not None:
                if isinstance(ev, FinishEvent):
                    _log_finish(gen, ev)
                    for obj in chunks.finish(ev):
                        await _send(resp, obj, chunks.named)
                    await resp.write(chunks.end)
                    return resp
                if isinstance(ev, TokenEvent):
                    for obj in chunks.text(ev.text, ev.logprobs):
                        await _send(resp, obj, chunks.named)
                if _gone(request):
                    raise ConnectionResetError("client went away")
                ev = await anext(events, None)
            raise RuntimeError("the engine's event stream ended without a FinishEvent")
        except ConnectionResetError:
            log.info("%s: client went away; generation stopped", gen.request_id)
            return resp
        except Exception as e:
            # Headers are sent: the error travels as an event, as OpenAI's API does.
            status = 400 if isinstance(e, ValueError) else 500
            if status == 500:
                log.exception("%s failed while streaming", gen.request_id)
            else:
                log.info("rejected %s %s while streaming: %s", request.method, request.path, e)
            msg = str(e) if status == 400 else "internal error (see the server log)"
            await _send(resp, chunks.error(status, msg), chunks.named)
            return resp
