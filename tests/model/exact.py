"""What an exact restore is, checked without arithmetic: a lane restored from saved bytes
and fed the same tokens in the same batches as a lane that never saved gives the same
logits bit for bit, and saving it again right after the restore gives back the bytes
that were saved. Neither check allows a tolerance, so no rounding of any backend passes
a wrong state, and only a state that differs can fail them (docs/design.md, "Exact
restores").

``flip_page_byte`` and ``flip_recurrent_byte`` spoil one byte of a state where the
pool's own checks (the digest of the assembled state, the tiers' MACs) no longer look:
the tests show that the checks here catch each.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from proxy.engine.binding import FLAGS_FULL, Context
from statecache.kvpages import split
from statecache.kvpages.layout import Reader, section
from statecache.pages import PageChain, namespace_hash

PAGE = 32


@dataclass(slots=True, frozen=True)
class Schedule:
    """The batches of a run: ``prefix`` feeds the first tokens (the last row's logits
    kept), ``tail`` the continuation after the restore point (every row's logits)."""

    prefix: tuple[int, ...]
    tail: tuple[int, ...] = (16, 1, 1, 4, 1)

    @property
    def n(self) -> int:
        return sum(self.prefix)

    @property
    def end(self) -> int:
        return self.n + sum(self.tail)


def chunks(n: int, size: int) -> tuple[int, ...]:
    return tuple(min(size, n - i) for i in range(0, n, size))


def feed(ctx: Context, lane: int, tokens: Sequence[int], pos0: int, sizes: Sequence[int],
         *, every_row: bool) -> np.ndarray:
    """Decode ``tokens`` into ``lane`` from ``pos0``, one batch per size: the logits of
    every row (``every_row``), else of the last row only."""
    assert sum(sizes) == len(tokens)
    rows: list[np.ndarray] = []
    at = 0
    for k in sizes:
        ctx.batch.clear()
        last = ctx.batch.add(lane, tokens[at:at + k], pos0 + at,
                             logits_last=not every_row and at + k == len(tokens),
                             logits_from=0 if every_row else -1)
        ctx.decode()
        first = last - k + 1 if every_row else last
        if every_row or at + k == len(tokens):
            rows += [ctx.logits(r) for r in range(first, last + 1)]
        at += k
    return np.stack(rows)


@dataclass(slots=True, frozen=True)
class Outcome:
    """A restored lane: its state saved again at once, and the continuation's logits."""

    resaved: bytes
    rows: np.ndarray


def restore_and_go_on(ctx: Context, lane: int, data: bytes | memoryview, tokens: Sequence[int],
                      sched: Schedule, *, flags: int = FLAGS_FULL, cut: bool = False
                      ) -> Outcome:
    """Restore ``data`` into ``lane`` (a PARTIAL state: restore first, then cut the lane
    back to its position, as the engine does: docs/design.md fact 7), save it again,
    and feed the continuation in ``sched.tail``'s batches."""
    n = sched.n
    if flags == FLAGS_FULL:
        ctx.clear_lane(lane)
    assert ctx.restore(lane, data, flags), "llama.cpp refused the state"
    resaved = bytes(ctx.save(lane, flags))
    if cut:
        assert ctx.seq_rm(lane, n, -1)
    assert ctx.pos_max(lane) == n - 1
    rows = feed(ctx, lane, tokens[n:sched.end], n, sched.tail, every_row=True)
    return Outcome(resaved, rows)


def differences(saved: bytes, ref: np.ndarray, got: Outcome) -> list[str]:
    """What differs between a restore and the run it must equal; empty when exact."""
    out: list[str] = []
    if got.resaved != saved:
        a = np.frombuffer(saved, np.uint8)
        b = np.frombuffer(got.resaved, np.uint8)
        m = min(a.size, b.size)
        at = np.flatnonzero(a[:m] != b[:m])
        first = int(at[0]) if at.size else m
        out.append(f"saved again: {b.size} bytes against {a.size}, first difference at "
                   f"byte {first}")
    if got.rows.shape != ref.shape:
        out.append(f"logits of shape {got.rows.shape} against {ref.shape}")
    else:
        rows = [i for i in range(ref.shape[0]) if not np.array_equal(ref[i], got.rows[i])]
        if rows:
            gap = float(np.nanmax(np.abs(ref[rows[0]] - got.rows[rows[0]])))
            out.append(f"logits differ at {len(rows)} of {ref.shape[0]} rows, first at "
                       f"row {rows[0]} (by up to {gap:.3g})")
    return out


# -- spoiling a restore on purpose ---------------------------------------------------------


def flip_page_byte(state: bytes, *, sections: int, tokens: Sequence[int], fingerprint: str
                   ) -> bytes:
    """``state`` with one byte changed inside its second KV page: the high byte of the
    first K element of the page's first cell (statecache.kvpages cuts it there)."""
    n = len(tokens)
    chain = PageChain(namespace_hash(fingerprint, ""), PAGE, tokens[:n]).hashes
    sp = split(state, sections=sections, page_size=PAGE, chain=chain,
               tokens=np.array(tokens, dtype="<i4"))
    assert sp.offsets is not None and len(sp.offsets) > 1, "no pages cut from the state"
    return _flipped(state, sp.offsets[1][0] + 1)


def recurrent_part(state: bytes, sections: int) -> int:
    """Where a hybrid state's recurrent part starts (after its KV sections)."""
    r = Reader(memoryview(state))
    r.take(8)  # magic, the lane it was saved from
    for _ in range(sections):
        section(r)
    return r.at


def flip_recurrent_byte(state: bytes, *, sections: int) -> bytes:
    """``state`` with one byte of its recurrent part changed: the high byte of a float
    of the last layer's state rows, which end the state (docs/design.md fact 18)."""
    start = recurrent_part(state, sections)
    at = len(state) - 1024 + 3
    assert len(state) - start > 4096 and at > start, "no recurrent part to spoil"
    return _flipped(state, at)


def _flipped(state: bytes, at: int) -> bytes:
    out = bytearray(state)
    out[at] ^= 0x01
    return bytes(out)
