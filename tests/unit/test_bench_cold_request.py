"""bench.cold_request's depth table: a step's time shared among the bands its tokens lie
in, and llama-server's prefill read back from its progress lines."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.cold_request import (
    by_band,
    depth_table,
    llama_server_steps,
    pooled_pairs,
    split_at,
    with_line,
)
from bench.replay import STATECACHE_CONFIG, Sent

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


def _sent(body: dict[str, object]) -> Sent:
    raw = json.dumps(body).encode()
    return Sent(0, "cold", "cold", "POST", "/v1/messages",
                (("content-type", "application/json"), ("Content-Length", str(len(raw)))),
                raw, b"")


@pytest.mark.parametrize("body", [
    {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=1\nBe brief."}],
     "messages": [{"role": "user", "content": "hi"}]},
    {"system": "x-anthropic-billing-header: cc_version=1\nBe brief.",
     "messages": [{"role": "user", "content": "hi"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
    {"input": [{"type": "message", "role": "developer",
                "content": [{"type": "input_text", "text": "hi"}]}]},
])
def test_with_line_starts_the_prompt_and_asks_for_no_cache(body: dict[str, object]) -> None:
    cached = with_line(_sent(body), "Run 3.", cache=True)
    cold = json.loads(with_line(_sent(body), "Run 3.", cache=False).body)
    got = json.loads(cached.body)
    assert "cache_prompt" not in got and cold.pop("cache_prompt") is False
    assert got == cold  # the pair sends the same prompt
    text = json.dumps(got)
    assert text.index("Run 3.") < text.index("hi")
    assert all(k.lower() != "content-length" for k, _ in cached.headers)
    # Claude Code's billing line still starts a line, so the server still strips it
    pattern = re.search(r"pattern = '(.*)'", STATECACHE_CONFIG)
    assert pattern is not None
    system = got.get("system")
    if system is not None:
        first = system if isinstance(system, str) else system[0]["text"]
        assert first.startswith("Run 3.\n")
        assert re.sub(pattern[1], "", first) == "Run 3.\nBe brief."


def test_pairs_split_at_a_token_and_pool() -> None:
    # a step's time shared by its tokens: grids that start elsewhere compare
    assert split_at([(0, 512, 1.0), (512, 100, 2.0)], 562) == pytest.approx((2.0, 1.0))
    assert split_at([(0, 512, 1.0)], 600) == (1.0, 0.0)
    cache = [[(0, 466, 1.0), (466, 323, 2.0), (789, 443, 4.0)]]
    none = [[(0, 512, 1.0), (512, 512, 3.0), (1024, 208, 1.5)]]
    runs = [{"steps": {"cache": cache, "no cache": none}, "ratios": {"llama_decode": [1.2]}},
            {"steps": {"cache": none, "no cache": none}, "ratios": {"llama_decode": [1.0]}}]
    lines = pooled_pairs(runs, 1000)
    assert len(lines) == 3
    # 4.0 s x 232 of 443 tokens; 1.5 s, and 3.0 s x 24 of 512
    assert lines[0].startswith("before 1,000: ") and "past it: 2.09 vs 1.64 s (+0.45 s)" in lines[0]
    assert lines[-1].startswith("the cache slower past 1,000 in 1 of 2 pairs")
    assert "median 1.100" in lines[-1]
