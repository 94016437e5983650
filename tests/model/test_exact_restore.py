"""Restores proven exact, whatever the arithmetic (docs/design.md, "Exact restores").

Each memory kind, each tier: a FULL state saved after ``n`` tokens goes through the pool
into RAM (kept whole), RAM as KV pages (assembled from another checkpoint's pages),
the disk (a new pool over its files) and the shared store (a real valkey-server, a new
pool without a disk), comes back, is restored into the lane it was saved from, and
then takes the same tokens in the same batches as a lane that prefilled the same
prompt and never saved. The logits of every row must be those of that lane bit for
bit, and the state saved again at once the bytes saved. A hybrid's PARTIAL state
(the target's and a draft model's) is restored in its lane after the lane went on
past ``n``, then cut back (fact 7), and must give the same.

No tolerance anywhere, so a rounding of any backend cannot pass a wrong state; and
only a wrong state can fail: the same batches over the same cells are the same sums
on a deterministic backend, which ``test_the_same_batches_give_the_same_logits`` (the
run repeated in another lane) checks on the backend at hand.
``test_a_spoiled_restore_is_caught`` shows that one byte changed in a restored KV page,
or in a recurrent part, fails both checks.

Gemma 3 past its 512-token window: a restored state holds only the window's SWA
cells (fact 12), at other cells of the lane than the live lane's. Against the
live lane the sums are the same only where the backend adds the visible cells in
one order wherever they sit (one CPU thread: ``ON_ONE_CPU_THREAD``); on every backend
a state from each tier equals the state llama.cpp wrote restored straight into a
fresh context's lane: the same cells, the same sums.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from proxy.engine.binding import (
    FLAGS_PARTIAL,
    Context,
    ContextParams,
    MemoryInfo,
    MemoryKind,
    Model,
    gpu_offload,
)
from statecache.config import CacheConfig, RemoteConfig
from statecache.pool import CheckpointPool
from statecache.pool.lease import Lease
from statecache.records import Kind, Owner, Role
from tests.busy import THREADS
from tests.model.exact import (
    PAGE,
    Outcome,
    Schedule,
    chunks,
    differences,
    feed,
    flip_page_byte,
    flip_recurrent_byte,
    restore_and_go_on,
)
from tests.store import Store

pytestmark = pytest.mark.model

TEXT = " ".join(f"Note {i}: the state after {i * 11} tokens is the state the cold run "
                f"reaches, byte for byte, in lane {i % 5}." for i in range(120))
REF, LANE, SPARE = 0, 1, 2  # the run that never saves, the one that saves and restores
# where the cells' order alone decides the sums (docs/design.md, "Exact restores")
ON_ONE_CPU_THREAD = THREADS == 1 and not gpu_offload()
TIERS = ("ram", "pages", "disk", "remote")
MODELS = {"smollm2": 301, "llama": 301, "gemma": 301, "gemma-past-window": 600,
          "gemma-window": 301, "gemma-window-past-window": 600, "qwen35": 301, "jamba": 301}
PATHS = {"smollm2": "smollm2_path", "llama": "draft_path", "gemma": "gemma_path",
         "gemma-past-window": "gemma_path", "gemma-window": "gemma_path",
         "gemma-window-past-window": "gemma_path", "qwen35": "hybrid_path",
         "jamba": "norollback_path"}
# Gemma 3 with a window-sized SWA cache (model.swa_full = false, docs/design.md fact 25):
# its states page the base cache alone (kv_sections 1)
WINDOW = ("gemma-window", "gemma-window-past-window")


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Store]:
    s = Store(tmp_path_factory.mktemp("store")).start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    from proxy.models import smollm2_path

    return smollm2_path()


@pytest.fixture(scope="module")
def models(request: pytest.FixtureRequest) -> Iterator[dict[str, Model]]:
    """Each model loaded once for the module, by its path fixture's name."""
    loaded: dict[str, Model] = {}
    yield loaded
    for m in loaded.values():
        m.close()


