"""The HTTP surface with the real openai client: endpoints, errors, disconnects, busy."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import openai
import pytest

from statecache.cli import main as cli_main
from tests.http.conftest import DoneLines, Hold, serve

pytestmark = pytest.mark.http

HELLO = [{"role": "user", "content": "Say hello."}]


async def test_models_health_metrics(hybrid_path: Path, tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        models = await srv.client.models.list()
        assert [m.id for m in models.data] == [hybrid_path.name]
        await srv.client.chat.completions.create(model="x", messages=HELLO,  # type: ignore[arg-type]
                                                 max_tokens=4, temperature=0)
        async with aiohttp.ClientSession() as http:
            async with http.get(srv.url + "/health") as r:
                health = await r.json()
                assert r.status == 200 and health["model"] == hybrid_path.name
                assert health["memory"]["kind"] == "hybrid"
            async with http.get(srv.url + "/metrics") as r:
                text = await r.text()
    assert r.content_type.startswith("text/plain")
    assert "statecache_requests_total 1" in text.replace("{}", "")


@pytest.mark.parametrize(("body", "status", "param"), [
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "messages"),
    ({"messages": HELLO, "temperature": "hot"}, 400, "temperature"),
    ({"messages": HELLO, "n": 2}, 400, "n"),
    ({"messages": HELLO, "max_tokens": -1}, 400, "max_tokens"),
    ({"messages": HELLO, "max_tokens": 10_000_000}, 400, "messages"),
    ({"messages": [{"role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "messages"),
])
async def test_bad_requests_get_openai_errors(
    hybrid_path: Path, tmp_path: Path, body: dict[str, object], status: int, param: str
) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        with pytest.raises(openai.APIStatusError) as err:
            await srv.client.chat.completions.create(model="x", **body)  # type: ignore[call-overload]
        assert err.value.status_code == status
        error = err.value.body
        assert isinstance(error, dict) and error.get("type") == "invalid_request_error"
        assert (error.get("param") or "").startswith(param), error
        # the server is still fine afterwards
        ok = await srv.client.chat.completions.create(model="x", messages=HELLO,  # type: ignore[arg-type]
                                                      max_tokens=2, temperature=0)
        assert ok.choices[0].finish_reason == "length"


async def test_invalid_json_and_unknown_route(hybrid_path: Path, tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv, aiohttp.ClientSession() as http:
        async with http.post(srv.url + "/v1/chat/completions", data=b"{not json") as r:
            assert r.status == 400
            assert (await r.json())["error"]["type"] == "invalid_request_error"
        async with http.get(srv.url + "/v1/nothing") as r:
            assert r.status == 404
            assert "error" in await r.json()
        async with http.get(srv.url + "/v1/chat/completions") as r:
            assert r.status == 405


async def test_completions_streaming_and_not(hybrid_path: Path, tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        full = await srv.client.completions.create(model="x", prompt="Once upon a time",
                                                   max_tokens=12, temperature=0)
        parts = []
        stream = await srv.client.completions.create(model="x", prompt="Once upon a time",
                                                     max_tokens=12, temperature=0, stream=True)
        async for chunk in stream:
            parts.append(chunk.choices[0].text if chunk.choices else "")
    assert full.choices[0].text == "".join(parts) != ""
    assert full.usage is not None and full.usage.completion_tokens == 12


async def test_chat_stream_equals_non_stream_and_reports_usage(
    hybrid_path: Path, tmp_path: Path
) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        full = await srv.client.chat.completions.create(
            model="x", messages=HELLO, max_tokens=16, temperature=0)  # type: ignore[arg-type]
        stream = await srv.client.chat.completions.create(
            model="x", messages=HELLO, max_tokens=16, temperature=0, stream=True,  # type: ignore[arg-type]
            stream_options={"include_usage": True})
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                d = chunk.choices[0].delta
                text += (d.content or "") + ((d.model_extra or {}).get("reasoning_content") or "")
            if chunk.usage:
                usage = chunk.usage
    m = full.choices[0].message
    assert text == (m.content or "") + ((m.model_extra or {}).get("reasoning_content") or "")
    assert usage is not None and usage.completion_tokens == 16
    # the second identical request reused the first one's state, all of it (the logits
    # of the prompt's last row were kept with it)
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens


async def test_cache_prompt_false_reuses_and_leaves_nothing(hybrid_path: Path,
                                                             tmp_path: Path) -> None:
    """llama-server's ``cache_prompt: false``: served cold, whatever is cached, and
    nothing left cached for the next request (on every API)."""
    def long(topic: str) -> list[dict[str, str]]:
        return [{"role": "user", "content": " ".join(
            f"Note {i} about {topic}: keep it short." for i in range(24))}]

    async def chat(messages: list[dict[str, str]], **extra: object) -> int:
        r = await srv.client.chat.completions.create(
            model="x", messages=messages, max_tokens=4, temperature=0,  # type: ignore[arg-type]
            extra_body=extra or None)
        assert r.usage is not None and r.usage.prompt_tokens > 128
        return (r.usage.prompt_tokens_details.cached_tokens or 0) \
            if r.usage.prompt_tokens_details else 0

    async with serve(hybrid_path, tmp_path / "ckpt") as srv, aiohttp.ClientSession() as http:
        first = long("apples")
        assert await chat(first) == 0
        assert await chat(first) > 64  # the cache serves this prompt
        assert await chat(first, cache_prompt=False) == 0
        assert await chat(first, cache_prompt=True) > 64
        other = long("pears")
        assert await chat(other, cache_prompt=False) == 0
        assert await chat(other) == 0  # the cold request left nothing to reuse
        async with http.get(srv.url + "/admin/misses") as r:
            causes = [m["cause"] for m in (await r.json())["misses"]]
        # the one miss is the cold request's own: a cold request is not remembered, so
        # the next one, which found nothing, did not miss anything it had reason to find
        assert causes == ["cache off"]
        body = {"model": "x", "max_tokens": 4, "messages": first, "cache_prompt": False}
        async with http.post(srv.url + "/v1/messages", json=body) as r:
            assert r.status == 200, await r.text()
            usage = (await r.json())["usage"]
        assert usage["cache_read_input_tokens"] == 0 and usage["input_tokens"] > 128
        for bad in ({"cache_prompt": "no"}, {"cache_prompt": False, "max_tokens": 0}):
            async with http.post(srv.url + "/v1/chat/completions",
                                 json={"model": "x", "messages": HELLO, **bad}) as r:
                assert r.status == 400
                assert (await r.json())["error"]["param"] == "cache_prompt"


async def test_client_disconnect_stops_generation(
    hybrid_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=1) as srv:
        stream = await srv.client.chat.completions.create(
            model="x", messages=HELLO, max_tokens=3000, temperature=0, stream=True)  # type: ignore[arg-type]
        got = 0
        async for _ in stream:
            got += 1
            if got == 5:
                break
        await stream.close()
        # the lane comes free quickly: the next request is served
        nxt = await asyncio.wait_for(srv.client.chat.completions.create(
            model="x", messages=HELLO, max_tokens=2, temperature=0), timeout=30)  # type: ignore[arg-type]
        assert nxt.choices[0].finish_reason == "length"
    first = done_lines.events[1]
    assert first.startswith("Done") and "cancelled" in first, done_lines.events
    out = int(first.split("output ")[1].split(" ")[0].replace(",", ""))
    assert out < 3000


async def test_busy_server_answers_503_with_retry_after(hybrid_path: Path, tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=1,
                     server__queue_size=0) as srv:
        stream = await srv.client.chat.completions.create(
            model="x", messages=HELLO, max_tokens=3000, temperature=0, stream=True)  # type: ignore[arg-type]
        async for _ in stream:
            break
        async with aiohttp.ClientSession() as http, http.post(
                srv.url + "/v1/chat/completions", json={"messages": HELLO, "max_tokens": 2}) as r:
            assert r.status == 503
            assert float(r.headers["Retry-After"]) > 0
            assert "error" in await r.json()
        await stream.close()


async def test_admin_endpoint_and_inspect(
    hybrid_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        await srv.client.chat.completions.create(
            model="x", messages=[{"role": "system", "content": "S" * 200}, *HELLO],  # type: ignore[list-item]
            max_tokens=8, temperature=0)
        async with aiohttp.ClientSession() as http:
            async with http.get(srv.url + "/admin/checkpoints") as r:
                listed = (await r.json())["checkpoints"]
            assert listed, "a request publishes checkpoints"
            async with http.get(srv.url + f"/admin/checkpoints/{listed[0]['id']}") as r:
                assert r.status == 200 and (await r.json())["id"] == listed[0]["id"]
            async with http.get(srv.url + "/admin/checkpoints/" + "0" * 32) as r:
                assert r.status == 404
        # statecache inspect reads the running proxy (run in a thread: it blocks)
        rc = await asyncio.to_thread(cli_main, ["inspect", "--url", srv.url, "--disk-path",
                                                str(tmp_path / "ckpt"), "--json"])
        assert rc == 0
    shown = json.loads(capsys.readouterr().out)["checkpoints"]
    ram = [c for c in shown if "ram" in str(c.get("tier", c.get("tiers")))]
    assert {c["id"] for c in listed} <= {c["id"] for c in ram}, shown


async def test_request_timeout_is_504_and_default_max_tokens_applies(
    hybrid_path: Path, tmp_path: Path, done_lines: DoneLines
) -> None:
    # The request that must outlast the timeout finds the engine held (its steps wait
    # until the 504 is in), not merely a long reply: how long a reply takes is the
    # machine's to say. The requests that must not time out are a few tokens each.
    async with serve(hybrid_path, tmp_path / "ckpt", server__lanes=1,
                     server__request_timeout=2.0, server__max_tokens_default=5) as srv:
        short = await srv.client.chat.completions.create(
            model="x", messages=HELLO)  # type: ignore[arg-type]
        assert short.usage is not None and short.usage.completion_tokens == 5
        with Hold(srv) as hold, pytest.raises(openai.APIStatusError) as err:
            await srv.client.chat.completions.create(
                model="x", messages=HELLO, max_tokens=4000)  # type: ignore[arg-type]
        assert hold.held.is_set() and err.value.status_code == 504
        # the engine stopped that request and serves the next one
        ok = await srv.client.chat.completions.create(
            model="x", messages=HELLO, max_tokens=2)  # type: ignore[arg-type]
        assert ok.choices[0].finish_reason == "length"
    assert any("cancelled" in e for e in done_lines.events)


async def test_logprobs_streaming_equal_non_streaming(hybrid_path: Path, tmp_path: Path) -> None:
    # bitwise: no drafts (a verification batch is another product on this model, and
    # adaptive drafting batches as the machine's timings say: docs/design.md fact 16)
    off = {"speculative": False}
    async with serve(hybrid_path, tmp_path / "ckpt", cache__enabled=False) as srv:
        full = await srv.client.chat.completions.create(
            model="x", messages=HELLO, max_tokens=12, temperature=0,  # type: ignore[arg-type]
            logprobs=True, top_logprobs=3, extra_body=off)
        stream = await srv.client.chat.completions.create(
            model="x", messages=HELLO, max_tokens=12, temperature=0,  # type: ignore[arg-type]
            logprobs=True, top_logprobs=3, stream=True, extra_body=off)
        streamed = []
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
                streamed += chunk.choices[0].logprobs.content
        legacy = await srv.client.completions.create(model="x", prompt="abc", max_tokens=5,
                                                     temperature=0, logprobs=2)
    lp = full.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 12
    assert [(t.token, t.logprob) for t in streamed] == [(t.token, t.logprob) for t in lp.content]
    for t in lp.content:
        # greedy: the chosen token is the most likely one, listed first among the top 3
        assert len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.logprob <= 0 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
    legacy_lp = legacy.choices[0].logprobs
    assert legacy_lp is not None and legacy_lp.tokens is not None
    assert len(legacy_lp.tokens) == 5 and "".join(legacy_lp.tokens) == legacy.choices[0].text
