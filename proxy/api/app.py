"""The aiohttp app: OpenAI chat completions and completions, Anthropic Messages and
OpenAI Responses over one engine.

A chat request is parsed (``openai``), rendered (``render``), tokenized by the
engine, checked against the context, generated, and its text split into
reasoning, content and tool calls (``reply``), as one JSON reply or as SSE.
Messages (``anthropic``) and Responses (``responses``) requests parse into the same
chat request, so they share rendering, tokenizing, planning and the cache; only
their event writers differ (``anthropic_events``, ``responses_events``).

Choices:
- ``max_tokens`` absent: ``min(n_ctx - prompt_tokens, server.max_tokens_default)``, so a
  reply never runs past the context and a forgotten limit does not run for minutes.
- The tenant (cache namespace) is the API key's when keys are configured
  (proxy/api/auth.py), else the ``X-Statecache-Tenant`` header, else the request's
  ``user`` field, else "".
- Memory per request is bounded: ``server.max_body``, ``server.parse_concurrency``
  requests read and tokenized at once (proxy/api/intake.py), a prompt past the context
  refused before it is tokenized (proxy/api/prompt.py).
- ``/v1/completions`` prepends the engine's ``bos_token`` to the prompt unless it
  already starts with it (the engine's tokenize adds none).
- Errors are OpenAI JSON, Anthropic's shape on ``/v1/messages*``; each rejected request
  is logged at info (method, path, status, reason). A failure after an SSE stream
  started is sent as the API's error event. A client that goes away closes the
  engine's generator, which stops generation.
- ``GET /health`` answers 503 when the engine's health has ``"ok": false``.
- ``GET /`` and ``HEAD /`` (Claude Code probes it before every turn) answer a line naming
  the server and its endpoints.
- Hosted tools (Responses' web search, Anthropic's server tools) are left out of the
  prompt with one warning per type and a counter (``server.hosted_tools``).
- The conversation a request belongs to (its session, for lane affinity and miss
  reasons): the ``X-Statecache-Session`` header, else Claude Code's agent id header (a
  subagent is a conversation of its own), else its session id header, else what the
  body names (Codex's ``prompt_cache_key``, Anthropic's ``metadata.user_id``).
- The last requests (``GET /admin/requests``): route, status and, for a generation, its
  tokens, cached tokens, TTFT and miss reason.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import math
import secrets
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web

from proxy.api.anthropic import fit_max_tokens, parse_messages_request, unbounded
from proxy.api.anthropic_events import MessageEvents, message_body, new_tool_use_id
from proxy.api.anthropic_events import error_body as anthropic_error_body
from proxy.api.auth import Access, AuthError, identify
from proxy.api.chat import ChatRequest
from proxy.api.fields import ApiError
from proxy.api.intake import BODY_LIMIT, SLOTS, read_json, release
from proxy.api.misses import (
    Conversation,
    SeenConversations,
    chat_conversation,
    prompt_conversation,
)
from proxy.api.openai import parse_chat_request, parse_completion_request
from proxy.api.openai_events import ChatChunks, Chunks, CompletionChunks, error_body
from proxy.api.prompt import Prompt, chat_prompt, completion_prompt
from proxy.api.render import ChatTemplate, load_chat_template
from proxy.api.reply import Delta, StreamParser, parse_reply, starts_in_reasoning
from proxy.api.responses import ResponseStore, chat_request, parse_responses_request
from proxy.api.responses_events import (
    ResponseEvents,
    assistant_message,
    finished,
    output_items,
    response_head,
)
from proxy.api.sampling import to_params
from proxy.api.volatile import Volatile
from proxy.engine.tokens import Tokenizer
from proxy.engine.types import (
    Event,
    FinishEvent,
    GenerationRequest,
    QueueFull,
    SamplingParams,
    StartEvent,
    TokenEvent,
    TokenLogprob,
)
from proxy.meter import CONTENT_TYPE, Family, render
from proxy.meters import ApiMeter
from statecache.config import VolatileRule

log = logging.getLogger(__name__)

MAX_BODY = 8 * 1024 * 1024
DEFAULT_MAX_TOKENS = 2048
TENANT_HEADER = "X-Statecache-Tenant"
# Routing by conversation (README, "Several machines"): a load balancer hashes this
# header, which clients set to a stable id per conversation; every response echoes it
# and names the proxy that answered.
SESSION_HEADER = "X-Statecache-Session"
PROXY_HEADER = "X-Statecache-Proxy"
# Claude Code names each subagent's conversation (its main agent's requests carry none),
# and each session (its subagents' requests carry their session's too)
AGENT_HEADER = "X-Claude-Code-Agent-Id"
CLAUDE_SESSION_HEADER = "X-Claude-Code-Session-Id"
MAX_RECENT = 256  # requests kept for GET /admin/requests
MAX_TOOL_TYPES = 32  # hosted tool types counted apart (the rest: "other")
_UNLOGGED = ("/admin/", "/metrics", "/health")  # not kept there (polled)


class EngineLike(Protocol):
    model_name: str
    n_ctx: int
    chat_template: str | None
    bos_token: str
    eos_token: str

    tokenizer: Tokenizer
    def generate(self, req: GenerationRequest) -> AsyncIterator[Event]: ...
    def describe_checkpoints(self) -> list[dict[str, Any]]: ...
    def get_checkpoint(self, id: str) -> dict[str, Any] | None: ...
    def metrics(self) -> list[Family]: ...
    def health(self) -> dict[str, Any]: ...
    def recent_misses(self) -> list[dict[str, Any]]: ...
    # Stop admitting; running generations end at their next step with a final event.
    def begin_shutdown(self) -> None: ...


ENGINE = web.AppKey("engine", EngineLike)
TEMPLATE = web.AppKey("template", ChatTemplate)
RESPONSES = web.AppKey("responses", ResponseStore)
STARTED = web.AppKey("started", int)
SEEN = web.AppKey("seen", SeenConversations)  # what was rendered: why a request missed
VOLATILE = web.AppKey("volatile", Volatile)
CONVERSATION = web.RequestKey("conversation", Conversation)  # remembered once replied
HOSTED_TOOLS = web.AppKey("hosted_tools", str)  # "ignore" | "reject"
METER = web.AppKey("meter", ApiMeter)  # the HTTP side's counters, for /metrics
WARNED = web.AppKey("warned", set)  # hosted tool types warned about once
# the last requests, newest last
RECENT: web.AppKey[collections.deque[dict[str, Any]]] = web.AppKey("recent", collections.deque)
FINISHED = web.RequestKey("finished", tuple)  # (request id, its FinishEvent)
REASON = web.RequestKey("reason", str)  # why a request was refused


@dataclass(slots=True, frozen=True)
class Limits:
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # when a request names none
    request_timeout: float | None = None  # seconds a reply (or a stream's start) may take
    max_body: int = MAX_BODY  # bytes; a larger body gets 413
    parse_concurrency: int = 2  # requests read, parsed and tokenized at the same time


LIMITS = web.AppKey("limits", Limits)
ACCESS = web.AppKey("access", Access)
TENANT = web.RequestKey("tenant", str)  # set when the tenant comes from the API key


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


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
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
                   miss=fin.stats.miss or None)
    return out


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
async def _auth(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Who is calling (proxy/api/auth.py); inside ``_errors``, so refusals are JSON."""
    caller = identify(request.app[ACCESS], request.path, request.headers)
    if caller.tenant is not None:
        request[TENANT] = caller.tenant
    return await handler(request)


