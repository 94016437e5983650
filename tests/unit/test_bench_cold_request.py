"""bench.cold_request's depth table: a step's time shared among the bands its tokens lie
in, and llama-server's prefill read back from its progress lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.cold_request import by_band, depth_table, llama_server_steps

_LINE = ("{t} I slot print_timing: id  1 | task {task} | prompt processing, n_tokens = {n:>6}, "
         "progress = 0.50, t = {s:>6} s / 400.00 tokens per second")
LOG = "\n".join([
    "1.15.688.361 I slot launch_slot_: id  1 | task 0 | processing task, is_child = 0",
    _LINE.format(t="1.19.353.444", task=0, n=1537, s="3.67"),
    _LINE.format(t="1.20.617.743", task=0, n=2049, s="4.93"),
    _LINE.format(t="2.22.446.832", task=0, n=2286, s="5.50"),
    _LINE.format(t="2.26.214.303", task=42, n=2338, s="0.50"),  # the next request
]) + "\n"


def test_llama_server_steps_are_read_from_its_progress_lines(tmp_path: Path) -> None:
    log = tmp_path / "llama-server.log"
    log.write_text(LOG)
    steps = llama_server_steps(log)
    # the first request's (task 0) only, each step from the line before it
    assert [(p, n) for p, n, _ in steps] == [(0, 1537), (1537, 512), (2049, 237)]
    assert [round(s, 2) for _, _, s in steps] == [3.67, 1.26, 0.57]


def test_a_step_across_bands_is_shared_by_its_tokens() -> None:
    bands = by_band([(0, 512, 1.0), (512, 512, 2.0), (1000, 100, 1.0)], 1024)
    assert bands[0] == pytest.approx(1.0 + 2.0 + 0.24)
    assert bands[1] == pytest.approx(0.76)
    assert sum(bands.values()) == pytest.approx(4.0)


def test_the_table_has_a_row_a_band_and_the_medians() -> None:
    runs = {"a": [{0: 1.0, 1: 2.0}, {0: 3.0, 1: 2.0}, {0: 2.0, 1: 5.0}], "b": [{0: 1.5}]}
    lines = depth_table(runs, 2048)
    assert lines[0] == "| steps starting at | a | b |"
    assert lines[2] == "| 0 | 2.00 | 1.50 |"
    assert lines[3] == "| 2,048 | 2.00 | 0.00 |"
    assert lines[4] == "| all | 5.00 | 1.50 |"
