"""The routes that generate: one handler for the three chat APIs, driven by a record per
API (``ChatApi``), and the two that differ (completions, count_tokens).

A chat request is parsed by its API's parser into the shared ``ChatRequest``
(proxy/api/chat.py); its hosted tools are counted, its tenant found, volatile text
replaced, the conversation rendered and tokenized off the event loop, its
``GenerationRequest`` built (proxy/api/generation.py), and the reply streamed or
collected (proxy/api/streaming.py) and written by the API's ``Writer``: OpenAI's chunks,
Anthropic's Messages events, or Responses events (whose writer also keeps the response
for ``previous_response_id``).

``/v1/completions`` prepends the engine's ``bos_token`` to the prompt unless it already
starts with it (the engine's tokenize adds none).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from aiohttp import web

from proxy.api.anthropic import parse_messages_request
from proxy.api.anthropic_events import MessageEvents, message_body, new_tool_use_id
from proxy.api.appstate import ENGINE, HOSTED_TOOLS, PROMPTS, RESPONSES, TEMPLATE, VOLATILE
from proxy.api.chat import ChatRequest
from proxy.api.generation import (
    chat_generation,
    fit_max_tokens,
    generation,
    note_ignored_tools,
    tenant_of,
    tokenize_chat,
    unbounded,
)
from proxy.api.intake import read_json
from proxy.api.misses import prompt_conversation
from proxy.api.openai import parse_chat_request, parse_completion_request
from proxy.api.openai_events import ChatChunks, CompletionChunks
from proxy.api.prompt import completion_prompt
from proxy.api.reply import Delta, ReplyParser, StreamParser, new_call_id, starts_in_reasoning
from proxy.api.responses import ResponsesRequest, chat_request, parse_responses_request
from proxy.api.responses_events import (
    ResponseEvents,
    assistant_message,
    finished,
    output_items,
    response_head,
)
from proxy.api.streaming import JSON, Chunks, collect, stream
from proxy.api.structured import in_family
from proxy.api.thinking import with_budget
from proxy.engine.types import FinishEvent, GenerationRequest, TokenLogprob

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(slots=True, frozen=True)
class Turn:
    """A chat request handed to the engine: what its API's writer needs."""

    gen: GenerationRequest
    model: str
    parser: ReplyParser  # splits the reply into reasoning, content and tool calls
    prompt_tokens: int
    window: bool  # max_tokens was cut to the room the context leaves (Anthropic)


class Writer(Protocol):
    """How one API writes one reply: its stream's events, or its JSON body; ``written``
    runs once the reply went out whole."""

    def events(self) -> Chunks: ...
    def body(self, reply: Delta, fin: FinishEvent,
             logprobs: list[TokenLogprob] | None) -> JSON: ...
    def written(self) -> None: ...


class ApiRequest(Protocol):
    """What the shared handler reads of an API's own request."""

    @property
    def user(self) -> str | None: ...
    @property
    def ignored_tools(self) -> tuple[str, ...]: ...


R = TypeVar("R", bound=ApiRequest)


@dataclass(slots=True, frozen=True)
class ChatApi(Generic[R]):
    """What differs between the chat routes; ``chat_route`` runs the steps they share."""

    parse: Callable[[object, str], R]  # (body, server.hosted_tools) -> the API's request
    conversation: Callable[[web.Request, R, str], ChatRequest]  # what is rendered (tenant)
    writer: Callable[[web.Request, R, Turn], Writer]
    prefix: str  # of request ids ("chatcmpl-...")
    param: str  # the field a context-length error names
    fit_max_tokens: bool = False  # max_tokens cut to the room left (Anthropic's rule)
    tool_ids: Callable[[], str] = new_call_id  # ids of the reply's tool calls


async def chat_route(request: web.Request, api: ChatApi[Any]) -> web.StreamResponse:
    t_arrival = time.perf_counter()  # the request's TTFT counts from here
    # read_json holds a parse slot until generation() (or the end of the request) gives
    # it back
    req = api.parse(await read_json(request), request.app[HOSTED_TOOLS])
    note_ignored_tools(request, req.ignored_tools)
    engine, tenant = request.app[ENGINE], tenant_of(request, req.user)
    template = request.app[TEMPLATE]
    chat = in_family(request.app[VOLATILE].apply(api.conversation(request, req, tenant)),
                     template.syntax, template.call_form, template.grammar_reasoning)
    chat = with_budget(chat, template.syntax)
    # Rendering and tokenizing a long conversation takes a while: off the event loop.
    p = await asyncio.to_thread(tokenize_chat, engine, request.app[TEMPLATE],
                                unbounded(chat) if api.fit_max_tokens else chat, tenant,
                                request.app[PROMPTS])
    asked = fit_max_tokens(chat.max_tokens, engine.n_ctx, len(p.tokens)) \
        if api.fit_max_tokens else chat.max_tokens
    gen = chat_generation(request, p, chat, asked, api.prefix, api.param, tenant, t_arrival)
    syntax = request.app[TEMPLATE].syntax
    parser = StreamParser(syntax, starts_in_reasoning=starts_in_reasoning(p.text, syntax),
                          parse_tools=chat.parse_tools, tools=chat.tools, make_id=api.tool_ids)
    writer = api.writer(request, req, Turn(gen, engine.model_name, parser, len(p.tokens),
                                           asked != chat.max_tokens))
    resp: web.StreamResponse
    if chat.stream:
        resp = await stream(request, gen, writer.events())
    else:
        text, fin, logprobs = await collect(request, gen)
        reply = parser.feed(text)
        reply.extend(parser.finish(cut=fin.reason == "length"))
        resp = web.json_response(writer.body(reply, fin, logprobs))
    writer.written()
    return resp