async def _json_body(request: web.Request) -> object:
    # Holds a parse slot until _generation (or the end of the request) gives it back.
    return await read_json(request)


def _tenant(request: web.Request, user: str | None) -> str:
    """The API key's tenant when keys are configured, never what the request says."""
    if TENANT in request:
        return request[TENANT]
    return request.headers.get(TENANT_HEADER) or user or ""


def _max_tokens(n_ctx: int, n_prompt: int, asked: int | None, param: str,
                default: int = DEFAULT_MAX_TOKENS) -> int:
    if asked is not None:
        if n_prompt + asked > n_ctx:
            raise ApiError(f"this model's context is {n_ctx} tokens; the prompt has {n_prompt} "
                           f"and max_tokens is {asked}", param, "context_length_exceeded")
        return asked
    if n_prompt >= n_ctx:
        raise ApiError(f"this model's context is {n_ctx} tokens; the prompt has {n_prompt}, "
                       "which leaves no room for a reply", param, "context_length_exceeded")
    return min(n_ctx - n_prompt, default)


def _tokenize_chat(engine: EngineLike, template: ChatTemplate, req: ChatRequest,
                   tenant: str) -> Prompt:
    """The prompt, its tokens, the tokens of the history before the generation prompt,
    and where it may be shared or kept.

    Client text stays text, a prompt past the context is refused before it is
    tokenized, and it is tokenized once (proxy/api/prompt.py).
    """
    return chat_prompt(engine.tokenizer, template, req, tenant, engine.n_ctx)


