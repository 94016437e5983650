"""The attention KV inside a llama.cpp sequence state, cut into pages and put back.

Every FULL checkpoint of a conversation holds the KV of every token before it, so
its checkpoints share most of their bytes. ``split`` cuts a state into the KV of each
whole page of tokens (per KV section: plain attention has one, iSWA two) and the
*rest* (headers, the cells' metadata, the KV of a last partial page, a hybrid's
recurrent state); ``assemble`` puts back exactly the bytes that were cut, checked by
a digest of the whole state. A page is named by its content: ``page_key`` hashes the
page's chained token hash, its section and its bytes, so one page is stored once for
every checkpoint that holds it, and a page computed twice in another batch schedule
(other bytes, docs/design.md fact 10) is another page, never a wrong one.

The layout of what llama.cpp writes, and of the rest, is in docs/design.md ("The
layout of a sequence state"); tests/model/test_kvpages.py pins it.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

import numpy as np
import numpy.typing as npt
import xxhash

from statecache.buffers import Buffer
from statecache.pages import HASH_BYTES, PageHash, TokenArray

PageKey = NewType("PageKey", bytes)
# A page as one buffer, or as its parts (one per block of its stream, in order: views
# into the state it was cut from, which they keep alive).
PageData = Buffer | tuple[memoryview, ...]

REST_MAGIC = b"SCR2"  # SCR1 (no logits field) is not read: such an entry is a miss
SEQ_MAGIC = 0xAF143CD8  # llama_context::state_seq_get_data's io_magic, then the seq id
# magic, KV sections, page size, chain pages, page keys, state bytes, state digest,
# logits kept after the rest's body (float32 values: 0, or the vocabulary's size)
_REST_HEAD = struct.Struct("<4sIIIIQ16sI")
MAX_LOGITS = 1 << 24  # more than any vocabulary
REST_HEAD_BYTES = _REST_HEAD.size  # what a state kept whole costs beyond its bytes
_BLOCK_HEAD = 12  # i32 type + u64 row size, or i32 type + u32 element size + u32 rows
_META_RAW, _META_RUNS, _META_RUNS_MROPE = 0, 1, 2
_RUN = np.dtype([("pos", "<i4"), ("len", "<u4"), ("seq", "<i4")])
_MAX_STREAMS = 1 << 16
_MAX_LAYERS = 1 << 12
_MAX_ROW = 1 << 24
_MAX_GGML_TYPE = 64
IntArray = npt.NDArray[np.int64]


class BadState(Exception):
    """A rest or page set that does not give back the state it was cut from."""


class _Unparsed(Exception):
    """Not the layout this module knows: the state is kept whole."""


def page_key(chain_hash: PageHash, section: int, parts: Sequence[Buffer]) -> PageKey:
    """The name of one page of KV: its token hash (tokens, positions, prefix, model,
    tenant), its KV section and its bytes."""
    h = xxhash.xxh3_128(chain_hash)
    h.update(struct.pack("<I", section))
    for part in parts:
        h.update(part)
    return PageKey(h.digest())


@dataclass(slots=True, frozen=True)
class Split:
    """A state cut into its rest and its pages (``keys[i]`` names ``parts[i]``)."""

    rest: bytes
    keys: tuple[PageKey, ...]
    parts: tuple[tuple[Buffer, ...], ...]  # views into the state: valid while it is
    nbytes: int  # of the whole state
    offsets: tuple[tuple[int, ...], ...] | None = None  # where each part starts in it

    def page(self, i: int) -> bytes:
        """Page ``i``'s bytes, copied out of the state."""
        return b"".join(self.parts[i])

    def page_size(self, i: int) -> int:
        return sum(memoryview(p).nbytes for p in self.parts[i])

    def moved(self, copy: Buffer | mmap.mmap) -> tuple[tuple[memoryview, ...], ...] | None:
        """The pages' parts as views into ``copy``, a copy of the state that was cut;
        None where a part is not a slice of the state (cut out of a copy made while
        cutting: cells out of position order, or V transposed)."""
        if self.offsets is None or not self.parts or len(copy) != self.nbytes:
            return None
        dst = memoryview(copy).cast("B")
        return tuple(tuple(dst[at:at + memoryview(p).nbytes] for at, p in zip(offs, parts,
                                                                             strict=True))
                     for offs, parts in zip(self.offsets, self.parts, strict=True))


