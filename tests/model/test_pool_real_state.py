"""Real state bytes through the pool: save, spill to disk, a new process restores them
and gets bitwise-identical logits. A corrupt file on the way is a miss, never a state."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from proxy.engine.binding import FLAGS_FULL, Context, ContextParams, Model
from statecache.config import CacheConfig
from statecache.pool import CheckpointPool
from statecache.records import Kind, Owner, Role
from tests.busy import THREADS

pytestmark = pytest.mark.model

TEXT = "The pool keeps states on disk so that a restarted server still hits. " * 30

# Runs in a fresh interpreter: load the model, find the checkpoint on disk, restore it,
# decode the next token and write its logits.
CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    from proxy.engine.binding import FLAGS_FULL, Context, ContextParams, Model
    from statecache.config import CacheConfig
    from statecache.pool import CheckpointPool
    from statecache.records import Kind
    model_path, disk, out = sys.argv[1:4]
    cfg = CacheConfig(ram_budget=1 << 20, disk_path=disk, page_size=32,
                      secret_path=disk + ".key")
    params = ContextParams(n_ctx=8192, n_seq_max=2, threads=1)  # (tests/busy.py's THREADS)
    with Model(model_path) as m, Context(m, params) as ctx:
        pool = CheckpointPool(cfg, m.fingerprint)
        toks = m.tokenize(json.loads(sys.argv[4]))
        lease = pool.lookup(toks, pool.chain(toks), kind=Kind.FULL, max_n=len(toks) - 1)
        if lease is None:
            np.save(out, np.zeros(0, dtype=np.float32))
            sys.exit(0)
        with lease:
            assert lease.tier == "disk", lease.tier
            n = lease.record.n
            assert ctx.restore(1, lease.data, FLAGS_FULL)
        ctx.batch.clear()
        row = ctx.batch.add(1, [toks[n]], n, logits_last=True)
        ctx.decode()
        np.save(out, ctx.logits(row))
""")


def _save_to_disk(model_path: Path, disk: Path) -> tuple[np.ndarray, int]:
    """Prefill, publish a full checkpoint, force it to disk; the reference logits."""
    # The writer puts the FULL entry on disk; flush() waits for it (as close() does).
    cfg = CacheConfig(ram_budget=64 << 20, disk_path=str(disk), page_size=32,
                      secret_path=f"{disk}.key")
    params = ContextParams(n_ctx=8192, n_seq_max=2, threads=THREADS)
    with Model(model_path) as m, Context(m, params) as ctx:
        pool = CheckpointPool(cfg, m.fingerprint)
        toks = m.tokenize(TEXT)
        n = len(toks) - 1
        ctx.prefill(0, toks[:n], 0, logits_last=False)
        rec = pool.insert(kind=Kind.FULL, owner=Owner.TARGET, lane=None, tokens=toks[:n],
                          role=Role.REPLAY, data=ctx.save(0, FLAGS_FULL))
        assert rec is not None
        pool.flush()
        assert pool.get(rec.id)["tiers"] == ["ram", "disk"]  # type: ignore[index]
        pool.sanity_check()
        pool.close()
        ctx.batch.clear()
        row = ctx.batch.add(0, [toks[n]], n, logits_last=True)
        ctx.decode()
        return ctx.logits(row), n


def _child_logits(model_path: Path, disk: Path, tmp: Path) -> np.ndarray:
    out = tmp / "child.npy"
    subprocess.run([sys.executable, "-c", CHILD, str(model_path), str(disk), str(out),
                    json.dumps(TEXT)], check=True, cwd=Path(__file__).resolve().parents[2])
    return np.load(out)


@pytest.mark.parametrize("which", ["hybrid", "gemma"])
def test_state_survives_disk_and_a_new_process(
    which: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    model_path: Path = request.getfixturevalue(f"{which}_path")
    disk = tmp_path / "ckpt"
    ref, _ = _save_to_disk(model_path, disk)
    got = _child_logits(model_path, disk, tmp_path)
    assert got.shape == ref.shape
    assert np.array_equal(got, ref)


def test_corrupt_state_file_is_a_miss_in_the_new_process(
    hybrid_path: Path, tmp_path: Path
) -> None:
    disk = tmp_path / "ckpt"
    _save_to_disk(hybrid_path, disk)
    (path,) = disk.glob("*.ckpt")
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped bit in the state bytes
    path.write_bytes(bytes(data))
    got = _child_logits(hybrid_path, disk, tmp_path)
    assert got.size == 0  # a miss: nothing was restored
    assert list((disk / "quarantine").iterdir())
