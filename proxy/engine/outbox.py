"""Handing events from the engine thread to one request's coroutine."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from proxy.engine.types import Event, TokenEvent


class Outbox:
    """Hands events from the engine thread to one request's coroutine.

    Events pile up in a list; the loop is woken once for however many arrive before
    it runs, so a slow reader costs one wake-up per batch, not one per token.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._items: list[Event | BaseException] = []
        self._lock = threading.Lock()
        self._scheduled = False
        self._ready = asyncio.Event()

    def put(self, ev: Event | BaseException, *, defer: bool = False) -> bool:
        """Add an event; wake the loop unless a wake-up is on its way. ``defer``: leave
        the wake-up to the caller, who passes this box to ``wake_all`` when this returns
        True (the engine wakes the loop once per step for all its streams: each wake-up
        is a write to the loop's self-pipe, and a chance for the loop to take the GIL)."""
        with self._lock:
            self._items.append(ev)
            if self._scheduled:
                return False
            self._scheduled = True
        if defer:
            return True
        with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
            self.loop.call_soon_threadsafe(self._wake)
        return False

    @staticmethod
    def wake_all(boxes: list[Outbox]) -> None:
        """One wake-up per event loop for the boxes a deferred ``put`` returned True for."""
        by_loop: dict[asyncio.AbstractEventLoop, list[Outbox]] = {}
        for box in boxes:
            by_loop.setdefault(box.loop, []).append(box)
        for loop, group in by_loop.items():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_wake_each, group)

    def _wake(self) -> None:
        with self._lock:
            self._scheduled = False
        self._ready.set()

    async def get(self) -> list[Event | BaseException]:
        """Every event so far (at least one), consecutive token events merged."""
        while True:
            with self._lock:
                items, self._items = self._items, []
                if not items:
                    self._ready.clear()
            if items:
                return _merge_tokens(items)
            await self._ready.wait()

    def close(self) -> None:
        """The coroutine is gone: what it did not take is dropped."""
        with self._lock:
            self._items.clear()


def _wake_each(boxes: list[Outbox]) -> None:
    for box in boxes:
        box._wake()


def _merge_tokens(items: list[Event | BaseException]) -> list[Event | BaseException]:
    if len(items) == 1:
        return items
    out: list[Event | BaseException] = []
    for ev in items:
        prev = out[-1] if out else None
        if isinstance(ev, TokenEvent) and isinstance(prev, TokenEvent):
            out[-1] = TokenEvent(prev.text + ev.text, prev.token_ids + ev.token_ids,
                                 prev.logprobs + ev.logprobs)
        else:
            out.append(ev)
    return out