def page_nbytes(page: PageData) -> int:
    if isinstance(page, tuple):
        return sum(p.nbytes for p in page)
    return memoryview(page).nbytes


def page_bytes(page: PageData) -> Buffer:
    """A page as one buffer (its parts joined: a copy)."""
    return b"".join(page) if isinstance(page, tuple) else page


# -- reading what llama.cpp wrote -------------------------------------------------------


class _Reader:
    __slots__ = ("buf", "at")

    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.at = 0

    def take(self, n: int) -> memoryview:
        if n < 0 or self.at + n > len(self.buf):
            raise _Unparsed("truncated")
        out = self.buf[self.at:self.at + n]
        self.at += n
        return out

    def u32(self) -> int:
        return int(struct.unpack_from("<I", self.take(4))[0])

    def peek_u32(self, offset: int = 0) -> int:
        at = self.at + offset
        if at + 4 > len(self.buf):
            raise _Unparsed("truncated")
        return int(struct.unpack_from("<I", self.buf, at)[0])


@dataclass(slots=True)
class _Block:
    head: memoryview  # 12 bytes, as written
    trans: bool  # V stored transposed: n_embd rows of one element per cell
    row: int  # bytes per cell (non-transposed) or per element (transposed)
    n_embd: int  # rows of a transposed block; 1 otherwise
    data: memoryview
    at: int  # where ``data`` starts in the state

    def per_cell(self) -> int:
        return self.row * self.n_embd


@dataclass(slots=True)
class _Stream:
    cells: int
    meta: memoryview  # as written
    stride: int  # meta bytes per cell: 12, or 24 with the M-RoPE extension
    pos: npt.NDArray[np.int32]
    seq: npt.NDArray[np.int32]
    dims: memoryview  # v_trans, n_layer (8 bytes, as written)
    blocks: list[_Block]


def _block(r: _Reader, cells: int, trans: bool) -> _Block:
    head = r.take(_BLOCK_HEAD)
    gtype, a, b = struct.unpack("<iII", head)
    if not 0 <= gtype < _MAX_GGML_TYPE:
        raise _Unparsed("block type")
    if trans:
        row, n_embd = a, b
        if not 0 < row <= 16 or not 0 < n_embd <= _MAX_ROW:
            raise _Unparsed("transposed block size")
    else:
        row, n_embd = a | (b << 32), 1
        if not 0 < row <= _MAX_ROW:
            raise _Unparsed("row size")
    at = r.at
    return _Block(head, trans, row, n_embd, r.take(row * n_embd * cells), at)


