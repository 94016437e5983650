"""/metrics names the engine's lane counters (placement.in_line, close_gap) as counters
with their own help, not as untyped leftovers; the typed meter renders Prometheus' text
format without parsing names back."""

from __future__ import annotations

import pytest

from proxy.meter import Counter, Gauge, Histogram, render
from proxy.meters import EngineMeter, pool_families
from statecache.pool import Counts, PoolStats
from statecache.records import Role
from statecache.tiers.tier import StoreStats, TierStats


def test_the_lane_counters_are_typed_counters() -> None:
    m = EngineMeter()
    m.lanes_kept_in_line.inc(by=3)
    m.lane_copies.inc(by=1)
    m.lane_moves.inc(by=2)
    text = render(m.families())
    for name, value in (("lanes_kept_in_line", 3), ("lane_copies", 1), ("lane_moves", 2)):
        assert f"# TYPE statecache_{name}_total counter" in text
        assert f"\nstatecache_{name}_total {value}\n" in text
    assert "untyped" not in text


def test_families_render_with_their_labels_and_only_when_they_hold_samples() -> None:
    hits = Counter("x_hits_total", "Hits.", ["tier", "role"])
    hits.inc("ram", "branch")
    hits.inc("ram", "branch", by=2)
    hits.inc("disk", 'quo"te')
    idle = Gauge("x_idle", "Nothing yet.")
    lat = Histogram("x_seconds", "Latency.", [0.1, 1.0])
    lat.observe(0.05)
    lat.observe(3.0)
    text = render([hits, idle, lat])
    assert 'x_hits_total{tier="ram",role="branch"} 3' in text
    assert 'x_hits_total{tier="disk",role="quo\\"te"} 1' in text
    assert "x_idle" not in text  # no sample: not shown
    assert 'x_seconds_bucket{le="0.1"} 1\nx_seconds_bucket{le="1.0"} 1\n' \
           'x_seconds_bucket{le="+Inf"} 2\nx_seconds_sum 3.05\nx_seconds_count 2' in text
    with pytest.raises(ValueError, match="takes labels"):
        hits.inc("ram")


def test_the_pool_report_maps_by_its_fields() -> None:
    counts = Counts(inserts=7)
    counts.hit("ram", Role.END_OF_REPLY)
    counts.hit("ram")
    store = StoreStats(probes=4)
    store.refused("forged")
    stats = PoolStats(entries=0, kept_entries=0, pinned_bytes=0, whole_states=0,
                      whole_bytes=0, quarantined=0, write_queue=0, prefill_tps=0.0,
                      counts=counts, tiers=(
                          TierStats("ram", "RAM", hits=2, bytes=10),
                          TierStats("disk", "Disk", bandwidth=5.0),
                          TierStats("remote", "Shared store", store=store)))
    text = render(pool_families(stats))
    assert 'statecache_pool_hits_total{tier="ram"} 2' in text
    assert 'statecache_pool_hits_by_role_total{role="end_of_reply"} 1' in text
    assert 'statecache_checkpoint_bytes{tier="ram"} 10' in text
    assert 'statecache_remote_rejected_total{reason="forged"} 1' in text
    assert 'statecache_remote_total{event="probes"} 4' in text
    assert 'statecache_read_bandwidth_bytes_per_second{tier="disk"} 5.0' in text
    assert "# TYPE statecache_pool_inserts untyped\nstatecache_pool_inserts 7" in text
