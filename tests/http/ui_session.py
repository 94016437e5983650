"""A short agent session with a subagent, for the live page's tests (test_ui.py and the
browser's, test_ui_browser.py): a main agent and its subagent share a long system prompt
and tools; each takes a follow-up turn; then the main agent sends its history with its
first user message edited, which misses there."""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI

from proxy.api.appstate import SESSION_HEADER
from tests.http.agent import PRIOR, SYSTEM, TOOLS, Session, tool_result, user_message

PAGE = 32
# the two conversations as the server names them (the header they came in, its value)
MAIN, SUB = (f"{SESSION_HEADER.lower()}:{name}" for name in ("main", "sub"))
LONG_SYSTEM = SYSTEM * 3
EDITED = "The tests in tests/test_ring.py fail. Find out why."  # PRIOR[0], edited


@dataclass
class Sent:
    """What the client saw of each request, in order: (prompt tokens, cached tokens)."""

    usage: list[tuple[int, int]] = field(default_factory=list)
    shared: int = 0  # the subagent's first request reused this much of the main agent's


def _session(client: AsyncOpenAI, name: str, messages: list[dict[str, Any]]) -> Session:
    return Session(client, max_tokens=12, system=LONG_SYSTEM, messages=messages,
                   kwargs={"tools": TOOLS, "extra_headers": {SESSION_HEADER: name}})


async def agent_session(client: AsyncOpenAI,
                        after_turn: Callable[[], Awaitable[object]] | None = None) -> Sent:
    """The session; ``after_turn`` (a look at the page, say) is awaited after each turn."""
    sent = Sent()
    system = {"role": "system", "content": LONG_SYSTEM}
    main = _session(client, "main", [system, *copy.deepcopy(PRIOR)])
    sub = _session(client, "sub", [system, {"role": "user", "content":
                                            "Subtask: list the tests that touch eviction."}])
    for session, new in ((main, None), (sub, None), (sub, tool_result(1)),
                         (main, user_message(2))):
        turn = await session.turn(new)
        sent.usage.append((turn.prompt_tokens, turn.cached_tokens))
        if session is sub and not sent.shared:
            sent.shared = turn.cached_tokens
        if after_turn is not None:
            await after_turn()
    edited = copy.deepcopy(main.messages)
    edited[1]["content"] = EDITED
    main.messages = edited[:-1]  # the history as the client now has it, without the reply
    turn = await main.turn()
    sent.usage.append((turn.prompt_tokens, turn.cached_tokens))
    return sent


def shared_branch(nodes: list[dict[str, Any]], shared: int) -> dict[str, Any]:
    """The node where the two conversations part: it has at least two branches, both
    sessions below it, and it sits at the page that holds the end of the shared prefix."""
    kids: dict[str, list[dict[str, Any]]] = {n["key"]: [] for n in nodes}
    for n in nodes:
        if n["parent"] in kids:
            kids[n["parent"]].append(n)

    def below(n: dict[str, Any]) -> set[str]:
        out = set(n["sessions"]) | {ln["session"] for ln in n["lanes"] if ln["session"]}
        for c in kids[n["key"]]:
            out |= below(c)
        return out

    found = [n for n in nodes if len(kids[n["key"]]) >= 2 and {MAIN, SUB} <= below(n)
             and shared // PAGE * PAGE <= n["tokens"] <= shared + PAGE]
    assert len(found) == 1, (shared, nodes)
    return found[0]
