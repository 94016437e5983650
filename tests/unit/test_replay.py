"""What the agents send, written down and sent again: tools/recorder.py between a real
client and a real aiohttp server, and bench.replay's reading of the files and of the
replies; bench.replay_report's paired ratios."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from bench.replay import _first_output, _usage, for_llama_server, greedy_one_token, kinds, load
from bench.replay_report import TITLE, into_doc, ratios, table
from tools.recorder import SCRATCH_KEY, Recorder, read_records, write_records


@pytest.fixture
def upstream() -> Iterator[tuple[str, list[dict[str, object]]]]:
    """A real server that answers a JSON POST with three server-sent events, and keeps
    what it received."""
    got: list[dict[str, object]] = []

    async def events(request: web.Request) -> web.StreamResponse:
        got.append({"headers": {k.lower(): v for k, v in request.headers.items()},
                    "body": await request.json()})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(3):
            await resp.write(f"data: {json.dumps({'n': i})}\n\n".encode())
        return resp

    async def head(request: web.Request) -> web.Response:
        return web.Response(text="here")

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/messages", events)
    app.router.add_route("HEAD", "/", head)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", got
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_the_recorder_forwards_and_writes_down_each_request(
        upstream: tuple[str, list[dict[str, object]]], tmp_path: Path) -> None:
    url, got = upstream
    rec = Recorder(url)
    port = rec.start()
    try:
        rec.label = "turn 1"
        req = urllib.request.Request(f"http://127.0.0.1:{port}/", method="HEAD")
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.status == 200
        body = {"model": "m", "messages": [{"role": "user", "content": "é"}], "stream": True}
        req = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/messages?beta=true", data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", "x-api-key": "sk-real-looking",
                     "X-Claude-Code-Session-Id": "abc"}, method="POST")
        rec.label = "turn 2"
        with urllib.request.urlopen(req, timeout=10) as r:
            streamed = r.read().decode()
    finally:
        rec.stop()
    # the reply came through whole, and the server got the body as sent
    assert [json.loads(ln[5:]) for ln in streamed.split("\n\n") if ln] == \
        [{"n": 0}, {"n": 1}, {"n": 2}]
    assert got[0]["body"] == body
    assert got[0]["headers"]["x-api-key"] == SCRATCH_KEY  # type: ignore[index]
    path = tmp_path / "claude-gemma3.jsonl.zst"
    write_records(path, rec.records)
    back = read_records(path)
    assert [(r["label"], r["method"], r["path"]) for r in back] == \
        [("turn 1", "HEAD", "/"), ("turn 2", "POST", "/v1/messages?beta=true")]
    assert back[1]["body"] == body
    headers = dict(back[1]["headers"])
    headers = {k.lower(): v for k, v in headers.items()}
    assert headers["x-api-key"] == SCRATCH_KEY and headers["x-claude-code-session-id"] == "abc"
    assert "sk-real-looking" not in path.read_bytes().decode("latin-1")
    # read back for the replay: kinds, and a greedy reply of one token
    fx = load(path)
    assert (fx.agent, fx.model) == ("claude", "gemma3")
    assert [s.kind for s in fx.requests] == ["other", "cold"]
    assert json.loads(fx.requests[1].body)["max_tokens"] == 1


def test_kinds_of_requests() -> None:
    def post(label: str, n: int, stream: bool = True,
             path: str = "/v1/messages?beta=true") -> dict[str, object]:
        return {"method": "POST", "path": path, "label": label,
                "body": {"messages": ["m"] * n, "stream": stream}}

    recs = [{"method": "HEAD", "path": "/", "label": "turn 1"},
            post("turn 1", 1, path="/v1/messages/count_tokens"),
            post("turn 1", 1), post("turn 1", 1, stream=False),  # a retry, not streamed
            post("turn 1", 3), post("turn 2", 5), post("new session", 1),
            post("new session", 3)]
    assert kinds(recs) == ["other", "other", "cold", "retry", "follow-up", "follow-up",
                           "new session", "follow-up"]


def test_each_api_is_asked_for_one_greedy_token() -> None:
    assert greedy_one_token("/v1/responses", {"input": [], "temperature": 1.0}) == \
        {"input": [], "temperature": 0.0, "max_output_tokens": 1}
    assert greedy_one_token("/v1/chat/completions", {"max_completion_tokens": 9, "top_p": 0.5}) \
        == {"max_tokens": 1, "temperature": 0.0}
    assert greedy_one_token("/v1/messages", {"max_tokens": 32000})["max_tokens"] == 1
    assert greedy_one_token("/v1/messages/count_tokens", {"x": 1}) == {"x": 1}


def test_what_counts_as_output_and_usage() -> None:
    assert not _first_output({"type": "message_start", "message": {}})
    assert not _first_output({"type": "response.created"})
    assert _first_output({"type": "content_block_delta", "delta": {"text": "a"}})
    assert _first_output({"type": "response.output_text.delta", "delta": "a"})
    assert _first_output({"choices": [{"delta": {"content": "a"}}]})
    assert not _first_output({"choices": [{"delta": {"role": "assistant"}}]})
    got: dict[str, int] = {}
    _usage({"type": "message_start", "message": {"usage": {
        "input_tokens": 10, "cache_read_input_tokens": 90}}}, got)
    assert got == {"prompt": 100, "cached": 90}
    got = {}
    _usage({"type": "response.completed", "response": {"usage": {
        "input_tokens": 100, "input_tokens_details": {"cached_tokens": 64}}}}, got)
    assert got == {"prompt": 100, "cached": 64}


def _row(system: str, repeat: int, index: int, kind: str, ttft: float,
         status: int = 200) -> dict[str, object]:
    return {"fixture": "codex-smollm2", "system": system, "repeat": repeat, "index": index,
            "kind": kind, "status": status, "ttft_s": ttft, "cached_tokens": 10,
            "server": {"outside_ms": 2.0, "ttft_s": ttft, "phases_ms": {"render": 1.0}}}


def test_ratios_pair_each_request_with_itself_in_the_same_repeat() -> None:
    rows = [_row("statecache", 0, 1, "cold", 2.0), _row("llama-server", 0, 1, "cold", 4.0),
            _row("statecache", 1, 1, "cold", 3.0), _row("llama-server", 1, 1, "cold", 3.0),
            _row("statecache", 0, 2, "follow-up", 1.0),
            _row("llama-server", 0, 2, "follow-up", 1.0, status=400)]
    r = ratios(rows, "statecache", "llama-server")
    assert r == {("codex-smollm2", "cold"): [0.5, 1.0]}  # the refused pair is left out
    text = "\n".join(table({"results": rows, "systems": ["statecache", "llama-server"],
                            "repeats": 2, "lanes": 1, "threads": 2,
                            "fixtures": {"codex-smollm2": {"agent": "codex",
                                                           "model": "smollm2"}}}))
    assert "0.750 (0.50–1.00 (range)), n=2" in text


def test_the_replay_section_of_the_benchmarks_page_is_replaced_in_place(tmp_path: Path
                                                                       ) -> None:
    rows = [_row("statecache", 0, 1, "cold", 2.0), _row("llama-server", 0, 1, "cold", 4.0)]
    data = {"results": rows, "systems": ["statecache", "llama-server"], "repeats": 1,
            "lanes": 1, "threads": 2, "seconds": 60.0,
            "fixtures": {"codex-smollm2": {"agent": "codex", "model": "smollm2"}}}
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# statecache benchmark (full)\n\n## gemma\n\nkept\n\n"
                   "## Batched steps under load\n\nalso kept\n")
    into_doc(doc, data, "python -m bench.replay")
    first = doc.read_text()
    assert first.index("kept") < first.index(TITLE) < first.index("## Batched")
    assert "0.500" in first and "also kept" in first
    rows[0]["ttft_s"] = 3.0  # a later run: its own figures, in the same place, once
    into_doc(doc, data, "python -m bench.replay")
    again = doc.read_text()
    assert again.count(TITLE) == 1 and "0.750" in again and "0.500" not in again
    assert again.index("kept") < again.index(TITLE) < again.index("## Batched")
    assert again.endswith("also kept\n")


def test_llama_server_gets_codex_namespace_tools_as_the_functions_they_hold() -> None:
    fn = {"type": "function", "name": "f", "parameters": {}}
    inner = [{"type": "function", "name": "g", "parameters": {}},
             {"type": "function", "name": "h", "parameters": {}}]
    body = {"tools": [fn, {"type": "namespace", "name": "ns", "tools": inner},
                      {"type": "web_search"}], "input": []}
    assert for_llama_server("/v1/responses", body)["tools"] == [fn, *inner,
                                                                {"type": "web_search"}]
    assert for_llama_server("/v1/messages", body) is body


def test_llama_servers_gemma_template_folds_as_statecache_does(tmp_path: Path) -> None:
    """bench/servers.py gives llama-server a Gemma 3 template that folds system messages
    after the first and merges runs in the template, as statecache does before it: the
    same conversation renders to the same prompt on both."""
    from bench.servers import GEMMA_TEMPLATE, _gemma_template_for_llama_server
    from proxy.api.openai import parse_chat_request
    from proxy.api.render import ChatTemplate, render_chat

    ours = ChatTemplate(GEMMA_TEMPLATE.read_text(), bos_token="<bos>")
    theirs = ChatTemplate(_gemma_template_for_llama_server(tmp_path).read_text(),
                          bos_token="<bos>", inner_system="keep")
    # Claude Code's shape (a system message after the first user message, parts), Codex's
    # (developer items after the instructions, two user messages in a row), replies cut
    # into pieces, and system text with nothing after it
    for messages in (
            [{"role": "system", "content": "Be brief."},
             {"role": "user", "content": "  First part.  \n\nSecond part."},
             {"role": "system", "content": "Environment: /repo"},
             {"role": "assistant", "content": "One"}, {"role": "assistant", "content": "two."},
             {"role": "user", "content": "Go on."}],
            [{"role": "system", "content": "Instructions."},
             {"role": "system", "content": "Developer A."},
             {"role": "system", "content": "Developer B."},
             {"role": "user", "content": "<environment>x</environment>"},
             {"role": "user", "content": "Fix it."}],
            [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Yes?"},
             {"role": "system", "content": "Late note."}]):
        assert theirs.render(messages) == render_chat(ours, parse_chat_request(
            {"messages": messages}))