def _meta(r: _Reader, cells: int) -> tuple[memoryview, int, npt.NDArray[np.int32],
                                           npt.NDArray[np.int32]]:
    """The cells' metadata: (pos, n_seq_id = 1, [ext: x, y, tok], seq_id) each. The
    extension (M-RoPE models) is told apart by where the data header lands."""
    for stride in (12, 24):
        if r.at + stride * cells + 8 > len(r.buf):
            continue
        raw = r.buf[r.at:r.at + stride * cells]
        arr = np.frombuffer(raw, dtype="<i4").reshape(cells, stride // 4)
        v_trans, n_layer = r.peek_u32(stride * cells), r.peek_u32(stride * cells + 4)
        if (arr[:, 1] == 1).all() and v_trans in (0, 1) and 0 < n_layer <= _MAX_LAYERS \
                and (arr[:, 0] >= 0).all():
            r.take(stride * cells)
            return raw, stride, arr[:, 0], arr[:, -1]
    raise _Unparsed("cell metadata")


def _stream(r: _Reader) -> _Stream | None:
    cells = r.u32()
    if cells == 0:
        return None
    if cells > 1 << 28:
        raise _Unparsed("cell count")
    meta, stride, pos, seq = _meta(r, cells)
    dims = r.take(8)
    v_trans, n_layer = struct.unpack("<II", dims)
    blocks = [_block(r, cells, False) for _ in range(n_layer)]
    blocks += [_block(r, cells, bool(v_trans)) for _ in range(n_layer)]
    return _Stream(cells, meta, stride, pos, seq, dims, blocks)


def _section(r: _Reader) -> list[_Stream | None]:
    n_stream = r.u32()
    if not 0 < n_stream <= _MAX_STREAMS:
        raise _Unparsed("stream count")
    return [_stream(r) for _ in range(n_stream)]


# -- which cells are paged --------------------------------------------------------------


def _covered(pos: npt.NDArray[np.int32], page_size: int, chain_pages: int
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


def _run_of(order: IntArray) -> int | None:
    """The first cell when ``order`` is one run of consecutive cells, else None."""
    if order.size and int(order[-1]) - int(order[0]) == order.size - 1 and \
            (np.diff(order) == 1).all():
        return int(order[0])
    return None


# -- split -------------------------------------------------------------------------------


def split(state: Buffer | mmap.mmap, *, sections: int, page_size: int,
          chain: Sequence[PageHash], tokens: TokenArray | None = None,
          logits: npt.NDArray[np.float32] | None = None) -> Split:
    """Cut ``state`` (a FULL sequence state whose memory writes ``sections`` KV caches
    first) into its rest and one page per whole page of ``chain`` each section holds.
    ``tokens`` (those the state consumed) let an M-RoPE model's cell metadata, which
    repeats them, be kept as runs. A state of another layout is kept whole (no pages).
    ``logits``: the last row's logits after those tokens, kept at the rest's end
    (``rest_logits`` reads them back); the state's digest does not cover them, the
    tiers' checks of the rest do."""
    view = memoryview(state).cast("B")
    digest = xxhash.xxh3_128_digest(view)
    tail = b"" if logits is None else np.ascontiguousarray(logits, dtype="<f4").tobytes()
    n_logits = len(tail) // 4
    if not 0 <= n_logits < MAX_LOGITS:
        raise ValueError(f"{n_logits} logits: more than any vocabulary")
    if sections > 0 and chain:
        try:
            return _split(view, sections, page_size, chain, digest, tokens, tail)
        except _Unparsed:
            pass
    head = _REST_HEAD.pack(REST_MAGIC, 0, page_size, len(chain), 0, view.nbytes, digest,
                           n_logits)
    return Split(b"".join((head, view, tail)), (), (), view.nbytes)


def _split(view: memoryview, sections: int, page_size: int, chain: Sequence[PageHash],
           digest: bytes, tokens: TokenArray | None, tail: bytes) -> Split:
    r = _Reader(view)
    if r.peek_u32() != SEQ_MAGIC:
        raise _Unparsed("not a sequence state")
    out: list[Buffer] = [r.take(8)]  # magic, the lane it was saved from
    keys: list[PageKey] = []
    parts: list[tuple[Buffer, ...]] = []
    offsets: list[tuple[int, ...]] | None = []
    for s in range(sections):
        streams = _section(r)
        out.append(struct.pack("<I", len(streams)))
        for st in streams:
            if st is None:
                out.append(struct.pack("<I", 0))
                continue
            whole, order, rest = _covered(st.pos, page_size, len(chain))
            out += [struct.pack("<I", st.cells), _encode_meta(st, tokens), st.dims]
            per_block = [_cut(b, order, rest, whole.size, page_size, out) for b in st.blocks]
            starts = [at for _, at in per_block if at is not None]
            if len(starts) != len(per_block):
                offsets = None  # parts copied while cutting: no offsets in the state
            for i, p in enumerate(whole):
                page = tuple(pb[i] for pb, _ in per_block)
                keys.append(page_key(chain[int(p)], s, page))
                parts.append(page)
                if offsets is not None:
                    offsets.append(tuple(at[i] for at in starts))
    out.append(r.buf[r.at:])  # a hybrid's recurrent part, verbatim
    head = _REST_HEAD.pack(REST_MAGIC, sections, page_size, len(chain), len(keys),
                           view.nbytes, digest, len(tail) // 4)
    return Split(b"".join([head, *out, tail]), tuple(keys), tuple(parts), view.nbytes,
                 None if offsets is None else tuple(offsets))


def _runs(st: _Stream) -> npt.NDArray[np.void]:
    """Runs of cells at consecutive positions of one sequence."""
    pos, seq = st.pos.astype(np.int64), st.seq
    breaks = np.flatnonzero((np.diff(pos) != 1) | (np.diff(seq) != 0)) + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64)
    runs = np.empty(len(starts), dtype=_RUN)
    runs["pos"] = st.pos[starts]
    runs["len"] = np.diff(np.concatenate([starts, [st.cells]]))
    runs["seq"] = seq[starts]
    return runs


def _encode_meta(st: _Stream, tokens: TokenArray | None) -> bytes:
    """The cells' metadata: as runs of consecutive positions of one sequence where it
    is plain (12 bytes a run, not a cell); with the M-RoPE extension, the same where a
    cell's x and y are its position and its token is the prompt's there (text, not an
    image); else as written."""
    if st.stride == 12:
        runs = _runs(st)
        return struct.pack("<BI", _META_RUNS, len(runs)) + runs.tobytes()
    arr = np.frombuffer(st.meta, dtype="<i4").reshape(st.cells, 6)
    pos = st.pos.astype(np.int64)
    if tokens is not None and int(pos.max()) < len(tokens) and \
            (arr[:, 2] == pos).all() and (arr[:, 3] == pos).all() and \
            (arr[:, 4] == tokens[pos]).all():
        runs = _runs(st)
        return struct.pack("<BI", _META_RUNS_MROPE, len(runs)) + runs.tobytes()
    return struct.pack("<BI", _META_RAW, st.stride) + bytes(st.meta)


def _cut(b: _Block, order: IntArray, rest: IntArray, n_pages: int, page_size: int,
         out: list[Buffer]) -> tuple[list[Buffer], list[int] | None]:
    """Append the block's header and its unpaged cells to ``out``; its part of each
    page (cells in position order), and where each starts in the state (None: parts
    copied out of it)."""
    out.append(b.head)
    row = b.row
    if not b.trans:
        rows = np.frombuffer(b.data, dtype=np.uint8).reshape(-1, row)
        first = _run_of(rest)
        out.append(b.data[first * row:(first + rest.size) * row] if first is not None
                   else rows[rest].tobytes())
        if n_pages == 0:
            return [], []
        per = page_size * row
        first = _run_of(order)
        if first is not None:  # the usual case: no copy
            starts = [first * row + i * per for i in range(n_pages)]
            return [b.data[at:at + per] for at in starts], [b.at + at for at in starts]
        flat = np.ascontiguousarray(rows[order]).data.cast("B")
        return [flat[i * per:(i + 1) * per] for i in range(n_pages)], None
    cube = np.frombuffer(b.data, dtype=np.uint8).reshape(b.n_embd, -1, row)
    out.append(cube[:, rest, :].tobytes())
    if n_pages == 0:
        return [], []
    paged = cube[:, order, :].reshape(b.n_embd, n_pages, page_size, row).transpose(1, 0, 2, 3)
    flat = np.ascontiguousarray(paged).data.cast("B")
    per = b.n_embd * page_size * row
    return [flat[i * per:(i + 1) * per] for i in range(n_pages)], None


# -- assemble ----------------------------------------------------------------------------


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
    if view.nbytes < _REST_HEAD.size:
        raise BadState("rest truncated")
    magic, sections, page_size, chain_pages, n_keys, nbytes, digest, n_logits = \
        _REST_HEAD.unpack_from(view)
    if magic != REST_MAGIC:
        raise BadState("not a rest")
    if page_size < 1 or sections > 16 or n_logits >= MAX_LOGITS \
            or _REST_HEAD.size + 4 * n_logits > view.nbytes:
        raise BadState("rest header out of range")
    return RestInfo(sections, page_size, chain_pages, n_keys, nbytes, digest, n_logits)


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
        return _saved(info, body[_REST_HEAD.size:])
    if out is None or len(out) < info.nbytes:
        out = bytearray(info.nbytes)
    dst = memoryview(out)[:info.nbytes]
    r = _Reader(body)
    r.take(_REST_HEAD.size)
    try:
        at = _assemble(r, info, [tuple(q.cast("B") for q in p) if isinstance(p, tuple)
                                 else memoryview(p).cast("B") for p in pages], dst, tokens)
    except (_Unparsed, ValueError, IndexError) as e:
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
            raise _Unparsed("state longer than its header says")
        self.dst[self.at:self.at + n] = memoryview(data).cast("B")
        self.at += n

    def region(self, n: int) -> memoryview:
        if self.at + n > len(self.dst):
            raise _Unparsed("state longer than its header says")
        out = self.dst[self.at:self.at + n]
        self.at += n
        return out


def _assemble(r: _Reader, info: RestInfo, pages: list[memoryview | tuple[memoryview, ...]],
              dst: memoryview,
              tokens: TokenArray | None) -> int:
    w = _Writer(dst)
    w.put(r.take(8))
    used = 0
    for _ in range(info.sections):
        n_stream = r.u32()
        if not 0 < n_stream <= _MAX_STREAMS:
            raise _Unparsed("stream count")
        w.put(struct.pack("<I", n_stream))
        for _ in range(n_stream):
            cells = r.u32()
            w.put(struct.pack("<I", cells))
            if cells == 0:
                continue
            pos = _decode_meta(r, cells, w, tokens)
            whole, order, rest = _covered(pos, info.page_size, info.chain_pages)
            mine = pages[used:used + whole.size]
            if len(mine) != whole.size:
                raise _Unparsed("fewer pages than the rest's cells need")
            used += whole.size
            dims = r.take(8)
            w.put(dims)
            v_trans, n_layer = struct.unpack("<II", dims)
            if n_layer > _MAX_LAYERS:
                raise _Unparsed("layer count")
            offset = 0
            for k in range(2 * n_layer):
                offset = _fill(r, w, cells, k >= n_layer and bool(v_trans), order, rest,
                               [_block_of(p, k, offset) for p in mine], offset,
                               info.page_size)
            if any((len(p) != 2 * n_layer or sum(q.nbytes for q in p) != offset)
                   if isinstance(p, tuple) else len(p) != offset for p in mine):
                raise _Unparsed("a page of the wrong size")
    if used != len(pages):
        raise _Unparsed("pages left over")
    w.put(r.buf[r.at:])
    return w.at


def _decode_meta(r: _Reader, cells: int, w: _Writer, tokens: TokenArray | None
                 ) -> npt.NDArray[np.int32]:
    mode, n = struct.unpack("<BI", r.take(5))
    if mode == _META_RAW:
        if n not in (12, 24):
            raise _Unparsed("meta stride")
        raw = r.take(n * cells)
        w.put(raw)
        return np.frombuffer(raw, dtype="<i4").reshape(cells, n // 4)[:, 0]
    if mode not in (_META_RUNS, _META_RUNS_MROPE) or n > cells:
        raise _Unparsed("meta mode")
    runs = np.frombuffer(r.take(n * _RUN.itemsize), dtype=_RUN)
    lens = runs["len"].astype(np.int64)
    if int(lens.sum()) != cells or (lens < 1).any():
        raise _Unparsed("meta runs")
    starts = np.repeat(np.cumsum(lens) - lens, lens)
    pos = np.repeat(runs["pos"].astype(np.int64), lens) + (np.arange(cells) - starts)
    width = 3 if mode == _META_RUNS else 6
    meta = np.frombuffer(w.region(4 * width * cells), dtype="<i4").reshape(cells, width)
    meta.flags.writeable = True  # a view of the caller's buffer
    meta[:, 0] = pos
    meta[:, 1] = 1
    meta[:, -1] = np.repeat(runs["seq"], lens)
    if mode == _META_RUNS_MROPE:
        if tokens is None or int(pos.max()) >= len(tokens) or int(pos.min()) < 0:
            raise _Unparsed("the prompt's tokens are needed, or do not reach")
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


def _fill(r: _Reader, w: _Writer, cells: int, trans: bool, order: IntArray, rest: IntArray,
          pages: list[memoryview], offset: int, page_size: int) -> int:
    """One block: header from the rest, unpaged cells from the rest, paged cells from
    the pages (each page's part of this block, from its start); returns the next
    part's offset."""
    head = r.take(_BLOCK_HEAD)
    w.put(head)
    _gtype, a, b = struct.unpack("<iII", head)
    row, n_embd = (a, b) if trans else (a | (b << 32), 1)
    if not 0 < row <= _MAX_ROW or not 0 < n_embd <= _MAX_ROW:
        raise _Unparsed("block size")
    region = w.region(row * n_embd * cells)
    per = page_size * row * n_embd
    if not trans:
        rows = np.frombuffer(region, dtype=np.uint8).reshape(cells, row)
        rows.flags.writeable = True
        src = r.take(rest.size * row)
        first = _run_of(rest)
        if first is not None:
            region[first * row:(first + rest.size) * row] = src
        elif rest.size:
            rows[rest] = np.frombuffer(src, dtype=np.uint8).reshape(-1, row)
        first = _run_of(order)
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


def key_bytes(keys: Sequence[PageKey]) -> bytes:
    """Keys packed end to end (what a record keeps: one object, not one per page)."""
    return b"".join(keys)


def unpack_keys(raw: bytes) -> tuple[PageKey, ...]:
    if len(raw) % HASH_BYTES:
        raise ValueError("packed page keys of the wrong length")
    return tuple(PageKey(raw[i:i + HASH_BYTES]) for i in range(0, len(raw), HASH_BYTES))