def _session(request: web.Request, named: str | None) -> str | None:
    """The conversation this request belongs to: a header, else what its body names."""
    for header in (SESSION_HEADER, AGENT_HEADER, CLAUDE_SESSION_HEADER):
        value = request.headers.get(header)
        if value and len(value) <= 256:
            return f"{header.lower()}:{value}"
    return named


def _ignored_tools(request: web.Request, kinds: Sequence[str]) -> None:
    """Count the hosted tools a request sent that were left out; warn once per type."""
    warned = request.app[WARNED]
    for kind in (k[:64] for k in kinds):
        if kind not in warned and len(warned) >= MAX_TOOL_TYPES:
            kind = "other"  # a client's strings: the counters stay bounded
        request.app[METER].hosted_tools.inc(kind)
        if kind not in warned:
            warned.add(kind)
            log.warning("left the hosted tool of type %r out of the prompt: this server runs "
                        "only the client's own tools (server.hosted_tools = \"reject\" "
                        "refuses such requests instead)", kind)


def _chat_generation(request: web.Request, p: Prompt, req: ChatRequest, prefix: str,
                     param: str, tenant: str, max_tokens: int | None = None
                     ) -> GenerationRequest:
    """``max_tokens``: the request's own when None."""
    session = _session(request, req.session)
    asked = req.max_tokens if max_tokens is None else max_tokens
    return _generation(request, p.tokens, req.sampling, asked, prefix, param, tenant,
                       p.history,
                       chat_conversation(tenant, req, p.tokens, p.text, p.history, session),
                       share_points=p.share_points, breakpoints=p.breakpoints,
                       session=session)


def _generation(request: web.Request, tokens: list[int], sampling: SamplingParams,
                asked: int | None, prefix: str, param: str, tenant: str,
                history: int | None = None,
                seen: Conversation | None = None, *, share_points: tuple[int, ...] = (),
                breakpoints: tuple[tuple[int, float], ...] = (),
                session: str | None = None) -> GenerationRequest:
    release(request)  # the prompt is tokenized: the next request may be parsed
    max_tokens = _max_tokens(request.app[ENGINE].n_ctx, len(tokens), asked, param,
                             request.app[LIMITS].default_max_tokens)
    divergence = None
    if seen is not None:  # where it leaves what was sent before (the engine reports misses)
        divergence = request.app[SEEN].divergence(seen)
        request[CONVERSATION] = seen
    gen = GenerationRequest(request_id=f"{prefix}-{secrets.token_hex(12)}",
                            prompt_tokens=tuple(tokens), sampling=to_params(sampling, max_tokens),
                            tenant=tenant, history_tokens=history, divergence=divergence,
                            share_points=share_points, breakpoints=breakpoints,
                            session=session)
    if divergence is not None:
        log.debug("%s: %s", gen.request_id, divergence.describe())
    return gen


async def _generate(request: web.Request, gen: GenerationRequest) -> AsyncIterator[Event]:
    """The engine's events; a finished reply is remembered with its conversation."""
    ids: list[int] = []
    parts: list[str] = []
    async with _closing(request.app[ENGINE].generate(gen)) as events:
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
async def _closing(events: AsyncIterator[Event]) -> AsyncIterator[AsyncIterator[Event]]:
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


async def _collect(request: web.Request, gen: GenerationRequest
                   ) -> tuple[str, FinishEvent, list[TokenLogprob] | None]:
    parts: list[str] = []
    logprobs: list[TokenLogprob] = []
    async with asyncio.timeout(request.app[LIMITS].request_timeout), \
            _closing(_generate(request, gen)) as events:
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


def _openai_stream_error(status: int, message: str) -> dict[str, Any]:
    return error_body(status, message)


@dataclass(slots=True, frozen=True)
class Framing:
    """How a stream is written: OpenAI's bare ``data:`` lines ending in ``[DONE]``, or
    events named after their ``type`` (Anthropic, Responses); and its error event."""

    named: bool = False
    end: bytes = b"data: [DONE]\n\n"
    error: Callable[[int, str], dict[str, Any]] = _openai_stream_error


OPENAI_SSE = Framing()


# one encoder for every stream event (json.dumps with arguments builds one per call)
_EVENT_JSON = json.JSONEncoder(ensure_ascii=False, separators=(",", ":"))


async def _send(resp: web.StreamResponse, obj: dict[str, Any], named: bool = False) -> None:
    data = _EVENT_JSON.encode(obj)
    head = f"event: {obj['type']}\n" if named else ""
    await resp.write(f"{head}data: {data}\n\n".encode())


