"""Several proxies, one shared store: separate `statecache serve` processes (each its own
llama context, RAM and disk) and a real Valkey server, through the openai client.

A conversation served by proxy A continues on proxy B from the shared tier (cached
tokens counted, answer equal to a cold run); a proxy with another key never even reads
those entries (another key space), another tenant never uses them; a store killed
mid-session costs reuse, never an answer, and reuse comes back with the store.
"""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from openai import AsyncOpenAI

from tests.http.agent import TOOLS, Session, Turn, ask, assert_same_or_near_tie, user_message
from tests.http.proc import Proc, serve_process
from tests.http.test_sessions import NEAR_TIE, PAGE
from tests.store import Store

pytestmark = pytest.mark.http


@pytest.fixture(autouse=True)
def _stacks_on_abort(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")  # read by the proxies started below


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "store").start()
    yield s
    s.stop()


def _dirs(tmp: Path, *names: str) -> list[Path]:
    for n in names:
        (tmp / n).mkdir(parents=True, exist_ok=True)
    return [tmp / n for n in names]


def _config(store: Store, key: Path) -> str:
    return (f'[cache.remote]\nurl = "{store.url}"\nsecret_path = "{key}"\nretry_s = 0.5\n'
            "timeout = 1.0\n[model]\nn_ctx = 4096\n[server]\nlanes = 2\n"
            "[engine]\nidle_save_s = 0.2\n")


def _client(p: Proc, tenant: str = "") -> AsyncOpenAI:
    headers = {"X-Statecache-Tenant": tenant} if tenant else {}
    return AsyncOpenAI(base_url=f"{p.url}/v1", api_key="unused", max_retries=0, timeout=60,
                       default_headers=headers)


@contextmanager
def _logs_on_failure(*procs: Proc) -> Iterator[None]:
    """A failing test prints what the proxies logged (they are killed afterwards)."""
    try:
        yield
    except BaseException:
        for p in procs:
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack
                time.sleep(0.5)
                p.proc.terminate()
            print(f"--- proxy on port {p.port} ---\n{p.output()[-20000:]}")
        raise


def _counts(p: Proc) -> tuple[float, float]:
    return (p.metric("statecache_idle_saves_total"),
            p.metric(r'statecache_remote_total\{event="writes"\}'))


def _wait_shared(p: Proc, before: tuple[float, float]) -> None:
    """Until ``p`` saved its idle lane again and wrote it to the store (the counts
    ``before`` were read before the request). The idle save is counted after the pool
    handed it to the store's write queue, and the queue counts a write until it is done,
    so no write of the request's own checkpoints can stand in for it."""
    deadline = time.monotonic() + 30
    while True:
        idle, writes = _counts(p)
        if idle > before[0] and writes > before[1] and \
                p.metric("statecache_remote_write_queue") == 0:
            return
        assert time.monotonic() < deadline, "the proxy never wrote to the store"
        time.sleep(0.1)


def _wait_up(p: Proc) -> None:
    """Until ``p`` found the store again by itself. A proxy that failed to reach the store
    skips it for ``retry_s`` after its last failure (no lookup waits on a store that was
    just down), so a request sent sooner is served without it, by design; its queued
    writes try again when that time is up."""
    deadline = time.monotonic() + 30
    while p.metric("statecache_remote_up") != 1:
        assert time.monotonic() < deadline, "the proxy never found the store again"
        time.sleep(0.1)


def _log(p: Proc) -> str:
    p.proc.terminate()
    return p.output()


async def _same_as_cold(model: Path, tmp: Path, turns: list[Turn], max_tokens: int) -> None:
    """Each request again on a proxy process with caching off: the same answer."""
    (tmp / "cold").mkdir(exist_ok=True)
    with serve_process(model, tmp / "cold", "[server]\nlanes = 1\n", "--no-cache") as cold:
        client = _client(cold)
        for t in turns:
            reply = await ask(client, t.messages, max_tokens, tools=TOOLS)
            assert_same_or_near_tie(t.tokens, reply["tokens"], NEAR_TIE["hybrid"])
        await client.close()


async def _turn(s: Session, client: AsyncOpenAI, new: dict[str, object] | None = None) -> Turn:
    s.client = client
    return await s.turn(new)


