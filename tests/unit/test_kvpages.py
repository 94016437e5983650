"""Cutting a sequence state into KV pages and its rest, and putting it back: states
written here the way llama.cpp's state writer lays them out (docs/design.md, "The
layout of a sequence state"), with the cases a live lane seldom shows: cells out of
position order, holes, a transposed V, the M-RoPE cell extension, two KV sections and
a recurrent tail. tests/model/test_kvpages.py does the same on real states."""

from __future__ import annotations

import random
import struct

import numpy as np
import pytest

from statecache.kvpages import (
    REST_HEAD_BYTES,
    SEQ_MAGIC,
    BadState,
    assemble,
    rest_info,
    rest_logits,
    split,
)
from statecache.pages import PageChain, namespace_hash

P = 4  # page size


def kv_section(pos: list[int], *, seq: int = 1, n_stream: int = 2, layers: int = 2,
               row: int = 6, trans: bool = False, n_embd_v: int = 3, ext: bool = False,
               text: list[int] | None = None, rng: random.Random) -> bytes:
    """One llama_kv_cache::state_write of one sequence: its stream holds ``pos`` (cell
    order), the other stream is empty."""
    out = [struct.pack("<I", n_stream)]
    for s in range(n_stream):
        if s != seq % n_stream:
            out.append(struct.pack("<I", 0))
            continue
        out.append(struct.pack("<I", len(pos)))
        for p in pos:
            out.append(struct.pack("<iI", p, 1))
            if ext and text is not None:  # a text token of an M-RoPE model
                out.append(struct.pack("<iii", p, p, text[p]))
            elif ext:  # an image's cell, say
                out.append(struct.pack("<iii", p % 7, p % 5, 1000 + p))
            out.append(struct.pack("<i", seq))
        out.append(struct.pack("<II", int(trans), layers))
        cells = len(pos)
        for _ in range(layers):  # K: one row per cell
            out.append(struct.pack("<iQ", 1, row) + rng.randbytes(row * cells))
        for _ in range(layers):
            if trans:  # V transposed: n_embd rows of one 2-byte element per cell
                out.append(struct.pack("<iII", 1, 2, n_embd_v)
                           + rng.randbytes(2 * n_embd_v * cells))
            else:
                out.append(struct.pack("<iQ", 8, row + 2) + rng.randbytes((row + 2) * cells))
    return b"".join(out)


def state(*sections: bytes, tail: bytes = b"", seq: int = 1) -> bytes:
    return struct.pack("<Ii", SEQ_MAGIC, seq) + b"".join(sections) + tail


def chain(n: int) -> tuple:  # type: ignore[type-arg]
    return PageChain(namespace_hash("fp", ""), P, list(range(100, 100 + n))).hashes


def round_trip(blob: bytes, sections: int, n: int) -> tuple:  # type: ignore[type-arg]
    sp = split(blob, sections=sections, page_size=P, chain=chain(n))
    pages = [sp.page(i) for i in range(len(sp.keys))]
    assert bytes(assemble(sp.rest, pages)) == blob
    # a copy of the state, its pages as views into it (a state kept whole in RAM)
    copy = bytearray(blob)
    moved = sp.moved(copy)
    if moved is not None:
        assert [b"".join(parts) for parts in moved] == pages
        assert all(p.obj is copy for parts in moved for p in parts)
        assert bytes(assemble(sp.rest, list(moved))) == blob
    return sp, pages


