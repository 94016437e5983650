"""The seam of the tiers behind the local ones (statecache/tiers/tier.py ``Store``): a
store of the tests' own, in memory and slow (1 MB/s until measured), that the pool is
given beside RAM and disk. Nothing in the pool, the planner or /metrics names it: the
pool shares new states with it, offers what it holds, reads one back when the planner
finds that fetching beats prefilling, and reports it as it reports every tier."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from proxy.engine.binding import MemoryInfo, MemoryKind
from proxy.engine.lanes import Lane
from proxy.engine.planner import Source, make_plan
from proxy.meter import render
from proxy.meters import pool_families
from statecache.buffers import Buffer
from statecache.config import CacheConfig
from statecache.pages import PageChain, PageHash
from statecache.pool import CheckpointPool
from statecache.records import CheckpointRecord
from statecache.tiers.tier import LocalPages, PageSource, TierStats
from tests.unit.conftest import FP, Clock, put

T = list(range(1, 201))  # 50 pages of 4
STATE = bytes(range(256)) * 4096  # 1 MiB
MEM = MemoryInfo(kind=MemoryKind.ATTENTION, n_swa=0, seq_rm_rollback=True, rs_rollback=False,
                 n_rs_seq=0, bytes_per_token=1, bytes_per_lane=0, partial_bytes_per_token=0,
                 partial_bytes_per_lane=0)


@dataclass(slots=True, frozen=True)
class SlowHit:
    entry_id: str
    n: int
    nbytes: int


class SlowStore:
    """FULL states kept in a dict, found by the hash of their last whole page."""

    name = "slow"
    label = "Slow store"
    prior_bandwidth: float | None = 1e6  # bytes/s

    def __init__(self) -> None:
        self.states: dict[str, tuple[CheckpointRecord, bytes, tuple[bytes, ...]]] = {}
        self.by_page: dict[PageHash, set[str]] = {}
        self.fetched = 0
        self.pages_local = 0

    @property
    def status(self) -> str:
        return "ok"

    def put(self, rec: CheckpointRecord, rest: bytes, page: PageSource | None = None
            ) -> None:
        if rec.id not in self.states and rec.page_hashes:
            pages = tuple(page(i) for i in range(len(rec.page_keys))) if page else ()
            self.states[rec.id] = (rec, rest, pages)
            self.by_page.setdefault(rec.page_hashes[-1], set()).add(rec.id)

    def probe(self, chain: PageChain, *, min_n: int, max_n: int) -> list[SlowHit]:
        hits = [SlowHit(i, rec.n, rec.nbytes)
                for h in chain.hashes for i in self.by_page.get(h, ())
                for rec in (self.states[i][0],) if min_n < rec.n <= max_n]
        return sorted(hits, key=lambda hit: hit.n, reverse=True)

    def fetch(self, hit: Any, tokens: Any, tenant: str, local: LocalPages | None = None
              ) -> tuple[CheckpointRecord, Buffer, list[Buffer]] | None:
        rec, rest, pages = self.states[hit.entry_id]
        if rec.tenant != tenant or not rec.matches(tokens):
            return None
        have = local(rec.page_keys) if local is not None else {}
        self.fetched += 1
        self.pages_local += len(have)
        return rec, rest, [have.get(i, p) for i, p in enumerate(pages)]

    def stats(self) -> TierStats:
        return TierStats(self.name, self.label, entries=len(self.states),
                         bytes=sum(len(r) + sum(map(len, p)) for _, r, p in self.states.values()))

    def sanity_check(self) -> None:
        if {i for ids in self.by_page.values() for i in ids} != set(self.states):
            raise RuntimeError("slow store: its index names other states than it holds")

    def close(self) -> None:
        pass


@pytest.fixture
def pools(tmp_path: Path) -> Iterator[Any]:
    made: list[CheckpointPool] = []

    def make(store: SlowStore, name: str, *, disk: bool = False,
             kv_sections: int = 0) -> CheckpointPool:
        cfg = CacheConfig(page_size=4, ram_budget=4 << 20, disk_path=str(tmp_path / name),
                          disk_budget=1 << 24, disk_enabled=disk,
                          secret_path=str(tmp_path / "keys" / "secret.key"))
        pool = CheckpointPool(cfg, FP, clock=Clock(), kv_sections=kv_sections, stores=[store])
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.sanity_check()
        pool.close()


def _plan(pool: CheckpointPool) -> Any:
    prompt = np.asarray(T, dtype=np.int32)
    return make_plan(prompt, pool.chain(prompt), [Lane(0)], tenant="", memory=MEM, pool=pool,
                     pos_min=lambda _: 0)


def test_a_store_the_pool_is_given_gets_its_states_and_serves_another_pool(pools: Any) -> None:
    slow = SlowStore()
    a = pools(slow, "a", disk=True)
    rec = put(a, T[:160], STATE)
    assert list(slow.states) == [rec.id]  # shared as it was stored
    b = pools(slow, "b")  # its own RAM, no disk: only the store holds the state
    offers = b.full_offers(T, b.chain(T), max_n=199)
    assert [(o.tier, o.n, o.nbytes, o.read) for o in offers] == [("slow", 160, len(STATE), True)]
    lease = b.take(offers[0], T, b.chain(T))
    assert lease is not None and (lease.tier, lease.record.n) == ("slow", 160)
    assert bytes(lease.data) == STATE
    lease.close()
    # it joined B's RAM as B's own entry: the next offer is local, and B sends nothing back
    assert [o.tier for o in b.full_offers(T, b.chain(T), max_n=199)] == ["ram"]
    s = b.stats()
    assert [t.name for t in s.tiers] == ["ram", "slow"]
    assert (s.tier("slow").hits, s.tier("slow").entries, s.tier("ram").entries) == (1, 1, 1)
    assert s.tier("slow").bandwidth is not None and s.tier("slow").bandwidth > 0  # measured
    # the store finds states by their pages: one whose tokens after its last whole page
    # are not the prompt's is refused, never served, and the next offer is taken
    put(a, T[:162], STATE[::-1])
    twisted = T[:161] + [999] + T[162:]
    c = pools(slow, "c")
    offers = c.full_offers(twisted, c.chain(twisted), max_n=199)
    assert [(o.tier, o.n) for o in offers] == [("slow", 162), ("slow", 160)]
    assert c.take(offers[0], twisted, c.chain(twisted)) is None
    assert c.stats().counts.store_misses == 1
    lease = c.take(offers[1], twisted, c.chain(twisted))
    assert lease is not None and bytes(lease.data) == STATE
    lease.close()


def test_the_planner_reads_the_store_only_when_fetching_beats_prefilling(pools: Any) -> None:
    slow = SlowStore()
    put(pools(slow, "a"), T[:160], STATE)
    b = pools(slow, "b")
    # 1 MiB at its prior 1 MB/s (about 1 s) against 160 tokens at 1,000 tokens/s (0.16 s)
    plan = _plan(b)
    assert (plan.source, plan.reuse, slow.fetched) == (Source.COLD, 0, 0)
    plan.release()
    b.costs.note_read("slow", 1 << 20, 0.001)  # measured: 1 GB/s
    plan = _plan(b)
    assert (plan.source, plan.reuse, slow.fetched) == ("slow", 160, 1)
    assert plan.estimate.startswith("est. slow ")
    assert plan.full is not None and bytes(plan.full.data) == STATE
    plan.release()


def test_metrics_report_the_store_as_any_tier(pools: Any) -> None:
    slow = SlowStore()
    put(pools(slow, "a"), T[:160], STATE)
    b = pools(slow, "b")
    lease = b.take(b.full_offers(T, b.chain(T), max_n=199)[0], T, b.chain(T))
    assert lease is not None
    lease.close()
    text = render(pool_families(b.stats()))
    assert 'statecache_pool_hits_total{tier="slow"} 1' in text
    assert 'statecache_checkpoints{tier="slow"} 1' in text
    assert 'statecache_read_bandwidth_bytes_per_second{tier="slow"}' in text
    assert "statecache_remote_up" not in text  # a store without the shared tier's traffic
