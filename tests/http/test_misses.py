"""Every miss has a reason: the real server, the real openai client, the engine's Done
line (``miss: <cause> at token N (message i, role)``), /metrics and GET /admin/misses.

The synthetic hybrid model's vocabulary is one character per token, so a character of
message text is a token of the prompt, and where two prompts part is easy to place.
Periodic checkpoints are off unless a test is about them, so what a request can reuse
is the replay point, the first turn's end and the reply's end.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from anthropic import AsyncAnthropic

from proxy.api.app import ENGINE, TEMPLATE
from proxy.api.openai import parse_chat_request
from proxy.api.prompt import chat_prompt
from statecache.cli import main as cli_main
from statecache.config import load_config
from tests.http.conftest import DoneLines, Server, serve

pytestmark = pytest.mark.http
PAGE = 32
KEEP = {"chat_template_kwargs": {"preserve_thinking": True}}
MISS = re.compile(r"miss: (?P<cause>[a-z -]+?)(?: at token (?P<token>[\d,]+))?"
                  r"(?: \(message (?P<message>-?\d+), (?P<role>[^)]*)\))?"
                  r"(?: by the (?P<family>[\w.-]+) template)?(?:: (?P<text>.*))?$")
# A long system prompt (about 700 tokens) with a line in its middle that changes.
SYSTEM_HEAD = ("You are a coding agent working in a Python repository. Read files, run the "
               "tests, and explain every change you make before you make it. ") * 4
SYSTEM_TAIL = ("Keep answers short. Prefer small diffs. Never commit without running the "
               "test suite first, and say which tests you ran. ") * 3
BASE = {"cache__periodic_pages": 0}


def system(status: str) -> str:
    return f"{SYSTEM_HEAD}\ngit status: {status}\n{SYSTEM_TAIL}"


def misses(done: DoneLines) -> list[dict[str, str | None]]:
    """The miss of each Done line (None where the line has none), in order."""
    out: list[dict[str, str | None]] = []
    for line in done.events:
        if line.startswith("Done"):
            m = MISS.search(line)
            out.append(m.groupdict() if m else {"cause": None})
    return out


async def chat(srv: Server, messages: list[dict[str, Any]], max_tokens: int = 24,
               **kwargs: Any) -> dict[str, Any]:
    """One greedy request; the reply as a client sends it back."""
    extra = kwargs.pop("extra_body", KEEP)
    r = await srv.client.chat.completions.create(
        model="statecache", messages=messages,  # type: ignore[arg-type]
        max_tokens=max_tokens, temperature=0, extra_body=extra, **kwargs)
    msg = r.choices[0].message
    back: dict[str, Any] = {"role": "assistant", "content": msg.content or ""}
    reasoning = (msg.model_extra or {}).get("reasoning_content")
    if reasoning:
        back["reasoning_content"] = reasoning
    return back


def prompt_tokens(srv: Server, messages: list[dict[str, Any]], tenant: str = "",
                  **body: Any) -> list[int]:
    """The prompt's token ids exactly as the server renders and tokenizes them."""
    engine = srv.app[ENGINE]
    req = parse_chat_request({"model": "x", "messages": messages, **KEEP, **body})
    return chat_prompt(engine.tokenizer, srv.app[TEMPLATE], req, tenant,
                       engine.n_ctx).tokens.tolist()