@pytest.mark.parametrize("trans", [False, True])
@pytest.mark.parametrize("ext", [False, True])
def test_in_order_cells_page_whole_pages_and_keep_the_rest(trans: bool, ext: bool) -> None:
    rng = random.Random(1)
    n = 18  # 4 whole pages and 2 tokens
    blob = state(kv_section(list(range(n)), trans=trans, ext=ext, rng=rng),
                 tail=rng.randbytes(100))
    sp, pages = round_trip(blob, 1, n)
    assert len(sp.keys) == 4 and len(set(sp.keys)) == 4
    # pages of V stored transposed are gathered from every row: copies, not views
    assert (sp.moved(bytes(blob)) is None) == trans
    # what the pages hold is gone from the rest: the rest is the headers, the cells'
    # metadata (runs, unless the extension is there), the 2 last cells and the tail
    assert len(sp.rest) < len(blob) - sum(map(len, pages)) + 64
    assert rest_info(sp.rest).n_keys == 4 and rest_info(sp.rest).nbytes == len(blob)


def test_m_rope_cells_of_text_are_runs_given_the_tokens() -> None:
    # An M-RoPE model (qwen35) writes x, y and the token of every cell: for text, its
    # position twice and the prompt's token there. With the tokens, 24 bytes a cell
    # become 12 a run; without them, or for other cells, they are kept as written.
    rng = random.Random(9)
    n = 40
    text = [rng.randrange(1000) for _ in range(n)]
    blob = state(kv_section(list(range(n)), ext=True, text=text, rng=rng))
    toks = np.array(text, dtype="<i4")
    sp = split(blob, sections=1, page_size=P, chain=chain(n), tokens=toks)
    pages = [sp.page(i) for i in range(len(sp.keys))]
    assert bytes(assemble(sp.rest, pages, tokens=toks)) == blob
    with pytest.raises(BadState):
        assemble(sp.rest, pages)  # the tokens are part of the state
    other = toks.copy()
    other[5] += 1
    with pytest.raises(BadState):
        assemble(sp.rest, pages, tokens=other)
    plain = split(blob, sections=1, page_size=P, chain=chain(n))
    assert len(plain.rest) - len(sp.rest) == 24 * n - 12
    assert plain.keys == sp.keys


def test_pages_are_named_by_tokens_and_content_and_shared_by_longer_states() -> None:
    rng = random.Random(2)
    long = kv_section(list(range(16)), rng=rng)
    # the same first 12 cells' bytes, then other cells: cut out of the longer state
    blob_long = state(long)
    sp_long, _ = round_trip(blob_long, 1, 16)
    # A state after 12 tokens whose cells hold the same bytes as the first 12 above.
    arr = _cells(blob_long)
    short = _rebuild(arr, keep=12)
    sp_short, _ = round_trip(state(short), 1, 12)
    assert sp_short.keys == sp_long.keys[:3]
    # one byte of page 1 differs (another batch schedule): another page, the others shared
    arr2 = _cells(blob_long)
    arr2["k"][0][5, 0] ^= 1
    sp_other, _ = round_trip(state(_rebuild(arr2, keep=12)), 1, 12)
    assert sp_other.keys[0] == sp_short.keys[0] and sp_other.keys[2] == sp_short.keys[2]
    assert sp_other.keys[1] != sp_short.keys[1]


def test_cells_out_of_order_holes_and_repeats() -> None:
    rng = random.Random(3)
    n = 20
    order = list(range(n))
    rng.shuffle(order)  # a lane whose cells were reused out of order
    blob = state(kv_section(order, rng=rng))
    sp, _ = round_trip(blob, 1, n)
    assert len(sp.keys) == 5
    assert sp.moved(bytes(blob)) is None  # gathered in position order: copies
    # the page content is in position order: the same keys as the cells in order
    in_order = _sorted_by_pos(blob)
    assert round_trip(in_order, 1, n)[0].keys == sp.keys
    # a hole at 6 (page 1) and 9 twice (page 2): those pages stay in the rest
    holes = [p for p in range(n) if p != 6] + [9]
    sp, _ = round_trip(state(kv_section(holes, rng=rng)), 1, n)
    assert len(sp.keys) == 3


