"""/metrics names the engine's lane counters (executor._in_line, close_gap) as counters
with their own help, not as untyped leftovers."""

from __future__ import annotations

from proxy.api.metrics import format_metrics


def test_the_lane_counters_are_typed_counters() -> None:
    text = format_metrics({"lanes_kept_in_line": 3, "lane_copies": 1, "lane_moves": 2})
    for name, value in (("lanes_kept_in_line", 3), ("lane_copies", 1), ("lane_moves", 2)):
        assert f"# TYPE statecache_{name}_total counter" in text
        assert f"\nstatecache_{name}_total {value}\n" in text
    assert "untyped" not in text
