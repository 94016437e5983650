"""A state as of a position inside the step that saved it (statecache/kvpages/cut.py,
docs/design.md fact 27): on Gemma 3 with a window-sized SWA cache, built from the saves
before and after the step, it holds the cells the live lane cut back there holds, FULL and
PARTIAL, with flash attention on (V as rows) and off (V transposed); a step longer than
the window is refused. On plain attention the state after the step, cut back, is the
state there. A hybrid's recurrent state is refused: no cut in the bytes takes it back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from proxy.engine.binding import FLAGS_FULL, FLAGS_PARTIAL, Context, ContextParams, Model
from statecache.kvpages.cut import cut_back, state_at
from statecache.kvpages.layout import Block, Reader, Unparsed, section
from tests.busy import THREADS

pytestmark = pytest.mark.model

TEXT = " ".join(f"Line {i}: the checkpoint at {i * 3} is cut back, not prefilled {i % 7} "
                "times." for i in range(300))


def _step(ctx: Context, lane: int, tok: int, pos: int) -> np.ndarray:
    ctx.batch.clear()
    row = ctx.batch.add(lane, [tok], pos, logits_last=True)
    ctx.decode()
    return ctx.logits(row).copy()


def _ctx(model: Model, flash: int = 1, ubatch: int = 512) -> Context:
    return Context(model, ContextParams(n_ctx=4096 * 3, n_seq_max=3, n_batch=ubatch,
                                        n_ubatch=ubatch, threads=THREADS, flash_attn=flash,
                                        swa_full=False))


def _cells(state: bytes, sections: int) -> list[dict[int, bytes]]:
    """Each KV section of a state as {position: its cell's K and V bytes, every layer}."""
    r = Reader(memoryview(state))
    r.take(8)
    out: list[dict[int, bytes]] = []
    for _ in range(sections):
        cells: dict[int, bytes] = {}
        for st in section(r):
            if st is None:
                continue
            for i, pos in enumerate(st.pos.tolist()):
                assert pos not in cells
                cells[pos] = b"".join(_cell(b, st.cells, i) for b in st.blocks)
        out.append(cells)
    return out


def _cell(b: Block, cells: int, i: int) -> bytes:
    if not b.trans:
        return bytes(b.data[i * b.row:(i + 1) * b.row])
    cube = np.frombuffer(b.data, dtype=np.uint8).reshape(b.n_embd, cells, b.row)
    return cube[:, i, :].tobytes()


@pytest.mark.parametrize(("flash", "n"), [(1, 1025), (0, 1300), (1, 1535)])
def test_a_window_state_inside_a_step(gemma_path: Path, flash: int, n: int) -> None:
    """The state at n, built from the saves before and after the step [a, e), holds
    the cells, byte for byte, that the live lane cut back to n and saved there holds,
    with V as rows (flash attention on) and transposed (off); restored FULL, or PARTIAL
    into a lane that holds the base cache, the logits after it are the same. (Not the
    live lane's bit for bit: a window-sized SWA cache's cells lie in another order in a
    restored lane, and attention sums them in that order, docs/design.md fact 12.)"""
    a, e = 1024, 1536
    with Model(gemma_path) as model, _ctx(model, flash) as ctx:
        mem = ctx.describe_memory()
        assert mem.swa_window and mem.n_swa == 512
        toks = model.tokenize(TEXT, add_special=True)[: e + 1]
        ctx.prefill(0, toks[:a], 0, logits_last=False)
        before = bytes(ctx.save(0, FLAGS_PARTIAL))
        ctx.prefill(0, toks[a:e], a, logits_last=False)
        after = {flags: bytes(ctx.save(0, flags)) for flags in (FLAGS_FULL, FLAGS_PARTIAL)}
        built = {flags: b"".join(state_at(after[flags], before, n, sections=k,
                                          n_swa=mem.n_swa))
                 for flags, k in ((FLAGS_FULL, 2), (FLAGS_PARTIAL, 1))}
        ctx.prefill(2, toks[:e], 0, logits_last=False)  # a lane that holds the base cache
        # the live lane cut back there (its cells still reach a window back from n)
        assert ctx.pos_min(0) <= n - mem.n_swa
        assert ctx.seq_rm(0, n, -1)
        for flags, k in ((FLAGS_FULL, 2), (FLAGS_PARTIAL, 1)):
            want = _cells(bytes(ctx.save(0, flags)), k)
            assert _cells(built[flags], k) == want
            assert len(want[-1]) == mem.n_swa and min(want[-1]) == n - mem.n_swa
        assert ctx.restore(1, built[FLAGS_FULL], FLAGS_FULL)
        assert ctx.restore(2, built[FLAGS_PARTIAL], FLAGS_PARTIAL)
        assert ctx.seq_rm(2, n, -1)
        for lane in (1, 2):
            assert (ctx.pos_min(lane), ctx.pos_max(lane)) == (n - mem.n_swa, n - 1)
        got = [_step(ctx, lane, toks[n], n) for lane in (1, 2)]
        # the state after the step cut back alone lacks the window's first cells:
        # llama.cpp writes the SWA cells of its last position's window (fact 27)
        short = _cells(cut_back(after[FLAGS_FULL], n, sections=2), 2)[1]
        assert min(short) == e - mem.n_swa
    assert np.array_equal(got[0], got[1])


def test_a_step_longer_than_the_window_is_refused(gemma_path: Path) -> None:
    with Model(gemma_path) as model, _ctx(model, ubatch=1024) as ctx:
        toks = model.tokenize(TEXT, add_special=True)[:2048]
        ctx.prefill(0, toks[:1024], 0, logits_last=False)
        before = bytes(ctx.save(0, FLAGS_PARTIAL))
        ctx.prefill(0, toks[1024:], 1024, logits_last=False)
        after = bytes(ctx.save(0, FLAGS_FULL))
        with pytest.raises(ValueError, match="longer than the window"):
            state_at(after, before, 1900, sections=2, n_swa=512)


def test_plain_attention_and_a_hybrid(draft_path: Path, hybrid_path: Path) -> None:
    with Model(draft_path) as model, _ctx(model) as ctx:
        toks = model.tokenize(TEXT, add_special=True)[:700]
        ctx.prefill(0, toks[:600], 0, logits_last=False)
        assert ctx.restore(1, cut_back(bytes(ctx.save(0, FLAGS_FULL)), 333, sections=1),
                           FLAGS_FULL)
        got = _step(ctx, 1, toks[333], 333)
        assert ctx.seq_rm(0, 333, -1)
        assert np.array_equal(got, _step(ctx, 0, toks[333], 333))
    with Model(hybrid_path) as model, _ctx(model) as ctx:
        toks = model.tokenize(TEXT, add_special=True)[:300]
        ctx.prefill(0, toks, 0, logits_last=False)
        with pytest.raises(Unparsed):
            cut_back(bytes(ctx.save(0, FLAGS_FULL)), 100, sections=1)