def chat_handler(api: ChatApi[Any]) -> Handler:
    async def handle(request: web.Request) -> web.StreamResponse:
        return await chat_route(request, api)
    return handle


# -- the three APIs ------------------------------------------------------------------


def _as_sent(request: web.Request, req: ChatRequest, tenant: str) -> ChatRequest:
    return req


@dataclass(slots=True)
class _ChatWriter:
    """OpenAI chat completions: ``chat.completion(.chunk)``."""

    turn: Turn
    include_usage: bool

    def events(self) -> Chunks:
        t = self.turn
        return ChatChunks(t.gen.request_id, t.model, t.parser, self.include_usage)

    def body(self, reply: Delta, fin: FinishEvent, logprobs: list[TokenLogprob] | None) -> JSON:
        return ChatChunks.completion(self.turn.gen.request_id, self.turn.model, reply, fin,
                                     logprobs)

    def written(self) -> None:
        pass


CHAT: ChatApi[ChatRequest] = ChatApi(
    parse=lambda body, hosted: parse_chat_request(body), conversation=_as_sent,
    writer=lambda request, req, turn: _ChatWriter(turn, req.include_usage),
    prefix="chatcmpl", param="messages")


@dataclass(slots=True)
class _MessageWriter:
    """Anthropic Messages: the ``message`` body, or its events."""

    turn: Turn

    def events(self) -> Chunks:
        t = self.turn
        return MessageEvents(t.gen.request_id, t.model, t.parser, t.prompt_tokens, t.window)

    def body(self, reply: Delta, fin: FinishEvent, logprobs: list[TokenLogprob] | None) -> JSON:
        return message_body(self.turn.gen.request_id, self.turn.model, reply, fin,
                            self.turn.window)

    def written(self) -> None:
        pass


MESSAGES: ChatApi[ChatRequest] = ChatApi(
    parse=lambda body, hosted: parse_messages_request(body, hosted_tools=hosted),
    conversation=_as_sent, writer=lambda request, req, turn: _MessageWriter(turn),
    prefix="msg", param="messages", fit_max_tokens=True, tool_ids=new_tool_use_id)


def _with_history(request: web.Request, req: ResponsesRequest, tenant: str) -> ChatRequest:
    """The stored conversation ``previous_response_id`` names, then the new input."""
    store = request.app[RESPONSES]
    history = store.history(req.previous_response_id, tenant) if req.previous_response_id else ()
    return chat_request(req, history)


class _ResponseWriter:
    """OpenAI Responses: the ``response`` body, or its events; a finished response is
    kept for ``previous_response_id`` when the request says ``store``."""

    def __init__(self, request: web.Request, req: ResponsesRequest, turn: Turn) -> None:
        self._store, self._req, self._gen = request.app[RESPONSES], req, turn.gen
        self._parser = turn.parser
        self._head = response_head(turn.gen.request_id, turn.model, req)
        self._events: ResponseEvents | None = None
        self._reply = Delta()
        self._final: JSON | None = None

    def events(self) -> Chunks:
        self._events = ResponseEvents(self._head, self._parser, self._req.namespaces)
        return self._events

    def body(self, reply: Delta, fin: FinishEvent, logprobs: list[TokenLogprob] | None) -> JSON:
        self._reply = reply
        self._final = finished(self._head, output_items(reply, self._req.namespaces), fin)
        return self._final

    def written(self) -> None:
        if self._events is not None:
            self._reply, self._final = self._events.reply, self._events.final
        if self._final is not None and self._req.store:
            self._store.put(self._gen.request_id, self._gen.tenant,
                            self._req.previous_response_id,
                            self._req.messages + (assistant_message(self._reply),))


RESPONSES_API: ChatApi[ResponsesRequest] = ChatApi(
    parse=lambda body, hosted: parse_responses_request(body, hosted_tools=hosted),
    conversation=_with_history, writer=_ResponseWriter, prefix="resp", param="input")

chat_completions = chat_handler(CHAT)
messages = chat_handler(MESSAGES)  # Anthropic Messages
responses = chat_handler(RESPONSES_API)  # OpenAI Responses


# -- the other two -------------------------------------------------------------------


async def completions(request: web.Request) -> web.StreamResponse:
    req = parse_completion_request(await read_json(request))
    engine, tenant = request.app[ENGINE], tenant_of(request, req.user)
    bos = engine.bos_token
    prompt = req.prompt if not bos or req.prompt.startswith(bos) else bos + req.prompt
    tokens = await asyncio.to_thread(completion_prompt, engine.tokenizer, prompt, tenant,
                                     engine.n_ctx, req.max_tokens)
    gen = generation(request, tokens, req.sampling, req.max_tokens, "cmpl", "prompt", tenant,
                     seen=prompt_conversation(tenant, prompt, tokens))
    chunks = CompletionChunks(gen.request_id, engine.model_name, req.include_usage)
    if req.stream:
        return await stream(request, gen, chunks)
    text, fin, logprobs = await collect(request, gen)
    return web.json_response(chunks.completion(text, fin, logprobs))


async def count_tokens(request: web.Request) -> web.Response:
    """Anthropic's ``count_tokens``: the prompt's length as rendered and tokenized here."""
    req = request.app[VOLATILE].apply(parse_messages_request(
        await read_json(request), count_only=True, hosted_tools=request.app[HOSTED_TOOLS]))
    p = await asyncio.to_thread(tokenize_chat, request.app[ENGINE], request.app[TEMPLATE],
                                req, tenant_of(request, None), request.app[PROMPTS])
    return web.json_response({"input_tokens": len(p.tokens)})
