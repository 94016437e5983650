"""A budget of reasoning tokens, kept as llama-server's ``--reasoning-budget`` keeps it:
once the reply has spent the budget inside its reasoning, the closer is forced and the
reply goes on. Through the real server and the real openai and anthropic clients.

The synthetic model's template opens ``<think>``, and a random model never writes the
closer itself (its special tokens score zero): without a budget the reasoning runs to
``max_tokens`` and nothing else comes, so every assertion below fails without it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from anthropic import AsyncAnthropic

from tests.http.conftest import serve

pytestmark = pytest.mark.http

USER = [{"role": "user", "content": "Which one?"}]
GREEDY = {"temperature": 0}  # this anthropic client takes no temperature of its own
PICK = {"name": "pick", "description": "Pick one",
        "input_schema": {"type": "object", "properties": {
            "n": {"type": "integer"}, "mode": {"enum": ["fast", "slow"]}},
            "required": ["n", "mode"]}}


async def test_the_budget_closes_the_reasoning_on_every_api(hybrid_path: Path,
                                                            tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", model__threads=1) as s:
        an = AsyncAnthropic(base_url=s.url, api_key="x", max_retries=0, timeout=120)
        try:
            # without a budget: reasoning to the end
            m = await an.messages.create(model="m", max_tokens=40, messages=USER,
                                         extra_body=GREEDY)
            assert [b.type for b in m.content] == ["thinking"]
            # Anthropic: a thinking block of at most the budget, then the text
            m = await an.messages.create(
                model="m", max_tokens=40, messages=USER, extra_body=GREEDY,
                thinking={"type": "enabled", "budget_tokens": 6})
            kinds = [b.type for b in m.content]
            assert kinds == ["thinking", "text"], kinds
            assert 0 < len(m.content[0].thinking) <= 6 and m.content[1].text
            async with an.messages.stream(
                    model="m", max_tokens=40, messages=USER, extra_body=GREEDY,
                    thinking={"type": "enabled", "budget_tokens": 6}) as st:
                streamed = await st.get_final_message()
            assert [b.model_dump() for b in streamed.content] == \
                [b.model_dump() for b in m.content]
            # chat completions (llama-server's field), the same reply
            r = await s.client.chat.completions.create(
                model="m", messages=USER, max_tokens=40, temperature=0,
                extra_body={"reasoning_budget_tokens": 6})
            msg = r.choices[0].message.model_dump()
            assert (msg["reasoning_content"], msg["content"]) == \
                (m.content[0].thinking, m.content[1].text)
            # a budget of 0: no reasoning at all
            m0 = await an.messages.create(
                model="m", max_tokens=20, messages=USER, extra_body=GREEDY,
                thinking={"type": "enabled", "budget_tokens": 0})
            assert [b.type for b in m0.content] == ["text"]
        finally:
            await an.close()


async def test_a_forced_call_after_a_bounded_reasoning(hybrid_path: Path,
                                                       tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", model__threads=1) as s:
        an = AsyncAnthropic(base_url=s.url, api_key="x", max_retries=0, timeout=120)
        try:
            forced = {"tools": [PICK], "tool_choice": {"type": "tool", "name": "pick",
                                                       "disable_parallel_tool_use": True}}
            m = await an.messages.create(model="m", max_tokens=120, messages=USER,
                                         extra_body=GREEDY,
                                         **forced)  # type: ignore[arg-type]
            assert not [b for b in m.content if b.type == "tool_use"]  # still reasoning
            m = await an.messages.create(
                model="m", max_tokens=120, messages=USER, extra_body=GREEDY,
                thinking={"type": "enabled", "budget_tokens": 8},
                **forced)  # type: ignore[arg-type]
            calls = [b for b in m.content if b.type == "tool_use"]
            assert [c.name for c in calls] == ["pick"] and m.stop_reason == "tool_use"
            assert isinstance(calls[0].input["n"], int)
            assert calls[0].input["mode"] in ("fast", "slow")
        finally:
            await an.close()
