"""bench.batching's paired ratios: each repeat's runs compared with each other, so a
machine that drifts between repeats moves both sides of a ratio alike."""

from __future__ import annotations

import pytest

from bench.batching import paired
from bench.report import _paired


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
