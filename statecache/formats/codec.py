"""Lossless compression of what goes to disk and to the shared store (RAM stays raw).

A codec number says how a stored piece is encoded: raw, zstd, or zstd over the byte
planes of 2- or 4-byte words (the exponent bytes of f16 and f32 values side by side).
Chosen by measurement (``python -m bench.codec``; docs/design.md, "Compression"): f16
KV pages of the bench models keep 92-94% of their bytes under any zstd level (lz4:
100%), which costs more time to compress (about 1 GB/s on one core here) and to
decompress (1.4 GB/s) than it saves in writing (335 MB/s with fdatasync) or reading
(1.2 GB/s from the device); a hybrid's recurrent state (f32) keeps 55-81% with
4-byte planes at level 1. So a piece is stored compressed only where that saves at
least ``MIN_SAVING`` of it, and a ``Packer`` tries one piece in ``SAMPLE`` of a kind
(pages, rests) while compression does not pay, rather than every one.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from statecache.buffers import Buffer

RAW = 0
ZSTD = 1
ZSTD_PLANES2 = 2
ZSTD_PLANES4 = 4
CODECS = (RAW, ZSTD, ZSTD_PLANES2, ZSTD_PLANES4)
DEFAULT_LEVEL = 1  # higher levels saved under 1% more on every kind (bench.codec)
MIN_SAVING = 0.25  # of a piece's bytes, for it to be kept compressed
SAMPLE = 16  # while compression does not pay, one piece in this many is tried

_local = threading.local()


class BadCodec(Exception):
    """A stored piece that does not decode to the size it claims."""


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("c", {})
    c = cache.get(level)
    if c is None:
        c = cache[level] = zstandard.ZstdCompressor(level=level, write_content_size=False,
                                                    write_checksum=False)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = _local.__dict__.get("d")
    if d is None:
        d = _local.d = zstandard.ZstdDecompressor()
    return d


def _planes(data: Buffer, width: int) -> bytes:
    view = memoryview(data).cast("B")
    n = view.nbytes // width * width
    arr = np.frombuffer(view, dtype=np.uint8, count=n).reshape(-1, width)
    return arr.T.tobytes() + bytes(view[n:])


def _unplanes(data: bytes, width: int) -> bytes:
    n = len(data) // width * width
    arr = np.frombuffer(data, dtype=np.uint8, count=n).reshape(width, -1)
    return arr.T.tobytes() + data[n:]


def compress(data: Buffer, level: int = DEFAULT_LEVEL, width: int = 1) -> tuple[int, Buffer]:
    """(codec, stored bytes): zstd (over ``width``-byte planes) where that saves at
    least MIN_SAVING, else the bytes as they are. ``level`` 0 stores raw."""
    size = memoryview(data).nbytes
    if level <= 0 or size == 0:
        return RAW, data
    kind = {1: ZSTD, 2: ZSTD_PLANES2, 4: ZSTD_PLANES4}[width]
    packed = _compressor(level).compress(data if width == 1 else _planes(data, width))
    if len(packed) > size * (1 - MIN_SAVING):
        return RAW, data
    return kind, packed


def decode(codec: int, stored: Buffer, size: int) -> Buffer:
    """The ``size`` bytes that ``stored`` encodes; raises BadCodec."""
    if codec == RAW:
        if memoryview(stored).nbytes != size:
            raise BadCodec(f"{memoryview(stored).nbytes} raw bytes, expected {size}")
        return stored
    if codec not in CODECS:
        raise BadCodec(f"unknown codec {codec}")
    try:
        out = _decompressor().decompress(stored, max_output_size=size)
    except zstandard.ZstdError as e:
        raise BadCodec(f"zstd: {e}") from None
    if len(out) != size:
        raise BadCodec(f"decoded {len(out)} bytes, expected {size}")
    return out if codec == ZSTD else _unplanes(out, codec)


class Packer:
    """Compresses pieces of one kind (KV pages, or rests) for one tier: every piece
    while compression pays, one in SAMPLE while it does not (the rest stored raw)."""

    def __init__(self, level: int = DEFAULT_LEVEL, width: int = 1) -> None:
        self.level = level
        self.width = width
        self.pays = True
        self._skipped = 0
        self.raw_bytes = 0  # what went in, and what was stored: the ratio achieved
        self.stored_bytes = 0

    def encode(self, data: Buffer) -> tuple[int, Buffer]:
        size = memoryview(data).nbytes
        if not self.pays and self._skipped < SAMPLE - 1:
            self._skipped += 1
            kind, out = RAW, data
        else:
            self._skipped = 0
            kind, out = compress(data, self.level, self.width)
            self.pays = kind != RAW
        self.raw_bytes += size
        self.stored_bytes += memoryview(out).nbytes
        return kind, out