def parting(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


async def admin_misses(srv: Server, key: str = "") -> list[dict[str, Any]]:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as http, \
            http.get(f"{srv.url}/admin/misses", headers=headers) as r:
        assert r.status == 200, await r.text()
        return list((await r.json())["misses"])


async def metric(srv: Server, name: str) -> dict[str, float]:
    """Samples of one /metrics family: {labels text: value}."""
    async with aiohttp.ClientSession() as http, http.get(f"{srv.url}/metrics") as r:
        text = await r.text()
    return {m[1] or "": float(m[2]) for m in re.finditer(
        rf"^{name}(?:{{([^}}]*)}})? (\S+)$", text, re.M)}


@pytest.fixture
def debug_log() -> Iterator[list[str]]:
    """The app's debug lines (each request's divergence)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("proxy.api.app")
    handler, old = Keep(logging.DEBUG), logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)
    logger.setLevel(old)


async def test_system_prompt_changed(hybrid_path: Path, tmp_path: Path,
                                     done_lines: DoneLines) -> None:
    # Each new agent process rebuilds its system prompt with a fresh git status: an
    # uncommitted edit moves the prompt's middle, and the Done line names it.
    first = [{"role": "system", "content": system("clean")},
             {"role": "user", "content": "Run the tests."}]
    second = [{"role": "system", "content": system("M proxy/api/app.py")},
              {"role": "user", "content": "Run the tests."}]
    async with serve(hybrid_path, tmp_path / "ckpt", **BASE) as srv:
        await chat(srv, first)
        await chat(srv, second)
        at = parting(prompt_tokens(srv, first), prompt_tokens(srv, second))
        rows = await admin_misses(srv)
        counted = await metric(srv, "statecache_misses_total")
    # the Done line is written after the reply is sent: read the lines once it is closed
    assert misses(done_lines)[0]["cause"] is None  # the first request is no miss
    miss = misses(done_lines)[1]
    assert miss["cause"] == "system prompt changed", done_lines.events
    assert miss["token"] == f"{at:,}" and (miss["message"], miss["role"]) == ("0", "system")
    assert "clean" in (miss["text"] or "") and "M proxy/api" in (miss["text"] or "")
    assert [(r["cause"], r["token"], r["message"]) for r in rows] == \
        [("system prompt changed", at, 0)]
    assert counted == {'cause="system prompt changed"': 1.0}


async def test_tools_changed(hybrid_path: Path, tmp_path: Path, done_lines: DoneLines) -> None:
    # The tools render inside the system block: a changed description moves everything
    # after it, and the message list alone would not show why.
    def tools(what: str) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {
            "name": "run_tests", "description": f"Run {what} and return the output.",
            "parameters": {"type": "object", "properties": {}}}}]

    messages = [{"role": "system", "content": SYSTEM_HEAD},
                {"role": "user", "content": "Run the tests."}]
    async with serve(hybrid_path, tmp_path / "ckpt", **BASE) as srv:
        await chat(srv, messages, tools=tools("the unit tests"))
        await chat(srv, messages, tools=tools("the whole test suite"))
        at = parting(prompt_tokens(srv, messages, tools=tools("the unit tests")),
                     prompt_tokens(srv, messages, tools=tools("the whole test suite")))
    miss = misses(done_lines)[1]
    assert (miss["cause"], miss["token"], miss["message"]) == ("tools changed", f"{at:,}", None)
    assert "unit tests" in (miss["text"] or "") and "whole test" in (miss["text"] or "")


async def test_earlier_message_edited(hybrid_path: Path, tmp_path: Path,
                                      done_lines: DoneLines) -> None:
    # A client edits the first user message and goes on: the engine starts from the end
    # of the system prompt, the edit is far past it.
    ask = "Read tests/test_pool.py, then run it, then tell me which assertion fails. " * 3
    first = [{"role": "system", "content": SYSTEM_HEAD}, {"role": "user", "content": ask}]
    async with serve(hybrid_path, tmp_path / "ckpt", **BASE) as srv:
        reply = await chat(srv, first)
        edited = [first[0], {"role": "user", "content": ask.replace("tell me", "show me", 2)},
                  reply, {"role": "user", "content": "And now?"}]
        await chat(srv, edited)
        at = parting(prompt_tokens(srv, first), prompt_tokens(srv, edited))
    miss = misses(done_lines)[1]
    assert (miss["cause"], miss["token"]) == ("earlier message edited", f"{at:,}")
    assert (miss["message"], miss["role"]) == ("1", "user")
    assert "'…" in (miss["text"] or "") and "tell me" in (miss["text"] or "")


async def test_reasoning_dropped(hybrid_path: Path, tmp_path: Path,
                                 done_lines: DoneLines) -> None:
    # The client sends the first reply back without its reasoning: the prompt leaves
    # the conversation where that reply's <think> began. Pages of 8 tokens: the replay
    # point sits at most 7 tokens before the reply, the divergence 11 after it.
    first = [{"role": "system", "content": SYSTEM_HEAD},
             {"role": "user", "content": "Run the tests."}]
    async with serve(hybrid_path, tmp_path / "ckpt", cache__page_size=8, **BASE) as srv:
        reply = await chat(srv, first)
        assert reply["reasoning_content"], "the template opens <think>: the reply reasons"
        dropped = [*first, {"role": "assistant", "content": reply["content"]},
                   {"role": "user", "content": "And now?"}]
        await chat(srv, dropped)
    miss = misses(done_lines)[1]
    assert (miss["cause"], miss["message"], miss["role"], miss["family"]) == \
        ("reasoning dropped", "2", "assistant", "hermes"), done_lines.events
    assert reply["reasoning_content"][:8] in (miss["text"] or "")


async def test_reply_re_rendered_differently(hybrid_path: Path, tmp_path: Path,
                                             done_lines: DoneLines) -> None:
    # The client sends the reply back with the same words but other whitespace inside
    # its reasoning: the text is the same, its tokens are not.
    async with serve(hybrid_path, tmp_path / "ckpt", cache__page_size=8, **BASE) as srv:
        for n in range(40):  # a greedy reply with whitespace well inside it
            first = [{"role": "system", "content": SYSTEM_HEAD},
                     {"role": "user", "content": f"Run test number {n}."}]
            reply = await chat(srv, first, max_tokens=64)
            r = reply.get("reasoning_content", "")
            at = next((i for i, ch in enumerate(r) if ch.isspace() and 12 <= i < len(r) - 1),
                      None)
            if at is not None:
                break
        assert at is not None, "no greedy reply with whitespace inside"
        other = " " if r[at] != " " else "\t"
        back = {**reply, "reasoning_content": r[:at] + other + r[at + 1:]}
        await chat(srv, [*first, back, {"role": "user", "content": "And now?"}])
    miss = misses(done_lines)[-1]
    assert (miss["cause"], miss["message"], miss["role"], miss["family"]) == \
        ("reply re-rendered differently", "2", "assistant", "hermes"), done_lines.events


async def test_other_tenant_without_their_text(hybrid_path: Path, tmp_path: Path,
                                               done_lines: DoneLines) -> None:
    # Bob sends Alice's system prompt: tenants never share states, so it is a miss whose
    # reason names another tenant and shows none of Alice's text, to anyone.
    keys = {"key-alice": "alice", "key-bob": "bob"}
    alice = [{"role": "system", "content": SYSTEM_HEAD},
             {"role": "user", "content": "Alice's secret plan: rewrite the pool."}]
    bob = [alice[0], {"role": "user", "content": "Run the tests."}]
    async with serve(hybrid_path, tmp_path / "ckpt", server__api_keys=keys,
                     server__admin_key="key-root", **BASE) as srv:
        for key, messages in (("key-alice", alice), ("key-bob", bob)):
            srv.client.api_key = key
            await chat(srv, messages)
        async with aiohttp.ClientSession() as http, http.get(
                f"{srv.url}/admin/misses", headers={"Authorization": "Bearer key-bob"}) as r:
            assert r.status == 403  # a tenant's key may not read the misses
        rows = await admin_misses(srv, "key-root")
    miss = misses(done_lines)[1]
    assert (miss["cause"], miss["token"], miss["text"]) == ("other tenant", "0", None)
    assert "secret" not in done_lines.events[-1]
    assert [(r["tenant"], r["cause"], r["old"], r["new"]) for r in rows] == \
        [("bob", "other tenant", "", "")]


async def test_evicted(hybrid_path: Path, tmp_path: Path, done_lines: DoneLines) -> None:
    # One lane, a RAM budget too small for any state, no disk: a second conversation
    # takes the lane, and the first one's next turn finds nothing, though its text agreed.
    a = [{"role": "system", "content": SYSTEM_HEAD},
         {"role": "user", "content": "Run the tests."}]
    b = [{"role": "system", "content": SYSTEM_TAIL},
         {"role": "user", "content": "Read the pool."}]
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=1, cache__ram_budget="4KiB",
                     cache__disk_enabled=False, **BASE) as srv:
        reply = await chat(srv, a)
        await chat(srv, b)
        await chat(srv, [*a, reply, {"role": "user", "content": "And now?"}])
        rows = await admin_misses(srv)
        n_first = len(prompt_tokens(srv, a))
    miss = misses(done_lines)[2]
    assert (miss["cause"], miss["token"], miss["message"]) == ("evicted", None, None)
    assert rows[0]["cause"] == "evicted" and rows[0]["reused"] == 0
    assert rows[0]["known"] > n_first  # the prompt and the reply


async def test_page_missing(hybrid_path: Path, tmp_path: Path, done_lines: DoneLines,
                            caplog: pytest.LogCaptureFixture) -> None:
    # As test_evicted, with a disk: the first conversation's states are on disk alone,
    # then their KV page files are deleted; its next turn is told why it found nothing.
    a = [{"role": "system", "content": SYSTEM_HEAD},
         {"role": "user", "content": "Run the tests."}]
    b = [{"role": "system", "content": SYSTEM_TAIL},
         {"role": "user", "content": "Read the pool."}]
    caplog.set_level(logging.WARNING, logger="statecache.pool.lost")
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=1, cache__ram_budget="4KiB",
                     **BASE) as srv:
        reply = await chat(srv, a)
        await chat(srv, b)
        pool = srv.app[ENGINE].pool
        assert pool is not None
        await asyncio.to_thread(pool.flush)
        pages = sorted((tmp_path / "ckpt").glob("pages-*/*/*.kvp"))
        assert pages
        for page in pages:
            page.unlink()
        await chat(srv, [*a, reply, {"role": "user", "content": "And now?"}])
        rows = await admin_misses(srv)
        dropped = await metric(srv, "statecache_pool_dropped_total")
    assert rows[0]["cause"] == "page missing" and rows[0]["reused"] == 0
    assert misses(done_lines)[2]["cause"] == "page missing"
    assert dropped['reason="missing"'] >= 1
    lines = [r.getMessage() for r in caplog.records if "is missing" in r.getMessage()]
    assert lines and all(any(p.stem in line for p in pages) for line in lines)


async def test_cache_off(hybrid_path: Path, tmp_path: Path, done_lines: DoneLines) -> None:
    a = [{"role": "system", "content": SYSTEM_HEAD},
         {"role": "user", "content": "Run the tests."}]
    async with serve(hybrid_path, tmp_path / "ckpt", cache__enabled=False) as srv:
        reply = await chat(srv, a)
        await chat(srv, [*a, reply, {"role": "user", "content": "And now?"}])
    assert misses(done_lines)[1]["cause"] == "cache off"


async def test_new_conversation(hybrid_path: Path, tmp_path: Path, done_lines: DoneLines,
                                debug_log: list[str]) -> None:
    # Nothing earlier shares more than a page: the divergence says so (debug line) and
    # the engine counts no miss, since there was nothing to reuse.
    a = [{"role": "system", "content": SYSTEM_HEAD}, {"role": "user", "content": "Hi."}]
    b = [{"role": "system", "content": SYSTEM_TAIL}, {"role": "user", "content": "Hi."}]
    subagent = [a[0], {"role": "user", "content": "Read the pool."}]  # the same system prompt
    async with serve(hybrid_path, tmp_path / "ckpt", **BASE) as srv:
        await chat(srv, a)
        await chat(srv, b)
        await chat(srv, subagent)
    starts = [m[1] for m in map(re.compile(r"chatcmpl-\w+: (.*)").fullmatch, debug_log) if m]
    assert starts[0] == "new conversation"
    assert re.fullmatch(r"new conversation at token \d+", starts[1]), starts
    assert re.fullmatch(r"new conversation at token \d+ \(message 1, user\): .*", starts[2])
    assert [m["cause"] for m in misses(done_lines)][:2] == [None, None]


# -- an edited system prompt falls back to the deepest checkpoint before the edit ---------

def _edited_pair() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    ask = {"role": "user", "content": "Run the tests."}
    return ([{"role": "system", "content": system("clean")}, ask],
            [{"role": "system", "content": system("M proxy/api/app.py")}, ask])


async def test_edited_system_prompt_reuses_pages_before_the_edit_in_its_lane(
        hybrid_path: Path, tmp_path: Path, done_lines: DoneLines) -> None:
    # Periodic checkpoints every 4 pages: the lane that served the first prompt rolls
    # back to the deepest one before the edit (a hybrid cannot cut its state anywhere).
    first, second = _edited_pair()
    async with serve(hybrid_path, tmp_path / "ckpt", cache__periodic_pages=4) as srv:
        await chat(srv, first)
        await chat(srv, second)
        at = parting(prompt_tokens(srv, first), prompt_tokens(srv, second))
    deepest = at // (4 * PAGE) * (4 * PAGE)
    assert deepest > 0
    assert done_lines.rows[1][1] == deepest, (at, done_lines.events)
    miss = misses(done_lines)[1]
    assert (miss["cause"], miss["token"]) == ("system prompt changed", f"{at:,}")


async def test_edited_system_prompt_reuses_pages_before_the_edit_in_a_fresh_lane(
        hybrid_path: Path, tmp_path: Path, done_lines: DoneLines) -> None:
    # One lane: another conversation takes it between the two, as a new agent process
    # would find the server. The second prompt must start from a checkpoint before
    # the edit, never from zero.
    first, second = _edited_pair()
    other = [{"role": "system", "content": SYSTEM_TAIL}, {"role": "user", "content": "Hi."}]
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=1,
                     cache__periodic_pages=4) as srv:
        await chat(srv, first)
        await chat(srv, other)
        await chat(srv, second)
        at = parting(prompt_tokens(srv, first), prompt_tokens(srv, second))
    miss = misses(done_lines)[2]
    assert (miss["cause"], miss["token"]) == ("system prompt changed", f"{at:,}")
    assert done_lines.rows[2][1] >= at // (4 * PAGE) * (4 * PAGE) > 0, done_lines.events


# -- volatile fragments: Claude Code's billing line -------------------------------------

BILLING = "x-anthropic-billing-header: cc_version=2.1.117.{}; cc_entrypoint=cli; cch={};"
CONFIGS = Path(__file__).resolve().parents[2] / "configs"


async def _two_claude_code_processes(srv: Server) -> None:
    """The same task from two processes: only the billing line of system[0] differs."""
    async with AsyncAnthropic(base_url=srv.url, api_key="unused", max_retries=0,
                              timeout=120) as client:
        for suffix, cch in (("48f", "71fea"), ("a03", "0aaa9")):
            await client.messages.create(
                model="statecache", max_tokens=8,
                system=[{"type": "text", "text": BILLING.format(suffix, cch)},
                        {"type": "text", "text": SYSTEM_HEAD}],
                messages=[{"role": "user", "content": "Run the tests."}])


async def test_billing_line_misses_without_the_rule(hybrid_path: Path, tmp_path: Path,
                                                    done_lines: DoneLines) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", **BASE) as srv:
        await _two_claude_code_processes(srv)
        assert await metric(srv, "statecache_volatile_replacements_total") == {}
    miss = misses(done_lines)[1]
    assert (miss["cause"], miss["message"], miss["role"]) == ("system prompt changed", "0",
                                                              "system")
    assert "48f" in (miss["text"] or "") and "a03" in (miss["text"] or "")
    assert done_lines.rows[1][1] < int((miss["token"] or "0").replace(",", ""))


async def test_billing_line_rule_from_the_agent_config(hybrid_path: Path, tmp_path: Path,
                                                       done_lines: DoneLines) -> None:
    # configs/hybrid-agent.toml's rule drops the line: the second process's prompt is
    # the first one's, and it reuses all of it: the logits of its last row were kept.
    rules = load_config(CONFIGS / "hybrid-agent.toml").server.volatile
    async with serve(hybrid_path, tmp_path / "ckpt", server__volatile=[
            {"pattern": r.pattern, "replace": r.replace, "name": r.name} for r in rules],
            **BASE) as srv:
        await _two_claude_code_processes(srv)
        counted = await metric(srv, "statecache_volatile_replacements_total")
    assert counted == {'rule="claude-code-billing"': 2.0}
    (n1, _, _), (n2, cached, prefilled) = done_lines.rows
    assert n1 == n2 and cached == n2 and prefilled == 0, done_lines.events
    assert [m["cause"] for m in misses(done_lines)] == [None, None]


async def test_inspect_misses(hybrid_path: Path, tmp_path: Path,
                              capsys: pytest.CaptureFixture[str]) -> None:
    first, second = _edited_pair()
    async with serve(hybrid_path, tmp_path / "ckpt", **BASE) as srv:
        await chat(srv, first)
        await chat(srv, second)
        capsys.readouterr()
        assert await asyncio.to_thread(cli_main, ["inspect", "--misses", "--url", srv.url]) == 0
        table = capsys.readouterr().out
        assert await asyncio.to_thread(
            cli_main, ["inspect", "--misses", "--url", srv.url, "--json"]) == 0
        rows = json.loads(capsys.readouterr().out)["misses"]
    assert [r["cause"] for r in rows] == ["system prompt changed"]
    assert f"reused 0 of {rows[0]['known']:,}  system prompt changed at token " \
        f"{rows[0]['token']:,} (message 0, system): " in table
    assert table.endswith("1 miss(es)\n")


async def test_responses_and_completions_say_why(hybrid_path: Path, tmp_path: Path,
                                                 done_lines: DoneLines) -> None:
    # Responses: the instructions are the system prompt. Completions: the raw prompt is
    # one message of role "prompt", compared as text.
    async with serve(hybrid_path, tmp_path / "ckpt", **BASE) as srv:
        for status in ("clean", "M proxy/api/app.py"):
            await srv.client.responses.create(model="statecache", instructions=system(status),
                                              input="Run the tests.", max_output_tokens=8,
                                              temperature=0)
        for status in ("clean", "M proxy/api/app.py"):
            await srv.client.completions.create(model="statecache", prompt=system(status),
                                                max_tokens=8, temperature=0)
    found = misses(done_lines)
    assert (found[1]["cause"], found[1]["message"], found[1]["role"]) == \
        ("system prompt changed", "0", "system")
    assert (found[3]["cause"], found[3]["message"], found[3]["role"]) == \
        ("earlier message edited", "0", "prompt"), done_lines.events
    assert "clean" in (found[3]["text"] or "")
