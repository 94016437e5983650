"""API keys over HTTP: tenants come from keys, admin routes need the admin key."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from statecache.cli import main as cli_main
from tests.http.conftest import Server, serve

pytestmark = pytest.mark.http

KEYS = {"sk-alice": "alice", "sk-bob": "bob"}
ADMIN = "sk-admin"


def _client(srv: Server, key: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=120)


async def _cached(client: AsyncOpenAI, topic: str, **extra: Any) -> int:
    """Cached tokens of a request about ``topic`` (a conversation of its own)."""
    # the topic comes first, so that two topics share no page
    messages = [{"role": "system", "content": f"{topic}: answer questions about it. " * 6},
                {"role": "user", "content": f"Tell me about {topic}."}]
    r = await client.chat.completions.create(model="x", messages=messages,  # type: ignore[arg-type]
                                             max_tokens=2, temperature=0, **extra)
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens_details.cached_tokens or 0


async def test_tenants_come_from_keys_in_pairs_with_positive_controls(
        hybrid_path: Path, tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", server__api_keys=KEYS,
                     server__admin_key=ADMIN) as srv:
        alice, bob = _client(srv, "sk-alice"), _client(srv, "sk-bob")
        try:
            # control: the same tenant twice hits
            assert await _cached(alice, "rivers") == 0
            assert await _cached(alice, "rivers") > 0
            # alice, then bob: bob never reuses alice's state
            assert await _cached(alice, "mountains") == 0
            assert await _cached(bob, "mountains") == 0
            # bob claiming alice by header and by `user` is still bob
            assert await _cached(alice, "deserts") == 0
            assert await _cached(bob, "deserts", user="alice",
                                 extra_headers={"X-Statecache-Tenant": "alice"}) == 0
            # control: bob's own state serves bob whatever `user` says
            assert await _cached(bob, "deserts", user="mallory") > 0
        finally:
            await alice.close()
            await bob.close()


async def test_missing_or_unknown_keys_get_401_json(hybrid_path: Path, tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", server__api_keys=KEYS) as srv:
        for key in ("unused", "sk-alic", ADMIN):
            client = _client(srv, key)
            with pytest.raises(openai.AuthenticationError) as err:
                await client.models.list()
            await client.close()
            assert isinstance(err.value.body, dict)
            assert err.value.body.get("code") == "invalid_api_key"
        async with aiohttp.ClientSession() as http:
            async with http.post(srv.url + "/v1/chat/completions", json={"messages": []}) as r:
                assert r.status == 401  # before the body is even looked at
                assert (await r.json())["error"]["type"] == "invalid_request_error"
            async with http.get(srv.url + "/health") as r:
                assert r.status == 200
            # Anthropic clients send x-api-key
            async with http.get(srv.url + "/v1/models", headers={"x-api-key": "sk-bob"}) as r:
                assert r.status == 200


async def test_admin_routes_need_the_admin_key_and_inspect_sends_it(
        hybrid_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", server__api_keys=KEYS,
                     server__admin_key=ADMIN) as srv:
        alice = _client(srv, "sk-alice")
        await _cached(alice, "secrets")
        await alice.close()
        async with aiohttp.ClientSession() as http:
            for headers, status in [({}, 401), ({"Authorization": "Bearer sk-alice"}, 403),
                                    ({"Authorization": "Bearer sk-nobody"}, 401)]:
                async with http.get(srv.url + "/admin/checkpoints", headers=headers) as r:
                    assert r.status == status
                    assert "preview" not in await r.text()
            async with http.get(srv.url + "/admin/checkpoints",
                                headers={"Authorization": f"Bearer {ADMIN}"}) as r:
                assert r.status == 200
                rows = (await r.json())["checkpoints"]
        assert rows and all(c.get("preview") for c in rows), rows
        args = ["inspect", "--url", srv.url, "--disk-path", str(tmp_path / "ckpt"), "--json"]
        assert await asyncio.to_thread(cli_main, [*args, "--admin-key", ADMIN]) == 0
        shown = json.loads(capsys.readouterr().out)
        assert {c["id"] for c in rows} <= {c["id"] for c in shown["checkpoints"]}
        monkeypatch.setenv("STATECACHE_ADMIN_KEY", ADMIN)  # or from the environment
        assert await asyncio.to_thread(cli_main, args) == 0
        assert {c["id"] for c in rows} <= {
            c["id"] for c in json.loads(capsys.readouterr().out)["checkpoints"]}
        monkeypatch.delenv("STATECACHE_ADMIN_KEY")
        assert await asyncio.to_thread(cli_main, args) == 0  # without the key: disk only
        refused = json.loads(capsys.readouterr().out)
        assert any("refused" in n and "401" in n for n in refused["notes"]), refused["notes"]
        assert not {c["id"] for c in rows if "ram" in c.get("tiers", ["ram"])} & {
            c["id"] for c in refused["checkpoints"] if "ram" in c.get("tiers", [])}


async def test_admin_routes_can_be_turned_off(hybrid_path: Path, tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt", server__admin=False) as srv, \
            aiohttp.ClientSession() as http:
        async with http.get(srv.url + "/admin/checkpoints") as r:
            assert r.status == 404
        async with http.get(srv.url + "/v1/models") as r:
            assert r.status == 200  # no keys: everything else as before
