"""A small agent harness: it keeps a conversation and sends it all back every turn,
with the server's replies (reasoning, content, tool calls) as an agent client does."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

from openai import AsyncOpenAI

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file of the repository.",
        "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                       "required": ["path"]}}},
    {"type": "function", "function": {
        "name": "run_tests", "description": "Run the test suite and return its output.",
        "parameters": {"type": "object", "properties": {"filter": {"type": "string"}}}}},
]

SYSTEM = ("You are a coding agent working in a Python repository. Use the tools to read "
          "files and run tests. Think before you act. ") * 4

# An earlier exchange the client already holds: a reasoning turn with a tool call and
# the tool's result, sent back verbatim on every request.
PRIOR: list[dict[str, Any]] = [
    {"role": "user", "content": "The tests in tests/test_pool.py fail. Find out why."},
    {"role": "assistant", "content": "",
     "reasoning_content": "I should read the failing test first.",
     "tool_calls": [{"id": "call_1", "type": "function", "function": {
         "name": "read_file", "arguments": "{\"path\": \"tests/test_pool.py\"}"}}]},
    {"role": "tool", "tool_call_id": "call_1",
     "content": "def test_evict():\n    pool = Pool(budget=4)\n"
                "    assert pool.evict() == [1, 2]\n"},
]


def tool_result(turn: int) -> dict[str, Any]:
    body = "\n".join(f"tests/test_pool.py::test_case_{turn}_{i} FAILED  assert {i} == {i + 1}"
                     for i in range(4))
    return {"role": "tool", "tool_call_id": f"call_{turn}", "content": body}


def user_message(turn: int) -> dict[str, Any]:
    return {"role": "user", "content": f"Turn {turn}: look at the eviction order again, "
                                       "and explain what you would change in pool.py."}


@dataclass
class Turn:
    messages: list[dict[str, Any]]
    text: str  # reasoning + content, as generated
    tokens: list[dict[str, Any]]  # logprobs.content: each token with its top alternatives
    message: dict[str, Any]  # the assistant message as the client sends it back
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


@dataclass
class Session:
    client: AsyncOpenAI
    max_tokens: int = 48
    keep_reasoning: bool = True
    system: str = SYSTEM
    messages: list[dict[str, Any]] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=lambda: {"tools": TOOLS})

    def __post_init__(self) -> None:
        if not self.messages:
            self.messages = [{"role": "system", "content": self.system}, *copy.deepcopy(PRIOR)]

    async def turn(self, new: dict[str, Any] | None = None) -> Turn:
        if new is not None:
            self.messages.append(new)
        sent = copy.deepcopy(self.messages)
        reply = await ask(self.client, sent, self.max_tokens, **self.kwargs)
        turn = Turn(sent, reply["text"], reply["tokens"], reply["message"], reply["prompt_tokens"],
                    reply["completion_tokens"], reply["cached_tokens"])
        back = dict(reply["message"])
        if not self.keep_reasoning:
            back.pop("reasoning_content", None)
        self.messages.append(back)
        self.turns.append(turn)
        return turn


async def ask(client: AsyncOpenAI, messages: list[dict[str, Any]], max_tokens: int,
              **kwargs: Any) -> dict[str, Any]:
    """One greedy chat completion; the reply as a client would send it back."""
    kwargs.setdefault("temperature", 0)
    r = await client.chat.completions.create(
        model="statecache", messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens, extra_body={"chat_template_kwargs": {"preserve_thinking": True}},
        logprobs=True, top_logprobs=5, **kwargs)
    msg = r.choices[0].message
    extra = msg.model_extra or {}
    reasoning = extra.get("reasoning_content")
    back: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
    if reasoning:
        back["reasoning_content"] = reasoning
    if msg.tool_calls:
        back["tool_calls"] = [tc.model_dump() for tc in msg.tool_calls]
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    assert r.choices[0].logprobs is not None and r.choices[0].logprobs.content is not None
    return {
        "tokens": [t.model_dump() for t in r.choices[0].logprobs.content],
        "text": (reasoning or "") + (msg.content or ""),
        "message": back,
        "prompt_tokens": r.usage.prompt_tokens,
        "completion_tokens": r.usage.completion_tokens,
        "cached_tokens": r.usage.prompt_tokens_details.cached_tokens or 0,
    }


def assert_same_or_near_tie(got: list[dict[str, Any]], cold: list[dict[str, Any]],
                            delta: float) -> None:
    """Greedy replies must agree token for token, except where the cold server itself
    saw a near-tie: a different batch schedule moves logits a little (docs/design.md fact
    10), so at the first difference the cached token must be within ``delta`` of the
    cold server's top choice. After that point the two replies legitimately diverge.

    Where the cold server's alternatives lack the cached token (a flat distribution:
    Gemma 3's top five can lie within 0.5 of each other, and a row batched beside
    another lane's moves by up to 0.89, tests/model/test_exact_batches.py), the tie is
    judged from the cached side: the cold token must be among the cached reply's
    alternatives, within ``delta`` of the token it chose."""
    for i, (a, b) in enumerate(zip(got, cold, strict=False)):
        if a["token"] == b["token"]:
            continue
        alternatives = {t["token"]: t["logprob"] for t in b["top_logprobs"]}
        if a["token"] in alternatives:
            gap = b["logprob"] - alternatives[a["token"]]
        else:
            theirs = {t["token"]: t["logprob"] for t in a.get("top_logprobs") or ()}
            assert b["token"] in theirs, \
                f"token {i}: {a['token']!r} not among {alternatives}, nor {b['token']!r} " \
                f"among {theirs}"
            gap = a["logprob"] - theirs[b["token"]]
        assert gap <= delta, f"token {i}: {a['token']!r} vs {b['token']!r}, gap {gap:.4f}"
        return
    assert len(got) == len(cold)
