"""Lossless compression of what goes to disk and to the shared store (RAM stays raw).

One codec byte says how a stored piece is encoded: raw, or zstd at some level. A piece
that does not shrink is stored raw. The level is chosen by measurement
(``python -m bench.codec``; the figures are in docs/design.md, "Compression").
"""

from __future__ import annotations

import threading

import zstandard

RAW = 0
ZSTD = 1
CODECS = (RAW, ZSTD)
# zstd level 1 (bench.codec): on KV pages and recurrent states of the bench models it
# keeps nearly all the bytes that higher levels save at a fraction of their time.
DEFAULT_LEVEL = 1

Buffer = bytes | bytearray | memoryview

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


def encode(data: Buffer, level: int = DEFAULT_LEVEL) -> tuple[int, Buffer]:
    """(codec, stored bytes): zstd where it saves anything, else the bytes as they are.
    ``level`` 0 stores raw."""
    if level <= 0 or memoryview(data).nbytes == 0:
        return RAW, data
    packed = _compressor(level).compress(data)
    if len(packed) >= memoryview(data).nbytes:
        return RAW, data
    return ZSTD, packed


def decode(codec: int, stored: Buffer, size: int) -> Buffer:
    """The ``size`` bytes that ``stored`` encodes; raises BadCodec."""
    if codec == RAW:
        if memoryview(stored).nbytes != size:
            raise BadCodec(f"{memoryview(stored).nbytes} raw bytes, expected {size}")
        return stored
    if codec != ZSTD:
        raise BadCodec(f"unknown codec {codec}")
    try:
        out = _decompressor().decompress(stored, max_output_size=size)
    except zstandard.ZstdError as e:
        raise BadCodec(f"zstd: {e}") from None
    if len(out) != size:
        raise BadCodec(f"decoded {len(out)} bytes, expected {size}")
    return out
