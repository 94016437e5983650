"""The layout of llama.cpp's sequence states, pinned on real states of each memory kind:
cut into KV pages and put back, a state is the same bytes (docs/design.md, "The layout
of a sequence state"). A llama.cpp whose state writer lays states out otherwise fails
here first: its states would no longer be cut into the pages these tests count.

Plain attention (llama), sliding-window attention (Gemma 3: a base cache and an SWA
cache), hybrids (qwen35: attention before the Gated DeltaNet state; jamba: attention
before Mamba), with flash attention on (V stored as rows) and off (V transposed), with
f16 and q8_0 KV caches."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from proxy.engine.binding import FLAGS_FULL, Context, ContextParams, MemoryKind, Model
from statecache.kvpages import assemble, split
from statecache.pages import PageChain, namespace_hash
from tests.busy import THREADS

pytestmark = pytest.mark.model

P = 32
F16, Q8_0 = 1, 8
# (flash attention, K type, V type): a quantized V needs flash attention
KV = {"fa-f16": (1, F16, F16), "nofa-f16": (0, F16, F16), "fa-q8": (1, Q8_0, Q8_0),
      "nofa-q8k": (0, Q8_0, F16)}
TEXT = ("A conversation's KV is stored once, not once per checkpoint; pages of it are "
        "shared by every checkpoint that holds them. ") * 30


@pytest.fixture(scope="module", params=["draft", "gemma", "hybrid", "norollback"])
def model(request: pytest.FixtureRequest) -> Iterator[Model]:
    path: Path = request.getfixturevalue(f"{request.param}_path")
    with Model(path) as m:
        yield m


def _expected_pages(kind: MemoryKind, n: int, window: int) -> int:
    whole = n // P
    if kind is not MemoryKind.SWA:
        return whole
    # the SWA cache writes the cells within the window of the last position
    first = max(0, n - window)
    return whole + sum(1 for p in range(whole) if p * P >= first)


@pytest.mark.parametrize("kv", list(KV))
def test_split_and_assemble_give_the_same_bytes(model: Model, kv: str) -> None:
    fa, tk, tv = KV[kv]
    params = ContextParams(n_ctx=2048, n_seq_max=2, n_batch=512, n_ubatch=512,
                           flash_attn=fa, type_k=tk, type_v=tv, threads=THREADS)
    with Context(model, params) as ctx:
        mem = ctx.describe_memory()
        toks = model.tokenize(TEXT)
        n = min(len(toks), 700 if mem.kind is MemoryKind.SWA else 300) - 5
        hashes = PageChain(namespace_hash(model.fingerprint, ""), P, toks[:n]).hashes
        ctx.prefill(1, toks[:n], 0, logits_last=False)
        blob = bytes(ctx.save(1, FLAGS_FULL))
        arr = np.array(toks[:n], dtype="<i4")
        sp = split(blob, sections=mem.kv_sections, page_size=P, chain=hashes, tokens=arr)
        pages = [sp.page(i) for i in range(len(sp.keys))]
        assert len(sp.keys) == _expected_pages(mem.kind, n, mem.n_swa), mem.kind
        assert bytes(assemble(sp.rest, pages, tokens=arr)) == blob
        # kept whole in RAM: the pages are views into a copy of the state (not where V
        # is stored transposed, without flash attention: those are gathered, copies)
        copy = bytearray(blob)
        moved = sp.moved(copy)
        assert (moved is None) == (fa == 0 and mem.kind is not MemoryKind.RECURRENT), kv
        if moved is not None:
            assert [b"".join(parts) for parts in moved] == pages
            assert bytes(assemble(sp.rest, list(moved), tokens=arr)) == blob
        # the rest is the cells' metadata as runs, the last partial page, the recurrent
        # part: with the pages, no byte stored twice
        assert len(sp.rest) + sum(map(len, pages)) < len(blob) + 400
        # no byte a token in the rest beyond the last partial page: the cells' metadata
        # (with qwen35's M-RoPE extension: position, x, y, token) is a run
        partial = 2 * max(map(len, pages)) * mem.kv_sections  # a window has two ends
        assert len(sp.rest) < partial + mem.bytes_per_lane + 1024, (len(sp.rest), partial)


def test_longer_states_share_their_pages_and_restore_exactly(model: Model) -> None:
    params = ContextParams(n_ctx=2048, n_seq_max=2, n_batch=512, n_ubatch=512,
                           threads=THREADS)
    with Context(model, params) as ctx:
        mem = ctx.describe_memory()
        toks = model.tokenize(TEXT)
        ns = namespace_hash(model.fingerprint, "")
        n1, n2 = 150, 260
        ctx.prefill(1, toks[:n1], 0, logits_last=False)
        first = split(bytes(ctx.save(1, FLAGS_FULL)), sections=mem.kv_sections, page_size=P,
                      chain=PageChain(ns, P, toks[:n1]).hashes)
        ctx.prefill(1, toks[n1:n2], n1, logits_last=False)
        blob = bytes(ctx.save(1, FLAGS_FULL))
        second = split(blob, sections=mem.kv_sections, page_size=P,
                       chain=PageChain(ns, P, toks[:n2]).hashes)
        base = n1 // P  # the base cache's pages of the first state
        assert second.keys[:base] == first.keys[:base]
        assert len(set(second.keys) - set(first.keys)) >= n2 // P - base
        # the pages of the first state and the second's own, assembled, into another lane
        store = {k: first.page(i) for i, k in enumerate(first.keys)}
        pages = [store.get(k) or second.page(i) for i, k in enumerate(second.keys)]
        data = assemble(second.rest, pages)
        assert ctx.restore(0, data, FLAGS_FULL)
        logits = []
        for lane in (1, 0):
            ctx.batch.clear()
            row = ctx.batch.add(lane, [toks[n2]], n2, logits_last=True)
            ctx.decode()
            logits.append(ctx.logits(row))
        # fact 6: a FULL state moves between lanes exactly; assembled from pages too
        assert np.array_equal(logits[0], logits[1])
