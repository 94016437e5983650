"""The live page over HTTP (``GET /ui``, ``GET /admin/ui.json``): what it is served as,
who may see it, and what its data says after an agent session with a subagent; and
``statecache inspect --url``, which lists what that proxy holds (its own disk directory,
its own model)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDict

from statecache.cli import main as cli_main
from statecache.config import CacheConfig
from statecache.pool import CheckpointPool
from statecache.records import Kind, Owner, Role
from tests.http.agent import PRIOR
from tests.http.conftest import Server, serve
from tests.http.ui_session import EDITED, MAIN, SUB, agent_session, shared_branch

pytestmark = pytest.mark.http

ADMIN = "sk-admin"


async def _get(srv: Server, path: str, headers: dict[str, str] | None = None
               ) -> tuple[int, CIMultiDict[str], bytes]:
    async with aiohttp.ClientSession() as http, \
            http.get(srv.url + path, headers=headers or {}) as r:
        return r.status, CIMultiDict(r.headers), await r.read()


async def test_the_page_and_what_it_shows_after_an_agent_session(
        hybrid_path: Path, tmp_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "ckpt") as srv:
        sent = await agent_session(srv.client)
        status, headers, page = await _get(srv, "/ui")
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        text = page.decode()
        # self-contained: nothing is fetched from anywhere but this server
        assert not re.search(r"<link|<img|\bsrc=|@import|url\(|//fonts\.", text)
        assert set(re.findall(r"https?://[^\s\"'`)]+", text)) == {"http://www.w3.org/2000/svg"}
        assert "fetch(location.origin + \"/admin/ui.json\"" in text
        again, _, _ = await _get(srv, "/ui", {"If-None-Match": headers["ETag"]})
        assert again == 304
        status, _, raw = await _get(srv, "/admin/ui.json")
        assert status == 200
        data = json.loads(raw)
    lanes = {ln["session"]: ln for ln in data["lanes"]}
    assert set(lanes) == {MAIN, SUB} and all(ln["state"] == "idle" for ln in lanes.values())
    assert all("pages" not in ln for ln in data["lanes"])  # hashes never leave the server
    branch = shared_branch(data["tree"]["nodes"], sent.shared)
    assert sent.shared > 200 and branch["checkpoints"], branch  # the shared prefix is held
    # the last requests, newest first, with the cached counts the client was told
    rows = [(r["prompt_tokens"], r["cached_tokens"]) for r in data["requests"]]
    assert rows == sent.usage[::-1]
    miss = data["requests"][0]["miss_at"]
    assert miss["cause"] == "earlier message edited" and miss["message"] == 1
    # the text on each side of the difference, cut to an excerpt ("…" where cut)
    old, new = miss["old"].strip("…"), miss["new"].strip("…")
    assert "ring" in new and new in EDITED and "pool" in old and old in PRIOR[0]["content"]
    assert "earlier message edited" in data["requests"][0]["miss"]
    history = data["history"]
    assert sum(b["requests"] for b in history) == 5
    assert sum(b["cached"] for b in history) == sum(c for _, c in sent.usage)
    tiers = {t["label"]: t for t in data["tiers"]}
    assert tiers["RAM"]["bytes"] > 0 and tiers["RAM"]["budget"] > 0
    assert tiers["Disk"]["status"] == "ok"
    assert tiers["Disk"]["where"] == str((tmp_path / "ckpt").resolve())


async def test_the_page_with_the_cache_off(hybrid_path: Path, tmp_path: Path) -> None:
    """No pool: the page draws no tier, and the checkpoint list is empty, not an error."""
    async with serve(hybrid_path, tmp_path / "ckpt", cache__enabled=False) as srv:
        await srv.client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
        status, _, raw = await _get(srv, "/admin/ui.json")
        assert status == 200, raw
        data = json.loads(raw)
        status, _, listed = await _get(srv, "/admin/checkpoints")
    assert data["tiers"] == [] and data["requests"][0]["prompt_tokens"] > 0
    assert status == 200 and json.loads(listed)["checkpoints"] == []


def _basic(key: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"admin:{key}".encode()).decode()}


async def test_the_page_is_guarded_like_the_admin_routes(hybrid_path: Path, tmp_path: Path
                                                         ) -> None:
    async with serve(hybrid_path, tmp_path / "a", server__api_keys={"sk-alice": "alice"},
                     server__admin_key=ADMIN) as srv:
        for path in ("/ui", "/admin/ui.json"):
            for headers, want in [({}, 401), ({"Authorization": "Bearer sk-alice"}, 403),
                                  (_basic("sk-wrong"), 401),
                                  ({"Authorization": f"Bearer {ADMIN}"}, 200),
                                  (_basic(ADMIN), 200)]:
                status, got, body = await _get(srv, path, headers)
                assert status == want, (path, headers, status)
                if want != 200:
                    assert b"preview" not in body and b"<script" not in body
                if path == "/ui" and want == 401:  # a browser asks for the key
                    assert got["WWW-Authenticate"].startswith('Basic realm="statecache admin"')
    async with serve(hybrid_path, tmp_path / "b", server__admin=False) as srv:
        for path in ("/ui", "/admin/ui.json"):
            assert (await _get(srv, path))[0] == 404


def _foreign_checkpoint(directory: Path, key: Path) -> str:
    """A checkpoint of another model in ``directory``, under the same key."""
    pool = CheckpointPool(CacheConfig(page_size=32, disk_path=str(directory),
                                      secret_path=str(key)), "another-model:fp")
    rec = pool.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=list(range(1, 80)),
                      role=Role.REPLAY, data=b"x" * 64)
    assert rec is not None
    pool.close()  # writes it and unlocks the directory
    return rec.id


async def _on_disk(srv: Server) -> list[dict[str, Any]]:
    """The proxy's checkpoints once one of them is on disk."""
    for _ in range(100):
        _, _, raw = await _get(srv, "/admin/checkpoints")
        rows: list[dict[str, Any]] = json.loads(raw)["checkpoints"]
        if any("disk" in r["tiers"] for r in rows):
            return rows
        await asyncio.sleep(0.1)
    raise AssertionError("no checkpoint reached the disk")


