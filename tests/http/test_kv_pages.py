"""A conversation's KV in pages, through the proxy, on each memory kind (plain attention,
sliding-window attention, hybrid): the next turn restores from the shared tier on a
proxy that never saw the conversation, then from the disk on a restarted proxy, and
every answer equals the same request served with caching off. A page missing on disk
makes the states that need it misses, never wrong states."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from proxy.api.app import ENGINE
from statecache.formats.diskfmt import read_meta
from statecache.tiers.diskfiles import PAGE_SUFFIX
from tests.http.agent import Session, user_message
from tests.http.conftest import serve
from tests.http.test_sessions import NEAR_TIE, PAGE, _same_as_cold
from tests.store import Store

pytestmark = pytest.mark.http


@pytest.fixture
def store(tmp_path: Path) -> Store:
    s = Store(tmp_path / "store").start()
    yield s  # type: ignore[misc]
    s.stop()


async def _shared(srv, timeout: float = 30) -> None:  # type: ignore[no-untyped-def]
    """Until the server saved its idle lane in full and the store took it."""
    pool = srv.app[ENGINE].pool
    deadline = time.monotonic() + timeout
    while True:
        s = pool.stats()
        if s.tier("remote").store.writes >= 1 and s.tier("remote").store.queue == 0:
            return
        assert time.monotonic() < deadline, s
        await asyncio.sleep(0.1)


@pytest.mark.parametrize("which", ["hybrid", "gemma", "draft"])
async def test_the_next_turn_restores_from_the_store_then_from_disk(
    which: str, request: pytest.FixtureRequest, tmp_path: Path, store: Store
) -> None:
    model: Path = request.getfixturevalue(f"{which}_path")
    opts = {"cache__splice_generated": which == "gemma", "engine__idle_save_s": 0.2}
    remote = {"cache__remote__url": store.url, "cache__remote__retry_s": 0.5}
    async with serve(model, tmp_path / "a", **opts, **remote) as a:
        s = Session(a.client)
        t1 = await s.turn()
        await _shared(a)
        pool_a = a.app[ENGINE].pool.stats()
        assert pool_a.tier("remote").store.pages_written > 0
    # B has its own, empty disk: turn 2 starts from A's state in the store
    async with serve(model, tmp_path / "b", **opts, **remote) as b:
        s.client = b.client
        t2 = await s.turn(user_message(1))
        stats_b = b.app[ENGINE].pool.stats()
    assert t2.cached_tokens >= t1.prompt_tokens + t1.completion_tokens - PAGE, t2
    assert stats_b.tier("remote").hits >= 1 and stats_b.tier("remote").store.pages_fetched > 0
    # C over A's disk, no store: turn 3 starts from what A left on disk (turn 1's end)
    async with serve(model, tmp_path / "a", **opts) as c:
        s.client = c.client
        t3 = await s.turn(user_message(2))
        stats_c = c.app[ENGINE].pool.stats()
    assert stats_c.tier("disk").hits >= 1 and stats_c.tier("disk").pages > 0
    assert t3.cached_tokens >= t1.prompt_tokens + t1.completion_tokens - PAGE, t3
    await _same_as_cold(model, tmp_path, s.turns, s.max_tokens, NEAR_TIE[which])


async def test_a_page_missing_on_disk_is_a_miss_not_a_wrong_state(tmp_path: Path,
                                                                   hybrid_path: Path) -> None:
    async with serve(hybrid_path, tmp_path / "a") as a:
        s = Session(a.client)
        t1 = await s.turn()
    # the first page of the prompt, which every FULL state on disk names, goes
    firsts = {read_meta(f).meta["keys"][:16] for f in (tmp_path / "a").glob("*.ckpt")}
    assert len(firsts) == 1
    pages = list((tmp_path / "a").glob(f"pages-*/*/{firsts.pop().hex()}{PAGE_SUFFIX}"))
    assert len(pages) == 1
    pages[0].unlink()
    async with serve(hybrid_path, tmp_path / "a") as b:
        s.client = b.client
        t2 = await s.turn(user_message(1))
        st = b.app[ENGINE].pool.stats()
    assert st.quarantined >= 1 and st.tier("disk").hits == 0
    assert t2.cached_tokens < t1.prompt_tokens
    await _same_as_cold(hybrid_path, tmp_path, s.turns, s.max_tokens, NEAR_TIE["hybrid"])