def _model(request: pytest.FixtureRequest, models: dict[str, Model], fixture: str) -> Model:
    if fixture not in models:
        models[fixture] = Model(request.getfixturevalue(fixture))
    return models[fixture]


@dataclass
class Case:
    """One model's runs: the reference, the saved state and what each tier gave back."""

    model: Model
    ctx: Context
    mem: MemoryInfo
    toks: list[int]
    sched: Schedule
    saved: bytes  # FULL, after sched.n tokens, from lane LANE
    last: np.ndarray  # the reference's logits after sched.n tokens
    ref: np.ndarray  # the reference's logits over the continuation
    control: np.ndarray  # the same run again in another lane, never saved either
    got: dict[str, tuple[bytes, np.ndarray | None]] = field(default_factory=dict)


def _pool(tmp: Path, mem: MemoryInfo, fp: str, store: Store, *, disk: bool = True,
          remote: bool = True) -> CheckpointPool:
    """A pool over ``tmp``'s disk and key, on ``store`` under a prefix of its own."""
    rc = RemoteConfig(url=store.url if remote else "", prefix=f"exact-{tmp.name}",
                      timeout=5.0)
    cfg = CacheConfig(ram_budget=96 << 20, disk_path=str(tmp / "disk"), page_size=PAGE,
                      disk_enabled=disk, secret_path=str(tmp / "secret.key"), remote=rc)
    return CheckpointPool(cfg, fp, kv_sections=mem.kv_sections)


def _through_tiers(c: Case, tmp: Path, store: Store) -> None:
    """Store ``c.saved`` (lane LANE holds it) and read it back from each tier into
    ``c.got``."""
    fp, toks, n = c.model.fingerprint, c.toks, c.sched.n

    def keep(tier: str, lease: Lease | None) -> None:
        assert lease is not None, f"{tier}: a miss"
        with lease:
            assert lease.tier == ("ram" if tier == "pages" else tier)
            assert lease.record.n == n
            c.got[tier] = (bytes(lease.data), lease.logits)

    # RAM, the state kept whole, given as the engine gives it (save_into, handed over)
    a = _pool(tmp, c.mem, fp, store)
    buf = a.state_buffer(c.ctx.state_size(LANE))
    c.ctx.save_into(LANE, buf)
    assert bytes(buf) == c.saved
    rec = a.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=toks[:n],
                   role=Role.REPLAY, data=buf, logits=c.last, owned=a.keeps_whole)
    assert rec is not None
    assert a.get(rec.id).get("whole")  # type: ignore[union-attr]
    chain = a.chain(toks[:n + 1])
    keep("ram", a.lookup(toks[:n + 1], chain, max_n=n))
    # the lane goes on to a deeper checkpoint, which shares this one's pages
    n2 = -(-n // PAGE) * PAGE  # the next page's end: within Gemma's window of n
    feed(c.ctx, LANE, toks[n:n2], n, (n2 - n,), every_row=False)
    deeper = bytes(c.ctx.save(LANE))
    a.flush()
    assert a.remote is not None and a.remote.flush(30)
    a.close()
    # disk: a new pool over the files, nothing in its RAM
    b = _pool(tmp, c.mem, fp, store, remote=False)
    keep("disk", b.lookup(toks[:n + 1], b.chain(toks[:n + 1]), max_n=n))
    b.close()
    # the shared store: a pool of its own without a disk
    r = _pool(tmp, c.mem, fp, store, disk=False)
    offers = [o for o in r.full_offers(toks[:n + 1], r.chain(toks[:n + 1]), max_n=n)
              if o.tier == "remote"]
    assert [o.n for o in offers] == [n]
    keep("remote", r.take(offers[0], toks[:n + 1], r.chain(toks[:n + 1])))
    r.close()
    # RAM as pages: a deeper checkpoint of the same prompt is stored first; this one's
    # pages are its pages, and a lookup assembles them with this one's rest
    p = _pool(tmp, c.mem, fp, store, disk=False, remote=False)
    assert p.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=toks[:n2],
                    role=Role.PERIODIC, data=deeper) is not None
    rec = p.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=toks[:n],
                   role=Role.REPLAY, data=c.saved, logits=c.last)
    assert rec is not None and not p.get(rec.id).get("whole")  # type: ignore[union-attr]
    keep("pages", p.lookup(toks[:n + 1], p.chain(toks[:n + 1]), max_n=n))
    p.sanity_check()
    p.close()


