"""A sequence state as of a position inside the step that saved it, in its bytes.

``cut_back``: every KV section of what llama.cpp wrote, each stream keeping the cells
before ``n`` (their metadata, and each layer's K and V rows), as ``seq_rm(seq, n, -1)``
would leave them. That is the state at ``n`` for plain attention, whose writer writes
every cell. A window-sized SWA cache's writer writes only the cells inside the window of
the lane's last position (docs/design.md fact 27), so its state at ``n`` takes the cells
of the window before ``n`` from two saves: a PARTIAL one before the step (the SWA cells
up to where it starts) and the one after it (``state_at``). A prefill then ends no step
at a checkpoint inside it (proxy/engine/points.py, the points saved behind a step).
"""

from __future__ import annotations

import struct

import numpy as np

from statecache.buffers import Buffer
from statecache.kvpages.layout import SEQ_MAGIC, Block, Reader, Stream, Unparsed, section


def cut_back(state: Buffer, n: int, *, sections: int) -> bytes:
    """``state`` (a sequence state whose memory writes ``sections`` KV caches and
    nothing after them) without its cells at positions ``n`` and beyond. Raises
    ``Unparsed`` where the state is not that layout (a recurrent part after the
    sections, which no cut in the bytes can take back)."""
    view = memoryview(state).cast("B")
    r = Reader(view)
    if sections < 1 or r.peek_u32() != SEQ_MAGIC:
        raise Unparsed("not a sequence state of KV sections")
    out: list[Buffer] = [r.take(8)]  # magic, the lane it was saved from
    for _ in range(sections):
        streams = section(r)
        out.append(struct.pack("<I", len(streams)))
        for st in streams:
            if st is None:
                out.append(struct.pack("<I", 0))
            else:
                _stream(st, n, out)
    if r.at != view.nbytes:
        raise Unparsed("more than KV sections")
    return b"".join(out)


def state_at(after: Buffer, before: Buffer, n: int, *, sections: int, n_swa: int
             ) -> list[Buffer]:
    """The state of a window-sized SWA cache at ``n``, in parts to be joined: ``after``
    (saved after a step that passed ``n``; its last of ``sections`` KV sections is the
    SWA cache) cut back to ``n``, its SWA cells those whose window reaches ``n`` (from
    ``n - n_swa``), taken from ``before`` (a PARTIAL state, the SWA cache alone, saved
    before that step) up to where the step started, from ``after`` from there. Raises
    ``Unparsed`` where either is not that layout, and ``ValueError`` where the two do
    not hold every cell of that window (a step longer than the window)."""
    r, b = Reader(memoryview(after).cast("B")), Reader(memoryview(before).cast("B"))
    if sections < 1 or r.peek_u32() != SEQ_MAGIC or b.peek_u32() != SEQ_MAGIC:
        raise Unparsed("not sequence states of KV sections")
    out: list[Buffer] = [r.take(8)]
    b.take(8)
    for _ in range(sections - 1):
        streams = section(r)
        out.append(struct.pack("<I", len(streams)))
        for st in streams:
            if st is None:
                out.append(struct.pack("<I", 0))
            else:
                _stream(st, n, out)
    late, early = section(r), section(b)
    if r.at != r.buf.nbytes or b.at != b.buf.nbytes or len(late) != len(early):
        raise Unparsed("more than KV sections, or streams that differ")
    out.append(struct.pack("<I", len(late)))
    lo = n - n_swa
    for st, old in zip(late, early, strict=True):
        start = int(st.pos.min()) if st is not None else n  # where the SWA cells resume
        parts = [(old, np.flatnonzero((old.pos >= lo) & (old.pos < min(n, start))))
                 if old is not None else None,
                 (st, np.flatnonzero(st.pos < n)) if st is not None else None]
        got = [(s, k) for s, k in (p for p in parts if p is not None) if k.size]
        held = sum(k.size for _, k in got)
        if held != n - max(lo, 0) and got:
            raise ValueError(f"{held} cells of the window before {n}: a step longer "
                             f"than the window ({n_swa})")
        _merged(got, out)
    return out


def _merged(got: list[tuple[Stream, np.ndarray]], out: list[Buffer]) -> None:
    """One stream of the cells ``got`` picks from each of its streams (of one model)."""
    if not got:
        out.append(struct.pack("<I", 0))
        return
    first = got[0][0]
    out += [struct.pack("<I", sum(k.size for _, k in got)),
            *(np.frombuffer(s.meta, dtype=np.uint8).reshape(s.cells, s.stride)[k].tobytes()
              for s, k in got),
            first.dims]
    for i, blk in enumerate(first.blocks):
        if blk.trans:
            out += [blk.head, np.concatenate(
                [np.frombuffer(s.blocks[i].data, dtype=np.uint8)
                 .reshape(s.blocks[i].n_embd, s.cells, s.blocks[i].row)[:, k, :]
                 for s, k in got], axis=1).tobytes()]
        else:
            out += [blk.head, *(_rows(s.blocks[i], s.cells, k, None) for s, k in got)]


def _stream(st: Stream, n: int, out: list[Buffer]) -> None:
    keep = np.flatnonzero(st.pos < n)
    if keep.size == 0:
        out.append(struct.pack("<I", 0))
        return
    first = int(keep[0])
    run = int(keep[-1]) - first == keep.size - 1  # one run of cells: slices, no copy
    meta = np.frombuffer(st.meta, dtype=np.uint8).reshape(st.cells, st.stride)
    out += [struct.pack("<I", keep.size),
            st.meta[first * st.stride:(first + keep.size) * st.stride] if run
            else meta[keep].tobytes(),
            st.dims]
    for b in st.blocks:
        out += [b.head, _rows(b, st.cells, keep, first if run else None)]


def _rows(b: Block, cells: int, keep: np.ndarray, first: int | None) -> Buffer:
    """The block's data for the cells kept: rows of K or V, or (V transposed) each
    embedding row's elements for those cells."""
    if not b.trans:
        if first is not None:
            return b.data[first * b.row:(first + keep.size) * b.row]
        return np.frombuffer(b.data, dtype=np.uint8).reshape(cells, b.row)[keep].tobytes()
    cube = np.frombuffer(b.data, dtype=np.uint8).reshape(b.n_embd, cells, b.row)
    return cube[:, keep, :].tobytes()
