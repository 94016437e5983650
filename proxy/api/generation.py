"""From a parsed request to the engine's ``GenerationRequest``: the tenant, the
conversation it belongs to, the prompt's tokens, how many tokens the reply may take, and
where the prompt leaves what was sent before.

- ``max_tokens`` absent: ``min(n_ctx - prompt_tokens, server.max_tokens_default)``, so a
  reply never runs past the context and a forgotten limit does not run for minutes.
  Anthropic's ``max_tokens`` is cut to the room the context leaves (``fit_max_tokens``).
- The tenant (cache namespace) is the API key's when keys are configured
  (proxy/api/auth.py), else the ``X-Statecache-Tenant`` header, else the request's
  ``user`` field, else "".
- The conversation a request belongs to (its session, for lane affinity and miss
  reasons): the ``X-Statecache-Session`` header, else Claude Code's agent id header (a
  subagent is a conversation of its own), else its session id header, else what the
  body names (Codex's ``prompt_cache_key``, Anthropic's ``metadata.user_id``).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections.abc import Sequence

import numpy as np
from aiohttp import web

from proxy.api.appstate import (
    AGENT_HEADER,
    APP_LOG,
    CLAUDE_SESSION_HEADER,
    CONVERSATION,
    DEFAULT_MAX_TOKENS,
    ENGINE,
    LIMITS,
    METER,
    SEEN,
    SESSION_HEADER,
    TEMPLATE,
    TENANT,
    TENANT_HEADER,
    WARNED,
    EngineLike,
)
from proxy.api.chat import ChatRequest
from proxy.api.fields import ApiError
from proxy.api.intake import release
from proxy.api.misses import Conversation, chat_conversation
from proxy.api.prompt import Prompt, chat_prompt
from proxy.api.prompt_memo import PromptMemo
from proxy.api.render import ChatTemplate
from proxy.api.sampling import to_params
from proxy.engine.types import GenerationRequest, Intake, SamplingParams

log = logging.getLogger(APP_LOG)

MAX_TOOL_TYPES = 32  # hosted tool types counted apart (the rest: "other")


def tenant_of(request: web.Request, user: str | None) -> str:
    """The API key's tenant when keys are configured, never what the request says."""
    if TENANT in request:
        return request[TENANT]
    return request.headers.get(TENANT_HEADER) or user or ""


def session_of(request: web.Request, named: str | None) -> str | None:
    """The conversation this request belongs to: a header, else what its body names."""
    for header in (SESSION_HEADER, AGENT_HEADER, CLAUDE_SESSION_HEADER):
        value = request.headers.get(header)
        if value and len(value) <= 256:
            return f"{header.lower()}:{value}"
    return named


def note_ignored_tools(request: web.Request, kinds: Sequence[str]) -> None:
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


def tokenize_chat(engine: EngineLike, template: ChatTemplate, req: ChatRequest,
                  tenant: str, memo: PromptMemo | None = None) -> Prompt:
    """The prompt, its tokens, the tokens of the history before the generation prompt,
    and where it may be shared or kept.

    Client text stays text, a prompt past the context is refused before it is
    tokenized, and it is tokenized once (proxy/api/prompt.py); with ``memo``, what the
    prompts before it showed is not rendered or placed again.
    """
    return chat_prompt(engine.tokenizer, template, req, tenant, engine.n_ctx, memo)


def max_tokens_for(n_ctx: int, n_prompt: int, asked: int | None, param: str,
                   default: int = DEFAULT_MAX_TOKENS) -> int:
    """The reply's limit: as asked if the context holds it, else (not asked) what is left
    of the context, at most ``default``."""
    if asked is not None:
        if n_prompt + asked > n_ctx:
            raise ApiError(f"this model's context is {n_ctx} tokens; the prompt has {n_prompt} "
                           f"and max_tokens is {asked}", param, "context_length_exceeded")
        return asked
    if n_prompt >= n_ctx:
        raise ApiError(f"this model's context is {n_ctx} tokens; the prompt has {n_prompt}, "
                       "which leaves no room for a reply", param, "context_length_exceeded")
    return min(n_ctx - n_prompt, default)


def unbounded(req: ChatRequest) -> ChatRequest:
    """The request without ``max_tokens``, to check its prompt against the context alone
    (``fit_max_tokens`` then cuts ``max_tokens`` to the room left)."""
    return dataclasses.replace(req, max_tokens=None)


def fit_max_tokens(asked: int | None, n_ctx: int, n_prompt: int) -> int | None:
    """``max_tokens`` cut to the room the context leaves: clients such as Claude Code
    always ask for tens of thousands, and Anthropic's API runs until the context is full
    (``stop_reason: model_context_window_exceeded``) rather than refusing."""
    room = n_ctx - n_prompt
    if asked is None or room <= 0 or asked <= room:
        return asked
    return room


def chat_generation(request: web.Request, p: Prompt, req: ChatRequest, asked: int | None,
                    prefix: str, param: str, tenant: str,
                    t_arrival: float | None = None) -> GenerationRequest:
    """A tokenized chat request for the engine; ``asked``: its ``max_tokens``;
    ``t_arrival``: when its handler began (``time.perf_counter``)."""
    session = session_of(request, req.session)
    intake = None if t_arrival is None else Intake(t_arrival, p.render_s, p.tokenize_s,
                                                     p.points_s)
    return generation(request, p.tokens, req.sampling, asked, prefix, param, tenant,
                      p.history,
                      chat_conversation(tenant, req, p.tokens, p.text, p.history, session,
                                       request.app[TEMPLATE].syntax, p.tools_json),
                      share_points=p.share_points, breakpoints=p.breakpoints,
                      session=session, intake=intake)


def generation(request: web.Request, tokens: Sequence[int] | np.ndarray,
               sampling: SamplingParams,
               asked: int | None, prefix: str, param: str, tenant: str,
               history: int | None = None,
               seen: Conversation | None = None, *, share_points: tuple[int, ...] = (),
               breakpoints: tuple[tuple[int, float], ...] = (),
               session: str | None = None, intake: Intake | None = None
               ) -> GenerationRequest:
    """The engine's request: ids prefixed ``prefix``; a context-length error names
    ``param``; ``seen``: the conversation, remembered once replied (miss reasons)."""
    release(request)  # the prompt is tokenized: the next request may be parsed
    use_cache = sampling.cache_prompt is not False
    if not use_cache and asked == 0:
        raise ApiError("a pre-warm ('max_tokens': 0) with 'cache_prompt': false would "
                       "cache nothing", "cache_prompt")
    max_tokens = max_tokens_for(request.app[ENGINE].n_ctx, len(tokens), asked, param,
                                request.app[LIMITS].default_max_tokens)
    divergence = None
    if seen is not None:  # where it leaves what was sent before (the engine reports misses)
        divergence = request.app[SEEN].divergence(seen)
        if use_cache:  # a request served cold leaves nothing that a later one could miss
            request[CONVERSATION] = seen
    gen = GenerationRequest(request_id=f"{prefix}-{secrets.token_hex(12)}",
                            prompt_tokens=tokens if isinstance(tokens, np.ndarray)
                            else tuple(tokens), sampling=to_params(sampling, max_tokens),
                            tenant=tenant, use_cache=use_cache, history_tokens=history,
                            divergence=divergence,
                            share_points=share_points, breakpoints=breakpoints,
                            session=session, intake=intake)
    if divergence is not None:
        log.debug("%s: %s", gen.request_id, divergence.describe())
    return gen
