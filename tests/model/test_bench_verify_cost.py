"""``bench.speculative.verify_cost``: what a verification costs a model, each size in a run
of its own and alternating with one-token steps (each step's graph built anew), and the
table that prints both."""

from __future__ import annotations

from pathlib import Path

from bench.speculative import table, verify_cost


def test_a_verification_is_timed_alone_and_between_steps_of_one(
        spec_llama_target_path: Path) -> None:
    rows = verify_cost(spec_llama_target_path, 0, (1, 3), 50)
    assert [r["tokens"] for r in rows] == [1, 3]
    one, three = rows
    assert "after_one_ms" not in one and one["ms"] > 0
    assert three["ms"] > 0 and three["after_one_ms"] > 0 and three["one_after_ms"] > 0
    lines = table({"targets": [], "checkpoints": [], "verify": rows})
    (printed,) = [line for line in lines if line.startswith(f"| {three['model']} | 50 | 3 |")]
    cells = [c.strip() for c in printed.strip("|").split("|")]
    assert cells[5] == f"{three['after_one_ms']:.1f}" and cells[6] == f"{three['one_after_ms']:.1f}"
    (first,) = [line for line in lines if line.startswith(f"| {one['model']} | 50 | 1 |")]
    assert first.rstrip().endswith("| - | - |")