async def _stream(request: web.Request, gen: GenerationRequest, chunks: Chunks,
                  framing: Framing = OPENAI_SSE) -> web.StreamResponse:
    async with _closing(_generate(request, gen)) as events:
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
                await _send(resp, obj, framing.named)
            if isinstance(ev, StartEvent):
                ev = await anext(events, None)
            while ev is not None:
                if isinstance(ev, FinishEvent):
                    _log_finish(gen, ev)
                    for obj in chunks.finish(ev):
                        await _send(resp, obj, framing.named)
                    await resp.write(framing.end)
                    return resp
                if isinstance(ev, TokenEvent):
                    for obj in chunks.text(ev.text, ev.logprobs):
                        await _send(resp, obj, framing.named)
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
            await _send(resp, framing.error(status, msg), framing.named)
            return resp


async def chat_completions(request: web.Request) -> web.StreamResponse:
    req = request.app[VOLATILE].apply(parse_chat_request(await _json_body(request)))
    engine, tenant = request.app[ENGINE], _tenant(request, req.user)
    # Rendering and tokenizing a long conversation takes a while: off the event loop.
    p = await asyncio.to_thread(_tokenize_chat, engine, request.app[TEMPLATE], req, tenant)
    gen = _chat_generation(request, p, req, "chatcmpl", "messages", tenant)
    in_reasoning = starts_in_reasoning(p.text)
    if req.stream:
        parser = StreamParser(starts_in_reasoning=in_reasoning, parse_tools=req.parse_tools)
        return await _stream(request, gen, ChatChunks(gen.request_id, engine.model_name, parser,
                                                      req.include_usage))
    text, fin, logprobs = await _collect(request, gen)
    reply = parse_reply(text, starts_in_reasoning=in_reasoning, parse_tools=req.parse_tools)
    return web.json_response(ChatChunks.completion(gen.request_id, engine.model_name, reply, fin,
                                                   logprobs))


async def completions(request: web.Request) -> web.StreamResponse:
    req = parse_completion_request(await _json_body(request))
    engine, tenant = request.app[ENGINE], _tenant(request, req.user)
    bos = engine.bos_token
    prompt = req.prompt if not bos or req.prompt.startswith(bos) else bos + req.prompt
    tokens = await asyncio.to_thread(completion_prompt, engine.tokenizer, prompt, tenant,
                                     engine.n_ctx, req.max_tokens)
    gen = _generation(request, tokens, req.sampling, req.max_tokens, "cmpl", "prompt", tenant,
                      seen=prompt_conversation(tenant, prompt, tokens))
    chunks = CompletionChunks(gen.request_id, engine.model_name, req.include_usage)
    if req.stream:
        return await _stream(request, gen, chunks)
    text, fin, logprobs = await _collect(request, gen)
    return web.json_response(chunks.completion(text, fin, logprobs))


def _parse_all(parser: StreamParser, text: str) -> Delta:
    reply = parser.feed(text)
    reply.extend(parser.finish())
    return reply


async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic Messages: the chat path, written as Messages events."""
    req = request.app[VOLATILE].apply(parse_messages_request(
        await _json_body(request), hosted_tools=request.app[HOSTED_TOOLS]))
    _ignored_tools(request, req.ignored_tools)
    engine, tenant = request.app[ENGINE], _tenant(request, None)
    p = await asyncio.to_thread(_tokenize_chat, engine, request.app[TEMPLATE], unbounded(req),
                                tenant)
    max_tokens = fit_max_tokens(req.max_tokens, engine.n_ctx, len(p.tokens))
    window = max_tokens != req.max_tokens
    gen = _chat_generation(request, p, req, "msg", "messages", tenant, max_tokens)
    parser = StreamParser(starts_in_reasoning=starts_in_reasoning(p.text),
                          parse_tools=req.parse_tools, make_id=new_tool_use_id)
    if req.stream:
        events = MessageEvents(gen.request_id, engine.model_name, parser, len(p.tokens),
                               window)
        return await _stream(request, gen, events, Framing(True, b"", events.error))
    text, fin, _ = await _collect(request, gen)
    return web.json_response(message_body(gen.request_id, engine.model_name,
                                          _parse_all(parser, text), fin, window))


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's ``count_tokens``: the prompt's length as rendered and tokenized here."""
    req = request.app[VOLATILE].apply(parse_messages_request(
        await _json_body(request), count_only=True, hosted_tools=request.app[HOSTED_TOOLS]))
    p = await asyncio.to_thread(_tokenize_chat, request.app[ENGINE], request.app[TEMPLATE],
                                req, _tenant(request, None))
    return web.json_response({"input_tokens": len(p.tokens)})


