"""Handing events from the engine thread to one request's coroutine."""

from __future__ import annotations

import asyncio
import contextlib
import threading

from proxy.engine.types import Event, TokenEvent


class Handoff:
    """Lets the engine wait, briefly, until the event loop has handled what a step
    produced, so the loop's work per token does not run beside the next decode (with as
    many compute threads as cores, a thread the loop pushes off a core stalls every
    barrier of the decode). Off by default (``engine.handoff_wait_ms = 0``): on
    hybrid-mid one stream went from 125 to 102 tokens/s with a 20 ms wait."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._owed = 0  # outboxes with events the loop has not finished handling

    def owe(self) -> None:
        with self._cv:
            self._owed += 1

    def settle(self) -> None:
        with self._cv:
            self._owed -= 1
            if self._owed <= 0:
                self._cv.notify_all()

    def wait(self, timeout: float) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._owed <= 0, timeout=timeout)


class Outbox:
    """Hands events from the engine thread to one request's coroutine.

    Events pile up in a list; the loop is woken once for however many arrive before
    it runs, so a slow reader costs one wake-up per batch, not one per token. A batch
    counts as handled when the coroutine comes back for the next one (or closes).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, handoff: Handoff | None = None) -> None:
        self.loop = loop
        self._items: list[Event | BaseException] = []
        self._lock = threading.Lock()
        self._scheduled = False
        self._ready = asyncio.Event()
        self._handoff = handoff
        self._owed = False  # events put that the coroutine has not finished handling

    def put(self, ev: Event | BaseException, *, defer: bool = False) -> bool:
        """Add an event; wake the loop unless a wake-up is on its way. ``defer``: leave
        the wake-up to the caller, who passes this box to ``wake_all`` when this returns
        True (the engine wakes the loop once per step for all its streams: each wake-up
        is a write to the loop's self-pipe, and a chance for the loop to take the GIL)."""
        with self._lock:
            self._items.append(ev)
            if self._handoff is not None and not self._owed:
                self._owed = True
                self._handoff.owe()
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

    def _settle(self) -> None:
        # called with the lock held, when the coroutine is done with what it took
        if self._owed and not self._items and self._handoff is not None:
            self._owed = False
            self._handoff.settle()

    async def get(self) -> list[Event | BaseException]:
        """Every event so far (at least one), consecutive token events merged."""
        while True:
            with self._lock:
                self._settle()  # the previous batch is handled
                items, self._items = self._items, []
                if not items:
                    self._ready.clear()
            if items:
                return _merge_tokens(items)
            await self._ready.wait()

    def close(self) -> None:
        """The coroutine is gone: it owes the engine nothing."""
        with self._lock:
            self._items.clear()
            self._settle()


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
