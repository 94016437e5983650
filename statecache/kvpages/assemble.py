"""Putting a state back together from its rest and its pages: exactly the bytes that
were cut, checked against the digest of the state that was saved, written into a
buffer the caller gives (statecache/buffers.py), or handed back as it is where it was
kept whole.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import xxhash

from statecache.buffers import Buffer
from statecache.kvpages.layout import (
    BLOCK_HEAD,
    MAX_LAYERS,
    MAX_ROW,
    MAX_STREAMS,
    META_RAW,
    META_RUNS,
    META_RUNS_MROPE,
    REST_HEAD,
    RUN,
    BadState,
    IntArray,
    Reader,
    RestInfo,
    Unparsed,
    covered,
    rest_info,
    run_of,
)
from statecache.kvpages.page import PageData
from statecache.pages import TokenArray


def rest_logits(rest: Buffer) -> npt.NDArray[np.float32] | None:
    """The logits a rest keeps (a copy), or None where it keeps none."""
    info = rest_info(rest)
    if not info.n_logits:
        return None
    view = memoryview(rest).cast("B")
    end = view.nbytes
    return np.frombuffer(view[end - 4 * info.n_logits:end], dtype="<f4").astype(np.float32)


def whole_state(rest: Buffer, state: Buffer | mmap.mmap) -> memoryview:
    """``state`` (a whole state kept beside ``rest``), checked as ``assemble`` checks
    what it writes: raises BadState unless it is the state that was cut."""
    return _saved(rest_info(rest), memoryview(state).cast("B"))


def _saved(info: RestInfo, state: memoryview) -> memoryview:
    """``state`` if it is the one the rest was cut from (its length and digest)."""
    if state.nbytes != info.nbytes or xxhash.xxh3_128_digest(state) != info.digest:
        raise BadState("the state is not the one saved (length or digest)")
    return state


def assemble(rest: Buffer, pages: Sequence[PageData], out: bytearray | mmap.mmap | None = None,
             tokens: TokenArray | None = None) -> memoryview:
    """The whole state from its rest and its pages (in the order of the split's keys),
    written into ``out`` if it is large enough, else into a new buffer (``tokens``: as
    given to ``split``); raises BadState unless it is exactly the state that was cut
    (its digest)."""
    info = rest_info(rest)
    if len(pages) != info.n_keys:
        raise BadState(f"{len(pages)} pages for a rest that names {info.n_keys}")
    body = memoryview(rest).cast("B")
    body = body[:body.nbytes - 4 * info.n_logits]  # the logits after it
    if info.sections == 0:  # kept whole: the state is the rest's body, not copied
        return _saved(info, body[REST_HEAD.size:])
    if out is None or len(out) < info.nbytes:
        out = bytearray(info.nbytes)
    dst = memoryview(out)[:info.nbytes]
    r = Reader(body)
    r.take(REST_HEAD.size)
    try:
        at = _assemble(r, info, [tuple(q.cast("B") for q in p) if isinstance(p, tuple)
                                 else memoryview(p).cast("B") for p in pages], dst, tokens)
    except (Unparsed, ValueError, IndexError) as e:
        raise BadState(f"rest does not parse: {e}") from None
    if at != info.nbytes:
        raise BadState(f"assembled {at} bytes of {info.nbytes}")
    if xxhash.xxh3_128_digest(dst) != info.digest:
        raise BadState("the assembled state is not the one saved (digest)")
    return dst


class _Writer:
    __slots__ = ("dst", "at")

    def __init__(self, dst: memoryview) -> None:
        self.dst = dst
        self.at = 0

    def put(self, data: Buffer) -> None:
        n = memoryview(data).nbytes
        if self.at + n > len(self.dst):
            raise Unparsed("state longer than its header says")
        self.dst[self.at:self.at + n] = memoryview(data).cast("B")
        self.at += n

    def region(self, n: int) -> memoryview:
        if self.at + n > len(self.dst):
            raise Unparsed("state longer than its header says")
        out = self.dst[self.at:self.at + n]
        self.at += n
        return out


def _assemble(r: Reader, info: RestInfo, pages: list[memoryview | tuple[memoryview, ...]],
              dst: memoryview,
              tokens: TokenArray | None) -> int:
    w = _Writer(dst)
    w.put(r.take(8))
    used = 0
    for _ in range(info.sections):
        n_stream = r.u32()
        if not 0 < n_stream <= MAX_STREAMS:
            raise Unparsed("stream count")
        w.put(struct.pack("<I", n_stream))
        for _ in range(n_stream):
            cells = r.u32()
            w.put(struct.pack("<I", cells))
            if cells == 0:
                continue
            pos = _decode_meta(r, cells, w, tokens)
            whole, order, rest = covered(pos, info.page_size, info.chain_pages)
            mine = pages[used:used + whole.size]
            if len(mine) != whole.size:
                raise Unparsed("fewer pages than the rest's cells need")
            used += whole.size
            dims = r.take(8)
            w.put(dims)
            v_trans, n_layer = struct.unpack("<II", dims)
            if n_layer > MAX_LAYERS:
                raise Unparsed("layer count")
            offset = 0
            for k in range(2 * n_layer):
                offset = _fill(r, w, cells, k >= n_layer and bool(v_trans), order, rest,
                               [_block_of(p, k, offset) for p in mine], offset,
                               info.page_size)
            if any((len(p) != 2 * n_layer or sum(q.nbytes for q in p) != offset)
                   if isinstance(p, tuple) else len(p) != offset for p in mine):
                raise Unparsed("a page of the wrong size")
    if used != len(pages):
        raise Unparsed("pages left over")
    w.put(r.buf[r.at:])
    return w.at


def _decode_meta(r: Reader, cells: int, w: _Writer, tokens: TokenArray | None
                 ) -> npt.NDArray[np.int32]:
    mode, n = struct.unpack("<BI", r.take(5))
    if mode == META_RAW:
        if n not in (12, 24):
            raise Unparsed("meta stride")
        raw = r.take(n * cells)
        w.put(raw)
        return np.frombuffer(raw, dtype="<i4").reshape(cells, n // 4)[:, 0]
    if mode not in (META_RUNS, META_RUNS_MROPE) or n > cells:
        raise Unparsed("meta mode")
    runs = np.frombuffer(r.take(n * RUN.itemsize), dtype=RUN)
    lens = runs["len"].astype(np.int64)
    if int(lens.sum()) != cells or (lens < 1).any():
        raise Unparsed("meta runs")
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    pos = np.repeat(runs["pos"].astype(np.int64), lens) + (np.arange(cells) - starts)
    width = 3 if mode == META_RUNS else 6
    meta = np.frombuffer(w.region(4 * width * cells), dtype="<i4").reshape(cells, width)
    meta.flags.writeable = True  # a view of the caller's buffer
    meta[:, 0] = pos
    meta[:, 1] = 1
    meta[:, -1] = np.repeat(runs["seq"], lens)
    if mode == META_RUNS_MROPE:
        if tokens is None or int(pos.max()) >= len(tokens) or int(pos.min()) < 0:
            raise Unparsed("the prompt's tokens are needed, or do not reach")
        meta[:, 2] = pos
        meta[:, 3] = pos
        meta[:, 4] = tokens[pos]
    return meta[:, 0].copy()


def _block_of(page: memoryview | tuple[memoryview, ...], k: int, offset: int) -> memoryview:
    """Block ``k``'s part of a page (at ``offset`` of a page held as one buffer; a
    short or missing part is caught by ``_fill``'s sizes)."""
    if isinstance(page, tuple):
        return page[k] if k < len(page) else memoryview(b"")
    return page[offset:]


def _fill(r: Reader, w: _Writer, cells: int, trans: bool, order: IntArray, rest: IntArray,
          pages: list[memoryview], offset: int, page_size: int) -> int:
    """One block: header from the rest, unpaged cells from the rest, paged cells from
    the pages (each page's part of this block, from its start); returns the next
    part's offset."""
    head = r.take(BLOCK_HEAD)
    w.put(head)
    _gtype, a, b = struct.unpack("<iII", head)
    row, n_embd = (a, b) if trans else (a | (b << 32), 1)
    if not 0 < row <= MAX_ROW or not 0 < n_embd <= MAX_ROW:
        raise Unparsed("block size")
    region = w.region(row * n_embd * cells)
    per = page_size * row * n_embd
    if not trans:
        rows = np.frombuffer(region, dtype=np.uint8).reshape(cells, row)
        rows.flags.writeable = True
        src = r.take(rest.size * row)
        first = run_of(rest)
        if first is not None:
            region[first * row:(first + rest.size) * row] = src
        elif rest.size:
            rows[rest] = np.frombuffer(src, dtype=np.uint8).reshape(-1, row)
        first = run_of(order)
        if first is not None:
            base = first * row
            for i, page in enumerate(pages):
                region[base + i * per:base + (i + 1) * per] = page[:per]
        elif pages:
            rows[order] = np.frombuffer(b"".join(p[:per] for p in pages),
                                        dtype=np.uint8).reshape(-1, row)
        return offset + per
    cube = np.frombuffer(region, dtype=np.uint8).reshape(n_embd, cells, row)
    cube.flags.writeable = True
    src = r.take(n_embd * rest.size * row)
    if rest.size:
        cube[:, rest, :] = np.frombuffer(src, dtype=np.uint8).reshape(n_embd, rest.size, row)
    if pages:
        paged = np.frombuffer(b"".join(p[:per] for p in pages), dtype=np.uint8)
        cube[:, order, :] = paged.reshape(len(pages), n_embd, page_size, row) \
            .transpose(1, 0, 2, 3).reshape(n_embd, -1, row)
    return offset + per