def test_two_sections_and_a_window() -> None:
    # iSWA: the base cache holds every position, the SWA cache the last ones only
    rng = random.Random(4)
    n = 30
    base = kv_section(list(range(n)), rng=rng)
    swa = kv_section(list(range(n - 10, n)), layers=3, rng=rng)
    blob = state(base, swa)
    sp, _ = round_trip(blob, 2, n)
    # 7 whole pages in the base; in the SWA cache positions 20..29: pages 5 and 6
    assert len(sp.keys) == 7 + 2
    assert sp.moved(bytes(blob)) is not None


def test_a_state_of_another_layout_is_kept_whole() -> None:
    rng = random.Random(5)
    for blob in (rng.randbytes(300), b"", state(b"\xff" * 40),
                 state(kv_section(list(range(8)), rng=rng))[:-7]):
        for sections in (0, 1, 2):
            sp = split(blob, sections=sections, page_size=P, chain=chain(8))
            assert sp.keys == ()
            assert bytes(assemble(sp.rest, [])) == blob
    # no whole page: no pages either, and the same bytes back
    sp, _ = round_trip(state(kv_section([0, 1, 2], rng=rng)), 1, 3)
    assert sp.keys == ()


def test_a_wrong_page_or_rest_is_refused() -> None:
    rng = random.Random(6)
    blob = state(kv_section(list(range(16)), rng=rng), tail=b"recurrent")
    sp, pages = round_trip(blob, 1, 16)
    with pytest.raises(BadState):
        assemble(sp.rest, [pages[1], pages[0], *pages[2:]])  # two pages swapped
    bad = bytearray(pages[2])
    bad[3] ^= 1
    with pytest.raises(BadState):
        assemble(sp.rest, [*pages[:2], bytes(bad), pages[3]])
    with pytest.raises(BadState):
        assemble(sp.rest, pages[:3])
    with pytest.raises(BadState):
        assemble(sp.rest[:-3], pages)
    rest = bytearray(sp.rest)
    rest[-1] ^= 1  # the tail
    with pytest.raises(BadState):
        assemble(bytes(rest), pages)
    whole = split(blob, sections=0, page_size=P, chain=())
    damaged = whole.rest[:-1] + bytes([whole.rest[-1] ^ 1])
    with pytest.raises(BadState):
        assemble(damaged, [])


# -- helpers that take a written state apart and put it together differently ----------


def _cells(blob: bytes) -> dict:  # type: ignore[type-arg]
    """The one stream of a one-section state written by kv_section (no ext, not
    transposed): positions, K and V rows per layer."""
    at = 8
    (n_stream,) = struct.unpack_from("<I", blob, at)
    at += 4
    for _ in range(n_stream):
        (cells,) = struct.unpack_from("<I", blob, at)
        at += 4
        if cells:
            break
    meta = np.frombuffer(blob, dtype="<i4", count=3 * cells, offset=at).reshape(cells, 3)
    at += 12 * cells
    _, layers = struct.unpack_from("<II", blob, at)
    at += 8
    out: dict = {"pos": meta[:, 0].copy(), "k": [], "v": []}  # type: ignore[type-arg]
    for name in ("k", "v"):
        for _ in range(layers):
            _, row = struct.unpack_from("<iQ", blob, at)
            at += 12
            out[name].append(np.frombuffer(blob, np.uint8, row * cells, at)
                             .reshape(cells, row).copy())
            at += row * cells
    return out


def _rebuild(arr: dict, keep: int) -> bytes:  # type: ignore[type-arg]
    cells = keep
    out = [struct.pack("<II", 2, 0), struct.pack("<I", cells)]
    for p in arr["pos"][:keep]:
        out.append(struct.pack("<iIi", int(p), 1, 1))
    out.append(struct.pack("<II", 0, len(arr["k"])))
    for rows in arr["k"]:
        out.append(struct.pack("<iQ", 1, rows.shape[1]) + rows[:keep].tobytes())
    for rows in arr["v"]:
        out.append(struct.pack("<iQ", 8, rows.shape[1]) + rows[:keep].tobytes())
    return b"".join(out)