@pytest.fixture(scope="module", params=list(MODELS))
def case(request: pytest.FixtureRequest, store: Store, models: dict[str, Model],
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Case]:
    name: str = request.param
    model = _model(request, models, PATHS[name])
    n = MODELS[name]
    with Context(model, ContextParams(
            n_ctx=1024 * 3, n_seq_max=3, n_batch=512, n_ubatch=512, threads=THREADS,
            swa_full=name not in WINDOW)) as ctx:
        mem = ctx.describe_memory(SPARE)
        assert mem.swa_window == (name in WINDOW)
        assert mem.kv_sections == 1 or name not in WINDOW
        sched = Schedule(chunks(n, 128))
        toks = model.tokenize(TEXT)
        assert len(toks) > sched.end + PAGE
        # the run that never saves
        last = feed(ctx, REF, toks[:n], 0, sched.prefix, every_row=False)[0]
        ref = feed(ctx, REF, toks[n:sched.end], n, sched.tail, every_row=True)
        feed(ctx, SPARE, toks[:n], 0, sched.prefix, every_row=False)
        control = feed(ctx, SPARE, toks[n:sched.end], n, sched.tail, every_row=True)
        ctx.clear_lane(SPARE)
        # the run that saves: the same batches
        feed(ctx, LANE, toks[:n], 0, sched.prefix, every_row=False)
        saved = bytes(ctx.save(LANE))
        c = Case(model, ctx, mem, toks, sched, saved, last, ref, control)
        _through_tiers(c, tmp_path_factory.mktemp(name), store)
        yield c


def _past_window(c: Case) -> bool:
    return c.mem.kind is MemoryKind.SWA and c.sched.n > c.mem.n_swa


def _expected(c: Case) -> np.ndarray:
    """The rows a restore of ``c.saved`` must give: the run that never saved, or past
    Gemma's window on a backend where the cells' places change the sums, the state
    llama.cpp wrote restored straight into a fresh context's lane."""
    if not _past_window(c) or ON_ONE_CPU_THREAD:
        return c.ref
    with Context(c.model, c.ctx.params) as fresh:
        return restore_and_go_on(fresh, LANE, c.saved, c.toks, c.sched).rows


def test_the_same_batches_give_the_same_logits(case: Case) -> None:
    """The control: the backend computes the same batches on the same cells to the same
    bits (in another lane), which is what lets a restore's difference name a defect. If
    this fails, the backend is not deterministic and the tests below tell nothing."""
    assert np.array_equal(case.control, case.ref)


@pytest.mark.parametrize("tier", TIERS)
def test_a_restored_state_is_the_state_saved(case: Case, tier: str) -> None:
    data, logits = case.got[tier]
    assert data == case.saved  # what the tier gave back
    # the last row's logits kept with it are the reference's (fact 22)
    assert logits is not None and np.array_equal(logits, case.last)
    got = restore_and_go_on(case.ctx, LANE, data, case.toks, case.sched)
    if _past_window(case):  # fewer SWA cells than the live lane (fact 12)
        assert case.ctx.pos_min(LANE) > 0 == case.ctx.pos_min(REF)
    assert differences(case.saved, _expected(case), got) == []


