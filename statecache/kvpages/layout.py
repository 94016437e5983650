"""What llama.cpp writes into a FULL sequence state, read: its KV sections, their
streams of cells (metadata, then each layer's K and V rows), and which cells make whole
pages; and the header of a *rest*, what a state keeps besides its pages.

The layout of what llama.cpp writes, and of the rest, is in docs/design.md ("The
layout of a sequence state"); tests/model/test_kvpages.py pins it.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from statecache.buffers import Buffer

REST_MAGIC = b"SCR2"  # SCR1 (no logits field) is not read: such an entry is a miss
SEQ_MAGIC = 0xAF143CD8  # llama_context::state_seq_get_data's io_magic, then the seq id
# magic, KV sections, page size, chain pages, page keys, state bytes, state digest,
# logits kept after the rest's body (float32 values: 0, or the vocabulary's size)
REST_HEAD = struct.Struct("<4sIIIIQ16sI")
MAX_LOGITS = 1 << 24  # more than any vocabulary
REST_HEAD_BYTES = REST_HEAD.size  # what a state kept whole costs beyond its bytes
BLOCK_HEAD = 12  # i32 type + u64 row size, or i32 type + u32 element size + u32 rows
META_RAW, META_RUNS, META_RUNS_MROPE = 0, 1, 2
RUN = np.dtype([("pos", "<i4"), ("len", "<u4"), ("seq", "<i4")])
MAX_STREAMS = 1 << 16
MAX_LAYERS = 1 << 12
MAX_ROW = 1 << 24
MAX_GGML_TYPE = 64
IntArray = npt.NDArray[np.int64]


class BadState(Exception):
    """A rest or page set that does not give back the state it was cut from."""


class Unparsed(Exception):
    """Not the layout this module knows: the state is kept whole."""


# -- reading what llama.cpp wrote -------------------------------------------------------


class Reader:
    __slots__ = ("buf", "at")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.at = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.buf):
            raise Unparsed("truncated")
        out = self.buf[self.at:self.at + n]
        self.at += n
        return out

    def u32(self) -> int:
        return int(struct.unpack_from("<I", self.take(4))[0])

    def peek_u32(self, offset: int = 0) -> int:
        at = self.at + offset
        if at + 4 > len(self.buf):
            raise Unparsed("truncated")
        return int(struct.unpack_from("<I", self.buf, at)[0])


@dataclass(slots=True)
class Block:
    head: memoryview  # 12 bytes, as written
    trans: bool  # V stored transposed: n_embd rows of one element per cell
    row: int  # bytes per cell (non-transposed) or per element (transposed)
    n_embd: int  # rows of a transposed block; 1 otherwise
    data: memoryview
    at: int  # where ``data`` starts in the state

    def per_cell(self) -> int:
        return self.row * self.n_embd


@dataclass(slots=True)
class Stream:
    cells: int
    meta: memoryview  # as written
    stride: int  # meta bytes per cell: 12, or 24 with the M-RoPE extension
    pos: npt.NDArray[np.int32]
    seq: npt.NDArray[np.int32]
    dims: memoryview  # v_trans, n_layer (8 bytes, as written)
    blocks: list[Block]


def _block(r: Reader, cells: int, trans: bool) -> Block:
    head = r.take(BLOCK_HEAD)
    gtype, a, b = struct.unpack("<iII", head)
    if not 0 <= gtype < MAX_GGML_TYPE:
        raise Unparsed("block type")
    if trans:
        row, n_embd = a, b
        if not 0 < row <= 16 or not 0 < n_embd <= MAX_ROW:
            raise Unparsed("transposed block size")
    else:
        row, n_embd = a | (b << 32), 1
        if not 0 < row <= MAX_ROW:
            raise Unparsed("row size")
    at = r.at
    return Block(head, trans, row, n_embd, r.take(row * n_embd * cells), at)


def _meta(r: Reader, cells: int) -> tuple[memoryview, int, npt.NDArray[np.int32],
                                           npt.NDArray[np.int32]]:
    """The cells' metadata: (pos, n_seq_id = 1, [ext: x, y, tok], seq_id) each. The
    extension (M-RoPE models) is told apart by where the data header lands."""
    for stride in (12, 24):
        if r.at + stride * cells + 8 > len(r.buf):
            continue
        raw = r.buf[r.at:r.at + stride * cells]
        arr = np.frombuffer(raw, dtype="<i4").reshape(cells, stride // 4)
        v_trans, n_layer = r.peek_u32(stride * cells), r.peek_u32(stride * cells + 4)
        if (arr[:, 1] == 1).all() and v_trans in (0, 1) and 0 < n_layer <= MAX_LAYERS \
                and (arr[:, 0] >= 0).all():
            r.take(stride * cells)
            return raw, stride, arr[:, 0], arr[:, -1]
    raise Unparsed("cell metadata")


def _stream(r: Reader) -> Stream | None:
    cells = r.u32()
    if cells == 0:
        return None
    if cells > 1 << 28:
        raise Unparsed("cell count")
    meta, stride, pos, seq = _meta(r, cells)
    dims = r.take(8)
    v_trans, n_layer = struct.unpack("<II", dims)
    blocks = [_block(r, cells, False) for _ in range(n_layer)]
    blocks += [_block(r, cells, bool(v_trans)) for _ in range(n_layer)]
    return Stream(cells, meta, stride, pos, seq, dims, blocks)


def section(r: Reader) -> list[Stream | None]:
    n_stream = r.u32()
    if not 0 < n_stream <= MAX_STREAMS:
        raise Unparsed("stream count")
    return [_stream(r) for _ in range(n_stream)]


# -- which cells are paged --------------------------------------------------------------


def covered(pos: npt.NDArray[np.int32], page_size: int, chain_pages: int
             ) -> tuple[IntArray, IntArray, IntArray]:
    """The pages whose every position one cell holds (ascending), those cells in
    position order, and the other cells in their own order."""
    p = pos.astype(np.int64)
    if len(p) and int(p[-1]) - int(p[0]) == len(p) - 1 and (np.diff(p) == 1).all():
        # one run of positions in order (a live lane's cells): no sort, no unique
        first = -(-int(p[0]) // page_size)  # the first page that starts within the run
        end = min(chain_pages, (int(p[-1]) + 1) // page_size)
        whole = np.arange(first, max(first, end), dtype=np.int64)
        lo = whole.size and first * page_size - int(p[0])
        order = np.arange(lo, lo + whole.size * page_size, dtype=np.int64)
        cells = np.arange(len(p), dtype=np.int64)
        return whole, order, np.concatenate([cells[:lo], cells[lo + order.size:]])
    inside = p < chain_pages * page_size
    pages = p[inside] // page_size
    count = np.bincount(pages, minlength=chain_pages)
    distinct = np.bincount(np.unique(p[inside]) // page_size, minlength=chain_pages)
    whole = np.flatnonzero((count == page_size) & (distinct == page_size))
    if whole.size == 0:
        return whole, whole, np.arange(len(p), dtype=np.int64)
    paged = np.zeros(chain_pages, dtype=bool)
    paged[whole] = True
    is_paged = np.zeros(len(p), dtype=bool)
    is_paged[np.flatnonzero(inside)] = paged[pages]
    cells = np.flatnonzero(is_paged)
    order = cells[np.argsort(p[cells], kind="stable")]
    return whole, order, np.flatnonzero(~is_paged)


def run_of(order: IntArray) -> int | None:
    """The first cell when ``order`` is one run of consecutive cells, else None."""
    if order.size and int(order[-1]) - int(order[0]) == order.size - 1 and \
            (np.diff(order) == 1).all():
        return int(order[0])
    return None


# -- the rest's header ----------------------------------------------------------


@dataclass(slots=True, frozen=True)
class RestInfo:
    """What a rest's header says."""

    sections: int
    page_size: int
    chain_pages: int
    n_keys: int
    nbytes: int
    digest: bytes
    n_logits: int  # float32 values at the rest's end


def rest_info(rest: Buffer) -> RestInfo:
    view = memoryview(rest).cast("B")
    if view.nbytes < REST_HEAD.size:
        raise BadState("rest truncated")
    magic, sections, page_size, chain_pages, n_keys, nbytes, digest, n_logits = \
        REST_HEAD.unpack_from(view)
    if magic != REST_MAGIC:
        raise BadState("not a rest")
    if page_size < 1 or sections > 16 or n_logits >= MAX_LOGITS \
            or REST_HEAD.size + 4 * n_logits > view.nbytes:
        raise BadState("rest header out of range")
    return RestInfo(sections, page_size, chain_pages, n_keys, nbytes, digest, n_logits)
