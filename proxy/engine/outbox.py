"""Handing events from the engine thread to one request's coroutine.

The engine thread wakes the event loop with a byte on a pipe of our own (a ``Bell``),
written while it keeps the GIL. ``loop.call_soon_threadsafe`` writes to the loop's
self-pipe with ``socket.send``, which lets go of the GIL: the loop's thread, woken by
that very byte, takes the GIL, and the engine thread waits in the middle of its step
(no decode running) while the loop writes every stream. With the GIL kept, the loop's
thread takes it when the engine next lets go, in ``llama_decode``: the streams are
written while the model computes. Measured with one stream of hybrid-mid through the
server (README, "Decode speed through the proxy").
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import threading
import weakref
from collections.abc import Callable

from proxy.engine.types import Event, TokenEvent


def _gil_keeping_write() -> Callable[[int], None] | None:
    """``write(fd, "\\0", 1)`` through ctypes.PyDLL, which keeps the GIL (a plain
    ctypes.CDLL call or ``os.write`` lets go of it); None where there is no libc."""
    try:
        fn = ctypes.PyDLL(None).write
    except (OSError, AttributeError, TypeError):  # no C library in the process (Windows)
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    fn.restype = ctypes.c_ssize_t

    def write(fd: int) -> None:
        fn(fd, b"\0", 1)  # a full pipe (EAGAIN) already holds a byte: nothing lost
    return write


_write_keeping_gil = _gil_keeping_write()


class Bell:
    """Wakes one event loop from another thread for a list of outboxes, at most one
    byte in flight. Made on the loop's thread (``Bell.of``); a loop that cannot watch
    a pipe (Windows' proactor), or a process without libc, falls back to
    ``call_soon_threadsafe``."""

    _of: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Bell] = \
        weakref.WeakKeyDictionary()
    _of_lock = threading.Lock()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = weakref.ref(loop)  # the loop keeps us (its reader), not the other way
        self._lock = threading.Lock()
        self._due: list[Outbox] = []
        self._ringing = False
        self._fds: tuple[int, int] | None = None
        if _write_keeping_gil is None:
            return
        r, w = os.pipe()
        os.set_blocking(r, False)
        os.set_blocking(w, False)
        try:
            loop.add_reader(r, self._rung)
        except (NotImplementedError, RuntimeError):  # a proactor loop; a closed loop
            os.close(r)
            os.close(w)
            return
        self._fds = (r, w)
        # the pipe lives as long as this bell: a ring never writes to a reused fd
        weakref.finalize(self, _close_pipe, self._loop, r, w)

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> Bell:
        with cls._of_lock:
            bell = cls._of.get(loop)
            if bell is None:
                bell = cls._of[loop] = cls(loop)
            return bell

    def ring(self, boxes: list[Outbox]) -> None:
        """From any thread: wake each box's reader (once the loop runs)."""
        with self._lock:
            self._due.extend(boxes)
            if self._ringing:
                return
            self._ringing = True
        if self._fds is not None:
            assert _write_keeping_gil is not None
            _write_keeping_gil(self._fds[1])
            return
        loop = self._loop()
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody is listening
                loop.call_soon_threadsafe(self._rung)

    def _rung(self) -> None:  # on the loop's thread
        if self._fds is not None:
            with contextlib.suppress(BlockingIOError):
                os.read(self._fds[0], 64)
        with self._lock:
            due, self._due = self._due, []
            self._ringing = False
        for box in due:
            box._wake()


def _close_pipe(loop_ref: weakref.ref[asyncio.AbstractEventLoop], r: int, w: int) -> None:
    loop = loop_ref()
    if loop is not None and not loop.is_closed():
        with contextlib.suppress(Exception):
            loop.remove_reader(r)
    os.close(r)
    os.close(w)


class Outbox:
    """Hands events from the engine thread to one request's coroutine.

    Events pile up in a list; the loop is woken once for however many arrive before
    it runs, so a slow reader costs one wake-up per batch, not one per token.
    Made on the loop's thread.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.bell = Bell.of(loop)  # not the loop itself: a closed loop is let go
        self._items: list[Event | BaseException] = []
        self._lock = threading.Lock()
        self._scheduled = False
        self._ready = asyncio.Event()

    def put(self, ev: Event | BaseException, *, defer: bool = False) -> bool:
        """Add an event; wake the loop unless a wake-up is on its way. ``defer``: leave
        the wake-up to the caller, who passes this box to ``wake_all`` when this returns
        True (the engine wakes the loop once per step for all its streams)."""
        with self._lock:
            self._items.append(ev)
            if self._scheduled:
                return False
            self._scheduled = True
        if defer:
            return True
        self.bell.ring([self])
        return False

    @staticmethod
    def wake_all(boxes: list[Outbox]) -> None:
        """One wake-up per event loop for the boxes a deferred ``put`` returned True for."""
        by_bell: dict[Bell, list[Outbox]] = {}
        for box in boxes:
            by_bell.setdefault(box.bell, []).append(box)
        for bell, group in by_bell.items():
            bell.ring(group)

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
