"""What the app's handlers share: the engine's face, the limits, and the keys under which
``create_app`` (proxy/api/app.py) keeps the app's state and a request its own."""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from proxy.api.auth import Access
from proxy.api.misses import Conversation, SeenConversations
from proxy.api.prompt_memo import PromptMemo
from proxy.api.render import ChatTemplate
from proxy.api.response_store import ResponseStore
from proxy.api.ui_tree import TreeView
from proxy.api.volatile import Volatile
from proxy.engine.tokens import Tokenizer
from proxy.engine.types import Event, GenerationRequest
from proxy.meter import Family
from proxy.meters import ApiMeter

# The HTTP side logs under one name, as when it was one module (log settings keep working).
APP_LOG = "proxy.api.app"
MAX_BODY = 8 * 1024 * 1024
DEFAULT_MAX_TOKENS = 2048
TENANT_HEADER = "X-Statecache-Tenant"
# Routing by conversation (docs/several-machines.md): a load balancer hashes this
# header, which clients set to a stable id per conversation; every response echoes it
# and names the proxy that answered.
SESSION_HEADER = "X-Statecache-Session"
PROXY_HEADER = "X-Statecache-Proxy"
# Claude Code names each subagent's conversation (its main agent's requests carry none),
# and each session (its subagents' requests carry their session's too)
AGENT_HEADER = "X-Claude-Code-Agent-Id"
CLAUDE_SESSION_HEADER = "X-Claude-Code-Session-Id"


class EngineLike(Protocol):
    model_name: str  # as the user asked for it (a name, or the GGUF's file name)
    model_file: str  # the GGUF's path
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
    # The live page (proxy/api/ui.py): lanes now (with their page hashes, in-process
    # only), each checkpoint's page hashes, the tiers and where they are, the queue.
    def describe_lanes(self) -> list[dict[str, Any]]: ...
    def checkpoint_pages(self) -> Mapping[str, tuple[bytes, ...]]: ...
    def tiers(self) -> dict[str, Any]: ...
    def queue(self) -> dict[str, int]: ...
    # Stop admitting; running generations end at their next step with a final event.
    def begin_shutdown(self) -> None: ...


@dataclass(slots=True, frozen=True)
class Limits:
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # when a request names none
    request_timeout: float | None = None  # seconds a reply (or a stream's start) may take
    max_body: int = MAX_BODY  # bytes; a larger body gets 413
    parse_concurrency: int = 2  # requests read, parsed and tokenized at the same time


ENGINE = web.AppKey("engine", EngineLike)
TEMPLATE = web.AppKey("template", ChatTemplate)
PROMPTS = web.AppKey("prompts", PromptMemo)  # what earlier prompts showed: follow-ups
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
LIMITS = web.AppKey("limits", Limits)
ACCESS = web.AppKey("access", Access)
UI_TREE = web.AppKey("ui_tree", TreeView)  # the live page's tree, remembered between looks
TENANT = web.RequestKey("tenant", str)  # set when the tenant comes from the API key
