"""bench.batching's paired ratios: each repeat's runs compared with each other, so a
machine that drifts between repeats moves both sides of a ratio alike."""

from __future__ import annotations

import pytest

from bench.batching import paired
from bench.report import _batching, _paired


def test_each_repeat_is_compared_with_itself() -> None:
    # the machine drifts between repeats (the binding's runs); statecache's run in each
    # repeat is this share of the binding's run beside it
    binding = [100.0, 80.0, 60.0, 90.0, 70.0]
    share = [0.90, 1.00, 0.96, 0.95, 0.97]
    runs = {"statecache": {"1": [b * r for b, r in zip(binding, share, strict=True)]},
            "binding": {"1": binding}}
    assert paired(runs, "statecache", "binding")["1"] == pytest.approx(
        {"median": 0.96, "low": 0.90, "high": 1.00})
    # the ratio of the medians takes statecache's median from one repeat and the
    # binding's from another: 80 / 80 here, where no repeat came out above 1.00
    med = sorted(runs["statecache"]["1"])[2] / sorted(binding)[2]
    assert med == pytest.approx(1.0)


def test_runs_of_different_lengths_are_a_bug_not_a_ratio() -> None:
    with pytest.raises(ValueError):
        paired({"a": {"1": [1.0, 2.0]}, "b": {"1": [1.0]}}, "a", "b")


def test_the_report_shows_the_paired_ratios_with_their_range() -> None:
    b = {"paired_statecache_binding": {"1": {"median": 0.953, "low": 0.91, "high": 0.99}},
         "paired_statecache_llama-server": {"4": {"median": 1.012, "low": 0.97, "high": 1.05}}}
    text = "\n".join(_paired(b))
    assert "0.953 (0.91–0.99)" in text and "1.012 (0.97–1.05)" in text
    assert _paired({}) == []


def test_a_quiet_p95_of_zero_is_no_ratio() -> None:
    # A model decoding far faster than the write interval: nearly every token comes in
    # the same write as the one before it, so the quiet p95 is 0 (the quick bench's
    # tiny hybrid with writes every 32 ms); the report says so instead of dividing
    itl = {"quiet_p50_ms": 0.0, "quiet_p95_ms": 0.0, "busy_p50_ms": 0.0, "busy_p95_ms": 9.0,
           "busy_p99_ms": 111.1, "busy_max_ms": 124.1, "long_prefill_s": 0.74,
           "busy_tokens": 280}
    peer = {"decode_tps": {"1": 1400.0, "2": 1900.0, "4": 2500.0},
            "scaling": {"1": 1.0, "2": 1.36, "4": 1.79}, "itl": itl,
            "short_behind_long": {"short_ttft_s": 0.07, "long_ttft_s": 0.5}}
    text = "\n".join(_batching({"model": "hybrid-tiny", "direct_decode_tps": 1500.0,
                                "statecache": peer}))
    assert "| p95 during / quiet p95 | n/a |" in text
    assert "more than 95 in 100 tokens came in the same write" in text
