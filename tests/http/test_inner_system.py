"""System and developer messages inside a conversation, on the templates people run.

Claude Code sends its environment as a ``system`` message after the first user turn;
Codex sends ``developer`` items after its instructions; chat clients send ``developer``
messages. Gemma 3's template and Qwen3.5's guard refuse such a message; ChatML and Llama
3 render it in place. statecache probes each template when it loads it and folds the
message where the template refuses it (proxy/api/inner.py). On every one of these
templates a session through the real ``openai`` and ``anthropic`` SDKs must get 200s,
turn N+1 must reuse turn N's prompt and reply, and every reply must be the one a server
with caching off gives.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from anthropic import AsyncAnthropic

from proxy.api.app import TEMPLATE
from proxy.api.inner import InnerSystem
from tests.http.conftest import DoneLines, serve
from tests.http.cross_api import (
    GEMMA_NEAR_TIE,
    NEAR_TIE,
    Session,
    anthropic_api,
    chat_api,
    responses_api,
    same_as_cold,
)

pytestmark = pytest.mark.http

TEMPLATES = Path(__file__).resolve().parents[2] / "vendor" / "templates"
ENV = "<env>\ncwd: /repo\nplatform: linux\ntoday: 2026-12-02\n</env>"
REMINDER = "Reminder: keep answers short; the user reads them in a terminal."
# (model fixture, template file or None for the model's own, what the probe must find)
CASES = {
    "gemma3": ("gemma_path", None, InnerSystem.REFUSED),
    "qwen-guard": ("hybrid_path", "chatml-system-first.jinja", InnerSystem.REFUSED),
    "chatml": ("hybrid_path", None, InnerSystem.IN_PLACE),
    "llama3": ("hybrid_path", "llama3.jinja", InnerSystem.IN_PLACE),
}


@pytest.mark.parametrize("case", list(CASES))
async def test_inner_system_messages_on_each_template(
    case: str, request: pytest.FixtureRequest, tmp_path: Path, done_lines: DoneLines
) -> None:
    fixture, template, found = CASES[case]
    model: Path = request.getfixturevalue(fixture)
    overrides: dict[str, Any] = {"server__lanes": 1}
    if template is not None:
        overrides["model__chat_template"] = str(TEMPLATES / template)
    max_tokens = 8 if fixture == "gemma_path" else 24
    async with serve(model, tmp_path / "ckpt", **overrides) as srv:
        assert srv.app[TEMPLATE].inner is found
        anthropic = AsyncAnthropic(base_url=srv.url, api_key="unused", max_retries=0,
                                   timeout=120)
        apis = [anthropic_api(anthropic, max_tokens, stream=True),
                chat_api(srv.client, max_tokens),
                responses_api(srv.client, max_tokens, stream=False),
                anthropic_api(anthropic, max_tokens, stream=False)]
        s = Session()
        # the environment after the first user turn (Claude Code), then a developer
        # message after a reply (Codex, chat clients), then a reminder before a user turn
        await s.turn(apis[0], {"role": "system", "content": ENV})
        await s.turn(apis[1], {"role": "developer", "content": REMINDER})
        s.messages.append({"role": "system", "content": REMINDER})
        await s.turn(apis[2], {"role": "user", "content": "Now run the tests."})
        await s.turn(apis[3], {"role": "user", "content": "Summarize in one line."})
        await anthropic.close()
    for k in range(1, len(s.turns)):
        prev, cur = s.turns[k - 1].reply, s.turns[k].reply
        # the whole previous prompt (the state one token short of it, at least) ...
        assert cur.cached_tokens >= prev.prompt_tokens - 1, (case, k, cur.cached_tokens)
    # ... and as much of its reply as came back in the same tokens: a request that reused
    # less than an earlier one held by a page or more says why in its Done line (a
    # thinking template strips the whitespace a reply's reasoning starts with, so that
    # part of a reply is no one's to reuse)
    assert not [e for e in done_lines.events if "miss:" in e], done_lines.events
    # Gemma 3's first reply here is a tool call the 8-token limit cuts, which the reply
    # drops: the lane rolls it back, and the next turn (427 tokens from the lane, 32
    # prefilled) gets the logits of a lane that never held it, bit for bit
    # (test_exact_restore.py), but not those of 459 tokens prefilled at once: its token 0
    # had a logprob of -3.92 where the cold server's choice had -3.79 (fact 10)
    near_tie = GEMMA_NEAR_TIE if fixture == "gemma_path" else NEAR_TIE
    await same_as_cold(model, tmp_path, s.turns, max_tokens, near_tie=near_tie, **overrides)


async def test_keep_hands_the_message_to_the_template(gemma_path: Path, tmp_path: Path) -> None:
    """``server.inner_system = "keep"``: as before, Gemma's template refuses it (a 400)."""
    async with serve(gemma_path, tmp_path / "ckpt", server__inner_system="keep") as srv:
        anthropic = AsyncAnthropic(base_url=srv.url, api_key="unused", max_retries=0)
        with pytest.raises(Exception) as err:
            await anthropic.messages.create(
                model="m", max_tokens=4, messages=[
                    {"role": "user", "content": "hi"},
                    {"role": "system", "content": ENV}])  # type: ignore[typeddict-item]
        assert getattr(err.value, "status_code", None) == 400
        assert "start of the conversation" in str(err.value)
        await anthropic.close()
