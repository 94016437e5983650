"""Cutting a FULL sequence state into its rest and its KV pages.

``split`` cuts a state into the KV of each whole page of tokens (per KV section: plain
attention has one, iSWA two) and the *rest* (headers, the cells' metadata as runs, the
KV of a last partial page, a hybrid's recurrent state, and the logits kept with it). A
state of another layout is kept whole: a rest without pages.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import xxhash

from statecache.buffers import Buffer
from statecache.kvpages.layout import (
    MAX_LOGITS,
    META_RAW,
    META_RUNS,
    META_RUNS_MROPE,
    REST_HEAD,
    REST_MAGIC,
    RUN,
    SEQ_MAGIC,
    Block,
    IntArray,
    Reader,
    Stream,
    Unparsed,
    covered,
    run_of,
    section,
)
from statecache.kvpages.page import PageKey, page_key
from statecache.pages import PageHash, TokenArray


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
        except Unparsed:
            pass
    head = REST_HEAD.pack(REST_MAGIC, 0, page_size, len(chain), 0, view.nbytes, digest,
                           n_logits)
    return Split(b"".join((head, view, tail)), (), (), view.nbytes)


def _split(view: memoryview, sections: int, page_size: int, chain: Sequence[PageHash],
           digest: bytes, tokens: TokenArray | None, tail: bytes) -> Split:
    r = Reader(view)
    if r.peek_u32() != SEQ_MAGIC:
        raise Unparsed("not a sequence state")
    out: list[Buffer] = [r.take(8)]  # magic, the lane it was saved from
    keys: list[PageKey] = []
    parts: list[tuple[Buffer, ...]] = []
    offsets: list[tuple[int, ...]] | None = []
    for s in range(sections):
        streams = section(r)
        out.append(struct.pack("<I", len(streams)))
        for st in streams:
            if st is None:
                out.append(struct.pack("<I", 0))
                continue
            whole, order, rest = covered(st.pos, page_size, len(chain))
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
    head = REST_HEAD.pack(REST_MAGIC, sections, page_size, len(chain), len(keys),
                           view.nbytes, digest, len(tail) // 4)
    return Split(b"".join([head, *out, tail]), tuple(keys), tuple(parts), view.nbytes,
                 None if offsets is None else tuple(offsets))


def _runs(st: Stream) -> npt.NDArray[np.void]:
    """Runs of cells at consecutive positions of one sequence."""
    pos, seq = st.pos.astype(np.int64), st.seq
    breaks = np.flatnonzero((np.diff(pos) != 1) | (np.diff(seq) != 0)) + 1
    starts = np.concatenate([[0], breaks]).astype(np.int64)
    runs = np.empty(len(starts), dtype=RUN)
    runs["pos"] = st.pos[starts]
    runs["len"] = np.diff(np.concatenate([starts, [st.cells]]))
    runs["seq"] = seq[starts]
    return runs


def _encode_meta(st: Stream, tokens: TokenArray | None) -> bytes:
    """The cells' metadata: as runs of consecutive positions of one sequence where it
    is plain (12 bytes a run, not a cell); with the M-RoPE extension, the same where a
    cell's x and y are its position and its token is the prompt's there (text, not an
    image); else as written."""
    if st.stride == 12:
        runs = _runs(st)
        return struct.pack("<BI", META_RUNS, len(runs)) + runs.tobytes()
    arr = np.frombuffer(st.meta, dtype="<i4").reshape(st.cells, 6)
    pos = st.pos.astype(np.int64)
    if tokens is not None and int(pos.max()) < len(tokens) and \
            (arr[:, 2] == pos).all() and (arr[:, 3] == pos).all() and \
            (arr[:, 4] == tokens[pos]).all():
        runs = _runs(st)
        return struct.pack("<BI", META_RUNS_MROPE, len(runs)) + runs.tobytes()
    return struct.pack("<BI", META_RAW, st.stride) + bytes(st.meta)


def _cut(b: Block, order: IntArray, rest: IntArray, n_pages: int, page_size: int,
         out: list[Buffer]) -> tuple[list[Buffer], list[int] | None]:
    """Append the block's header and its unpaged cells to ``out``; its part of each
    page (cells in position order), and where each starts in the state (None: parts
    copied out of it)."""
    out.append(b.head)
    row = b.row
    if not b.trans:
        rows = np.frombuffer(b.data, dtype=np.uint8).reshape(-1, row)
        first = run_of(rest)
        out.append(b.data[first * row:(first + rest.size) * row] if first is not None
                   else rows[rest].tobytes())
        if n_pages == 0:
            return [], []
        per = page_size * row
        first = run_of(order)
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


