"""The hand-off from the engine thread to the streams' coroutines: a step's tokens for
every stream cost the event loop one wake-up, and nothing put is lost or reordered."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from proxy.engine.outbox import Outbox
from proxy.engine.types import TokenEvent


def _tok(text: str, i: int) -> TokenEvent:
    return TokenEvent(text, (i,), ())


async def test_one_wake_up_per_step_for_every_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    loop = asyncio.get_running_loop()
    calls: list[Any] = []
    real = loop.call_soon_threadsafe

    def counting(cb: Any, *args: Any) -> Any:
        if getattr(cb, "__name__", "") in ("_wake_each", "_wake"):  # not to_thread's own
            calls.append(cb)
        return real(cb, *args)

    monkeypatch.setattr(loop, "call_soon_threadsafe", counting)
    boxes = [Outbox(loop) for _ in range(4)]

    def step(k: int) -> None:  # the engine thread's side of one step
        due = [b for b in boxes if b.put(_tok(chr(97 + k), k), defer=True)]
        Outbox.wake_all(due)

    await asyncio.to_thread(step, 0)
    got = await asyncio.gather(*(asyncio.wait_for(b.get(), 5) for b in boxes))
    assert len(calls) == 1  # four streams, one write to the loop's self-pipe
    assert [[e.text for e in g] for g in got] == [["a"]] * 4  # type: ignore[union-attr]

    # steps the reader has not caught up with: no more wake-ups, tokens merged in order
    await asyncio.to_thread(lambda: [step(k) for k in (1, 2, 3)])
    assert len(calls) == 2  # the first of them woke the loop; the others found it due
    for b in boxes:
        (ev,) = await asyncio.wait_for(b.get(), 5)
        assert isinstance(ev, TokenEvent) and (ev.text, ev.token_ids) == ("bcd", (1, 2, 3))


async def test_a_plain_put_wakes_by_itself_and_a_deferred_one_waits() -> None:
    loop = asyncio.get_running_loop()
    box = Outbox(loop)
    assert await asyncio.to_thread(box.put, _tok("x", 1)) is False  # woke the loop itself
    assert [e.text for e in await asyncio.wait_for(box.get(), 5)] == ["x"]  # type: ignore[union-attr]
    # a reader waiting; a deferred put alone does not wake it, wake_all does
    reader = asyncio.ensure_future(box.get())
    await asyncio.sleep(0.05)
    assert await asyncio.to_thread(box.put, _tok("y", 2), defer=True) is True
    done, _ = await asyncio.wait([reader], timeout=0.2)
    assert not done
    await asyncio.to_thread(Outbox.wake_all, [box])
    assert [e.text for e in await asyncio.wait_for(reader, 5)] == ["y"]  # type: ignore[union-attr]


def test_wake_all_on_a_closed_loop_is_harmless() -> None:
    loop = asyncio.new_event_loop()
    box = Outbox(loop)
    assert box.put(_tok("z", 3), defer=True)
    loop.close()
    t = threading.Thread(target=Outbox.wake_all, args=([box],))
    t.start()
    t.join(5)
    assert not t.is_alive()