async def test_inspect_url_lists_that_proxys_own_directory_and_model(
        hybrid_path: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ckpt, elsewhere = tmp_path / "ckpt", tmp_path / "elsewhere"
    foreign = _foreign_checkpoint(ckpt, tmp_path / "secret.key")
    stray = _foreign_checkpoint(elsewhere, tmp_path / "secret.key")  # the config's directory
    config = tmp_path / "other.toml"
    config.write_text(f'[cache]\ndisk_path = "{elsewhere}"\n')
    async with serve(hybrid_path, ckpt) as srv:
        url = srv.url
        await agent_session(srv.client)
        held = await _on_disk(srv)
        code = await asyncio.to_thread(
            cli_main, ["inspect", "--url", url, "--config", str(config), "--json"])
        assert code == 0
        shown = json.loads(capsys.readouterr().out)
        _, _, raw = await _get(srv, "/admin/checkpoints")
        told = json.loads(raw)
    assert told["model"] == hybrid_path.name and told["disk_path"] == str(ckpt.resolve())
    ids = {r["id"] for r in shown["checkpoints"]}
    assert {r["id"] for r in held} <= ids and foreign not in ids and stray not in ids
    assert all(r["model"] == hybrid_path.name for r in shown["checkpoints"])
    on_disk = [r for r in shown["checkpoints"] if "file" in r]
    assert on_disk and all(Path(r["file"]).parent == ckpt.resolve() for r in on_disk)
    assert any("1 checkpoint(s) of other models" in n for n in shown["notes"]), shown["notes"]
    code = await asyncio.to_thread(cli_main, ["inspect", "--url", url, "--config",
                                              str(config), "--json"])  # the proxy is gone
    shown = json.loads(capsys.readouterr().out)
    assert code == 0 and {r["id"] for r in shown["checkpoints"]} == {stray}


async def test_evicted_points_stay_on_the_page_as_gone(hybrid_path: Path, tmp_path: Path
                                                      ) -> None:
    """RAM only, with room for about one full state: a page open during the session saw
    checkpoints that later turns evicted, and draws them as gone where they were. (No
    idle saves: nothing changes the pool between the last two looks.)"""
    async with serve(hybrid_path, tmp_path / "ckpt", cache__disk_enabled=False,
                     cache__ram_budget="3MiB", engine__idle_save_s=0) as srv:
        seen: set[str] = set()

        async def look() -> dict[str, Any]:
            _, _, raw = await _get(srv, "/admin/ui.json")
            tree: dict[str, Any] = json.loads(raw)["tree"]
            seen.update(c["id"] for n in tree["nodes"] for c in n["checkpoints"])
            return tree

        await agent_session(srv.client, after_turn=look)
        tree = await look()
        _, _, raw = await _get(srv, "/admin/checkpoints")
        held = {r["id"][:12] for r in json.loads(raw)["checkpoints"]}
    chips = [c for n in tree["nodes"] for c in n["checkpoints"]]
    gone = {c["id"] for c in chips if c.get("gone")}
    assert len(gone) >= 3 and tree["gone"] == len(gone), (gone, seen, held)
    assert gone == seen - held  # every point seen and no longer held, and only those
    assert all(c["tiers"] == [] and c["gone_at"] > 0 for c in chips if c.get("gone"))