async def test_a_conversation_moves_to_another_proxy(
    hybrid_path: Path, tmp_path: Path, store: Store
) -> None:
    key = tmp_path / "keys" / "shared.key"
    cfg = _config(store, key)
    _dirs(tmp_path, "a", "b")
    with serve_process(hybrid_path, tmp_path / "a", cfg) as a, \
            serve_process(hybrid_path, tmp_path / "b", cfg) as b, _logs_on_failure(a, b):
        s = Session(_client(a))
        t1 = await _turn(s, _client(a))
        _wait_shared(a, (0, 0))
        # Turn 2 lands on B, which never saw this conversation: it starts from A's state.
        t2 = await _turn(s, _client(b), user_message(1))
        assert t2.cached_tokens >= t1.prompt_tokens + t1.completion_tokens - PAGE, t2
        assert b.metric(r'statecache_pool_hits_total\{tier="remote"\}') >= 1
        # Another tenant on B gets nothing from it (the same prompt, another namespace).
        other = await ask(_client(b, "mallory"), t2.messages, s.max_tokens,
                          tools=s.kwargs["tools"])
        assert other["cached_tokens"] == 0
        # The routing header: echoed, beside the name of the proxy that answered.
        req = urllib.request.Request(f"{b.url}/v1/models",
                                     headers={"X-Statecache-Session": "conv-7"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["X-Statecache-Session"] == "conv-7"
            assert r.headers["X-Statecache-Proxy"].endswith(f":{b.port}")
        log_b = _log(b)
    started = [ln for ln in log_b.splitlines() if "Started" in ln]
    assert "remote)" in started[0] and "est. remote" in started[0], started[0]
    # The answers equal the same requests served with caching off.
    await _same_as_cold(hybrid_path, tmp_path, s.turns, s.max_tokens)


async def test_an_entry_signed_with_another_key_is_never_read(
    hybrid_path: Path, tmp_path: Path, store: Store
) -> None:
    _dirs(tmp_path, "a", "c")
    with serve_process(hybrid_path, tmp_path / "a",
                       _config(store, tmp_path / "keys" / "a.key")) as a, \
            serve_process(hybrid_path, tmp_path / "c",
                          _config(store, tmp_path / "keys" / "c.key")) as c, \
            _logs_on_failure(a, c):
        s = Session(_client(a))
        await _turn(s, _client(a))
        _wait_shared(a, (0, 0))
        t2 = await _turn(s, _client(c), user_message(1))
        assert t2.cached_tokens == 0
        # in another key's space: never offered, never fetched, never refused
        assert c.metric(r'statecache_remote_rejected_total\{reason="foreign_key"\}') == 0
        assert c.metric(r'statecache_remote_total\{event="hits"\}') == 0
        assert c.metric(r'statecache_pool_hits_total\{tier="remote"\}') == 0
    await _same_as_cold(hybrid_path, tmp_path, s.turns[1:], s.max_tokens)


async def test_store_killed_mid_session_then_restarted(
    hybrid_path: Path, tmp_path: Path, store: Store
) -> None:
    cfg = _config(store, tmp_path / "keys" / "shared.key")
    _dirs(tmp_path, "a", "b")
    with serve_process(hybrid_path, tmp_path / "a", cfg) as a, \
            serve_process(hybrid_path, tmp_path / "b", cfg) as b, _logs_on_failure(a, b):
        s = Session(_client(a))
        await _turn(s, _client(a))
        store.stop()
        # Every request is still answered: on A from its own lane, on B cold.
        t2 = await _turn(s, _client(a), user_message(1))
        assert t2.cached_tokens > 0
        elsewhere = Session(_client(b), system="You answer in one line.")
        assert (await elsewhere.turn()).completion_tokens > 0
        assert b.metric("statecache_remote_up") == 0
        store.start()  # empty, same address: both proxies find it again by themselves
        before = _counts(a)
        t3 = await _turn(s, _client(a), user_message(2))
        _wait_shared(a, before)
        _wait_up(b)  # its writes of the cold turn, queued while the store was down
        # B never held this conversation: it continues from what A wrote after the restart.
        t4 = await _turn(s, _client(b), user_message(3))
        assert t4.cached_tokens >= t3.prompt_tokens + t3.completion_tokens - PAGE, t4
        log_a = _log(a)
    assert log_a.count("serving from RAM and disk") == 1  # one warning for the outage
    assert "reachable again" in log_a
    await _same_as_cold(hybrid_path, tmp_path, s.turns, s.max_tokens)
