"""Buffers the size of a sequence state, and the one spare kept between them.

Two things need one: a RAM hit on a checkpoint kept as pages assembles the state into
one (llama.cpp reads a state from one contiguous buffer), and a state kept whole in RAM
is what llama.cpp wrote. A new buffer costs a page fault per 4 KiB the first time it
is written (``python -m bench.statebuf``: 250 MiB took 178 ms to copy into a new
``bytes`` on these cores and 26 ms into a buffer already written). So a buffer comes
from the spare when there is one (resized to the state's length: the kernel moves the
mapping, nothing is copied, and only pages it grows by are faulted), else is mapped
with its pages faulted in one call (MAP_POPULATE where the platform has it: 91 ms).

A buffer is written only when nothing else can read it: CPython refuses to resize a
map while any view of it (a memoryview, a numpy array) is alive, and ``take`` resizes
the spare before handing it out, so a spare still read somewhere is dropped, never
written. The spare is one buffer, the largest given back; it is outside the RAM
budget, as llama.cpp's own buffer for the state it writes is.
"""

from __future__ import annotations

import mmap
import threading

# Bytes a function reads (a state, a rest, a page): any of these, never copied to convert.
Buffer = bytes | bytearray | memoryview

_FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux; elsewhere faulted page by page


class Spare:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._buf: mmap.mmap | None = None

    def take(self, n: int) -> mmap.mmap:
        """A writable buffer of exactly ``n`` bytes that nothing else reads."""
        if n <= 0:
            raise ValueError(f"a state buffer of {n} bytes")
        with self._lock:
            buf, self._buf = self._buf, None
        if buf is not None:
            try:
                buf.resize(n)  # BufferError while any view of it is alive
                return buf
            except (BufferError, OSError, SystemError, ValueError):
                pass  # still read somewhere, or no resizing here: left to its readers
        return mmap.mmap(-1, n, flags=_FLAGS | _POPULATE)

    def give(self, buf: object) -> None:
        """``buf`` is not needed any more: kept as the spare if it is the largest."""
        if not isinstance(buf, mmap.mmap) or buf.closed:
            return
        with self._lock:
            if self._buf is None or len(buf) > len(self._buf):
                self._buf = buf

    @property
    def nbytes(self) -> int:
        with self._lock:
            return 0 if self._buf is None else len(self._buf)