async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI Responses: the chat path over the stored history, written as Responses events."""
    req = parse_responses_request(await _json_body(request),
                                  hosted_tools=request.app[HOSTED_TOOLS])
    _ignored_tools(request, req.ignored_tools)
    engine, tenant, store = request.app[ENGINE], _tenant(request, req.user), request.app[RESPONSES]
    history = store.history(req.previous_response_id, tenant) if req.previous_response_id else ()
    chat = request.app[VOLATILE].apply(chat_request(req, history))
    p = await asyncio.to_thread(_tokenize_chat, engine, request.app[TEMPLATE], chat, tenant)
    gen = _chat_generation(request, p, chat, "resp", "input", tenant)
    parser = StreamParser(starts_in_reasoning=starts_in_reasoning(p.text),
                          parse_tools=req.parse_tools)
    head = response_head(gen.request_id, engine.model_name, req)
    resp: web.StreamResponse
    if req.stream:
        events = ResponseEvents(head, parser, req.namespaces)
        resp = await _stream(request, gen, events, Framing(True, b"", events.error))
        final, reply = events.final, events.reply
    else:
        text, fin, _ = await _collect(request, gen)
        reply = _parse_all(parser, text)
        final = finished(head, output_items(reply, req.namespaces), fin)
        resp = web.json_response(final)
    if final is not None and req.store:
        store.put(gen.request_id, tenant, req.previous_response_id,
                  req.messages + (assistant_message(reply),))
    return resp


def _model_card(request: web.Request) -> dict[str, object]:
    return {"id": request.app[ENGINE].model_name, "object": "model",
            "created": request.app[STARTED], "owned_by": "statecache"}


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": [_model_card(request)]})


async def get_model(request: web.Request) -> web.Response:
    if request.match_info["model"] != request.app[ENGINE].model_name:
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
    return web.json_response({"checkpoints": request.app[ENGINE].describe_checkpoints()})


async def list_misses(request: web.Request) -> web.Response:
    """The engine's last misses, newest first: where and why each request reused less."""
    return web.json_response({"misses": request.app[ENGINE].recent_misses()})


async def get_checkpoint(request: web.Request) -> web.Response:
    cid = request.match_info["id"]
    found = request.app[ENGINE].get_checkpoint(cid)
    if found is None:
        return error_response(404, f"no such checkpoint: {cid}", param="id")
    return web.json_response(found)


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
               inner_system: str = "auto", hosted_tools: str = "ignore") -> web.Application:
    """The app over a started engine; ``template_path`` overrides the chat template;
    ``inner_system`` and ``hosted_tools`` are the ``[server]`` keys of those names."""
    limits = limits or Limits()
    access = access or Access()
    app = web.Application(client_max_size=limits.max_body, middlewares=[_errors, _auth])
    app[ENGINE] = engine
    app[LIMITS] = limits
    app[ACCESS] = access
    app[BODY_LIMIT] = limits.max_body
    app[SLOTS] = asyncio.Semaphore(limits.parse_concurrency)
    app[TEMPLATE] = load_chat_template(engine.chat_template, bos_token=engine.bos_token,
                                       eos_token=engine.eos_token, override=template_path,
                                       inner_system=inner_system)
    app[HOSTED_TOOLS] = hosted_tools
    app[METER] = ApiMeter()
    app[WARNED] = set()
    recent: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_RECENT)
    app[RECENT] = recent
    app[RESPONSES] = ResponseStore()
    model = engine.tokenizer.model
    app[SEEN] = SeenConversations(page=page_size,
                                  text=lambda ids: model.detokenize(ids.tolist()))
    app[VOLATILE] = Volatile(volatile)
    app[STARTED] = int(time.time())
    app.on_response_prepare.append(_routing_headers)
    tpl = app[TEMPLATE]
    log.info("chat template: %s; a system message after the first: %s by the template, %s; "
             "messages of one role in a row: %s", tpl.origin, tpl.inner.value,
             "folded into the conversation" if tpl.fold_inner else "rendered as sent",
             "merged" if tpl.merge_runs else "rendered as sent")
    app.router.add_get("/", index)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/messages", messages)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)
    app.router.add_post("/v1/responses", responses)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    if admin and access.admin_routes:
        app.router.add_get("/admin/checkpoints", list_checkpoints)
        app.router.add_get("/admin/checkpoints/{id}", get_checkpoint)
        app.router.add_get("/admin/misses", list_misses)
        app.router.add_get("/admin/requests", list_requests)
    return app