def _sorted_by_pos(blob: bytes) -> bytes:
    arr = _cells(blob)
    order = np.argsort(arr["pos"])
    arr = {"pos": arr["pos"][order], "k": [r[order] for r in arr["k"]],
           "v": [r[order] for r in arr["v"]]}
    return state(_rebuild(arr, len(order)))


def test_which_cells_are_paged_for_runs_and_for_any_order() -> None:
    # A run of positions in order (a live lane, an SWA window) takes a shortcut; it must
    # page exactly what the general rule pages: the pages the chain has whose every
    # position one cell holds.
    from statecache.kvpages.layout import covered as _covered

    rnd = random.Random(11)
    for _ in range(300):
        start, length = rnd.randrange(0, 40), rnd.randrange(1, 60)
        chain_pages = rnd.randrange(0, 25)
        pos = np.arange(start, start + length, dtype=np.int32)
        if rnd.random() < 0.5:
            pos = pos[rnd.sample(range(length), length)]  # the same cells, shuffled
        whole, order, rest = _covered(pos, P, chain_pages)
        held = set(pos.tolist())
        want = [p for p in range(chain_pages) if all(q in held for q in range(p * P, p * P + P))]
        assert whole.tolist() == want
        assert sorted(pos[order].tolist()) == pos[order].tolist()  # position order
        assert sorted(pos[order].tolist()) == [q for p in want for q in range(p * P, p * P + P)]
        assert sorted(order.tolist() + rest.tolist()) == list(range(length))
        assert rest.tolist() == sorted(rest.tolist())  # the others in cell order


@pytest.mark.parametrize("sections", [1, 0])  # paged, and kept whole
def test_logits_ride_at_the_rest_end_and_leave_the_state_as_it_was(sections: int) -> None:
    # A checkpoint at a prompt's end keeps the last row's logits after the rest's
    # body: the state assembles to the same bytes, the logits come back bitwise.
    rng = random.Random(5)
    n = 18
    blob = state(kv_section(list(range(n)), rng=rng), tail=rng.randbytes(100))
    logits = np.random.default_rng(5).standard_normal(1000).astype(np.float32)
    plain = split(blob, sections=sections, page_size=P, chain=chain(n))
    sp = split(blob, sections=sections, page_size=P, chain=chain(n), logits=logits)
    assert len(sp.rest) == len(plain.rest) + 4 * len(logits)
    assert sp.keys == plain.keys
    pages = [sp.page(i) for i in range(len(sp.keys))]
    assert bytes(assemble(sp.rest, pages)) == blob
    got = rest_logits(sp.rest)
    assert got is not None and got.dtype == np.float32
    assert got.tobytes() == logits.tobytes()
    assert rest_logits(plain.rest) is None
    # a header that claims more logits than the rest holds is refused, not read past
    bad = bytearray(sp.rest)
    struct.pack_into("<I", bad, REST_HEAD_BYTES - 4, len(bad))
    with pytest.raises(BadState):
        rest_logits(bytes(bad))
    with pytest.raises(BadState):
        assemble(bytes(bad), pages)
    # a logit changed after the split changes no state byte: the tiers' checks of the
    # rest (the disk's and the store's MACs) are what cover them
    moved = bytearray(sp.rest)
    moved[-1] ^= 0x40
    assert bytes(assemble(bytes(moved), pages)) == blob


def test_a_rest_of_the_format_before_logits_is_not_read() -> None:
    # SCR1 rests had no logits field: read as a miss (BadState), never as another layout
    rng = random.Random(6)
    n = 10
    blob = state(kv_section(list(range(n)), rng=rng))
    sp = split(blob, sections=1, page_size=P, chain=chain(n))
    old = b"SCR1" + sp.rest[4:REST_HEAD_BYTES - 4] + sp.rest[REST_HEAD_BYTES:]
    with pytest.raises(BadState):
        assemble(old, [sp.page(i) for i in range(len(sp.keys))])