def test_a_spoiled_restore_is_caught(case: Case) -> None:
    """One byte changed in a restored KV page, or in a hybrid's recurrent part, after the
    pool's checks: both checks fail, each on its own."""
    c = case
    spoiled = {"page": flip_page_byte(c.saved, sections=c.mem.kv_sections,
                                      tokens=c.toks[:c.sched.n], fingerprint=c.model.fingerprint)}
    if c.mem.kind is MemoryKind.HYBRID:
        spoiled["recurrent"] = flip_recurrent_byte(c.saved, sections=c.mem.kv_sections)
    expected = _expected(c)
    for where, data in spoiled.items():
        got = restore_and_go_on(c.ctx, LANE, data, c.toks, c.sched)
        found = differences(c.saved, expected, got)
        assert [d.split()[0] for d in found] == ["saved", "logits"], (where, found)
        # the logits alone tell it: llama.cpp saves back the byte it was given
        assert differences(data, expected, got) == [found[1]], where


@pytest.mark.parametrize("which", ["qwen35", "jamba", "qwen35-draft", "jamba-draft"])
def test_a_partial_state_restored_in_its_lane_is_exact(
    which: str, request: pytest.FixtureRequest, store: Store, models: dict[str, Model]
) -> None:
    """A hybrid's PARTIAL state from RAM (the only tier that keeps one: it is valid only
    beside its lane's attention cells), restored after the lane went on past it, then
    cut back: the target's, and a draft model's (Owner.DRAFT, as drafting.py keeps)."""
    fixture = {"qwen35": "hybrid_path", "jamba": "norollback_path",
               "qwen35-draft": "spec_draft_path", "jamba-draft": "spec_jamba_draft_path"}
    model = _model(request, models, fixture[which])
    owner = Owner.DRAFT if which.endswith("draft") else Owner.TARGET
    n = 301
    sched = Schedule(chunks(n, 128))
    tmp = request.getfixturevalue("tmp_path")
    with Context(model, ContextParams(n_ctx=1024 * 3, n_seq_max=3, n_batch=512, n_ubatch=512,
                                      threads=THREADS)) as ctx:
        mem = ctx.describe_memory(SPARE)
        assert mem.kind is MemoryKind.HYBRID
        toks = model.tokenize(TEXT)
        feed(ctx, REF, toks[:n], 0, sched.prefix, every_row=False)
        ref = feed(ctx, REF, toks[n:sched.end], n, sched.tail, every_row=True)
        feed(ctx, LANE, toks[:n], 0, sched.prefix, every_row=False)
        saved = bytes(ctx.save(LANE, FLAGS_PARTIAL))
        pool = _pool(tmp, mem, model.fingerprint, store, disk=False, remote=False)
        assert pool.insert(kind=Kind.PARTIAL, owner=owner, lane=LANE, tokens=toks[:n],
                           role=Role.REPLAY, data=saved) is not None
        # the lane goes on: drafts that were rejected, say
        feed(ctx, LANE, toks[n + 7:n + 12], n, (5,), every_row=False)
        got = _partial_from_ram(ctx, pool, toks, n, sched, owner)
        pool.close()
        assert differences(saved, ref, got) == []
        # spoiled: one byte of the recurrent part (a PARTIAL state is nothing else)
        bad = bytearray(saved)
        bad[len(bad) - 1024 + 3] ^= 0x01
        got = restore_and_go_on(ctx, LANE, bytes(bad), toks, sched, flags=FLAGS_PARTIAL,
                                cut=True)
        assert len(differences(saved, ref, got)) == 2


def _partial_from_ram(ctx: Context, pool: CheckpointPool, toks: list[int], n: int,
                      sched: Schedule, owner: Owner) -> Outcome:
    """The lane's PARTIAL state at ``n``, found in RAM, restored into the lane, which is
    then cut back and fed the schedule's tail."""
    lease = pool.lookup(toks[:n + 1], pool.chain(toks[:n + 1]), kind=Kind.PARTIAL,
                        owner=owner, lane=LANE, max_n=n)
    assert lease is not None and lease.tier == "ram"
    with lease:
        return restore_and_go_on(ctx, LANE, lease.data, toks, sched, flags=FLAGS_PARTIAL,
                                 cut=True)


@pytest.mark.parametrize("which", ["smollm2", "llama", "gemma"])
def test_a_lane_rolled_back_over_a_reply_is_the_lane_that_never_held_it(
    which: str, request: pytest.FixtureRequest, models: dict[str, Model]
) -> None:
    """A reply the API drops (a tool call the token limit cut) is rolled back with
    ``seq_rm``; the next turn's prefill then gives, bit for bit, the logits of a lane
    that never held the reply, fed the same batches. Gemma 3 at tests/http/
    test_inner_system.py's lengths: 427 tokens, a reply of 1 + 6 tokens (a drafted
    verification), 32 new tokens (docs/design.md, "Exact restores")."""
    model = _model(request, models, PATHS[which])
    n, new = 427, 32
    with Context(model, ContextParams(n_ctx=1024 * 2, n_seq_max=2, n_batch=512, n_ubatch=512,
                                      threads=THREADS)) as ctx:
        toks = model.tokenize(TEXT)
        rest = toks[n:n + new] + toks[n + 100:n + 104]
        tail = (new, 1, 1, 2)
        feed(ctx, REF, toks[:n], 0, (n,), every_row=False)
        ref = feed(ctx, REF, rest, n, tail, every_row=True)
        feed(ctx, LANE, toks[:n], 0, (n,), every_row=False)
        feed(ctx, LANE, toks[n + 50:n + 57], n, (1, 6), every_row=True)  # the dropped reply
        assert ctx.seq_rm(LANE, n, -1)
        got = feed(ctx, LANE, rest, n, tail, every_row=True)
    assert np.array_equal(got, ref)


def test_a_window_partial_state_restored_past_the_window_is_exact(
    request: pytest.FixtureRequest, store: Store, models: dict[str, Model]
) -> None:
    """Gemma 3 with a window-sized SWA cache (docs/design.md fact 25): its PARTIAL state
    (the SWA cache alone) from RAM, restored after the lane went 700 tokens on (past the
    window: the cells the state's position needs were overwritten), then cut back, gives
    bit for bit what a lane restored from the FULL state saved at the same point gives,
    and saved again the bytes saved. One byte spoiled in it fails both checks."""
    model = _model(request, models, "gemma_path")
    n, on = 600, 700
    sched = Schedule(chunks(n, 128))
    tmp = request.getfixturevalue("tmp_path")
    with Context(model, ContextParams(n_ctx=2048 * 3, n_seq_max=3, n_batch=512, n_ubatch=512,
                                      threads=THREADS, swa_full=False)) as ctx:
        mem = ctx.describe_memory(SPARE)
        assert mem.swa_window and mem.partial_rollback
        toks = model.tokenize(TEXT)
        assert len(toks) > n + on
        feed(ctx, LANE, toks[:n], 0, sched.prefix, every_row=False)
        saved = bytes(ctx.save(LANE, FLAGS_PARTIAL))
        full = bytes(ctx.save(LANE))
        ref = restore_and_go_on(ctx, REF, full, toks, sched).rows
        pool = _pool(tmp, mem, model.fingerprint, store, disk=False, remote=False)
        assert pool.insert(kind=Kind.PARTIAL, owner=Owner.TARGET, lane=LANE, tokens=toks[:n],
                           role=Role.REPLAY, data=saved) is not None
        feed(ctx, LANE, toks[n:n + on], n, chunks(on, 128), every_row=False)
        assert ctx.pos_min(LANE) > n - mem.n_swa  # seq_rm alone cannot go back to n
        got = _partial_from_ram(ctx, pool, toks, n, sched, Owner.TARGET)
        pool.close()
        assert differences(saved, ref, got) == []
        bad = bytearray(saved)
        bad[len(bad) - 1024 + 3] ^= 0x01  # a V row of the SWA cache's last layer
        assert ctx.seq_rm(LANE, n, -1)
        feed(ctx, LANE, toks[n:n + on], n, chunks(on, 128), every_row=False)
        got = restore_and_go_on(ctx, LANE, bytes(bad), toks, sched, flags=FLAGS_PARTIAL,
                                cut=True)
        assert len(differences(saved, ref, got)) == 2
