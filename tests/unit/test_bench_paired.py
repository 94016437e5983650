"""bench.batching's paired ratios: each repeat's runs compared with each other, so a
machine that drifts between repeats moves both sides of a ratio alike."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest

from bench.batching import PER_TOKEN, finite_median, summary, system_config
from bench.paired import median_ci, paired
from bench.paired import table as _paired
from bench.report import _batching
from bench.servers import ModelSpec, _command, checkout


def test_each_repeat_is_compared_with_itself() -> None:
    # the machine drifts between repeats (the binding's runs); statecache's run in each
    # repeat is this share of the binding's run beside it
    binding = [100.0, 80.0, 60.0, 90.0, 70.0]
    share = [0.90, 1.00, 0.96, 0.95, 0.97]
    runs = {"statecache": {"1": [b * r for b, r in zip(binding, share, strict=True)]},
            "binding": {"1": binding}}
    p = paired(runs, "statecache", "binding")["1"]
    assert {k: p[k] for k in ("median", "low", "high")} == pytest.approx(
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


def test_another_revision_runs_its_own_packages() -> None:
    """``bench.batching --against REV`` runs statecache from a worktree of REV: a Python
    started there imports that checkout's packages, not this one's editable install."""
    with checkout("HEAD") as root:
        assert (root / "proxy" / "engine" / "outbox.py").is_file()
        out = subprocess.run([sys.executable, "-c", "import proxy, statecache; "
                              "print(proxy.__file__); print(statecache.__file__)"],
                             cwd=root, capture_output=True, text=True, check=True).stdout
        assert [Path(line).resolve().is_relative_to(root.resolve())
                for line in out.split()] == [True, True]
        cmd = _command("statecache", ModelSpec("m", Path("/m.gguf"), is_gemma=False), 1, 512,
                       1, root, root=root)
        assert cmd[1:3] == ["-m", "proxy"]  # not the installed `statecache` script
    assert not root.exists()


def test_the_summary_gives_medians_and_paired_ratios() -> None:
    result = {"statecache": {"decode_tps": {"1": 300.0, "4": 400.0}},
              "llama-server": {"decode_tps": {"1": 290.0, "4": 410.0}},
              "paired_statecache_llama-server": {
                  "1": {"median": 1.03, "low": 0.98, "high": 1.1},
                  "4": {"median": 0.99, "low": 0.95, "high": 1.02}}}
    lines = summary(result).splitlines()
    assert lines[0].split() == ["statecache", "1:", "300.0", "4:", "400.0"]
    assert lines[-1] == "| statecache ÷ llama-server | 1.030 (0.98–1.10) | – | 0.990 (0.95–1.02) |"


def test_the_report_shows_a_commit_it_was_paired_with() -> None:
    pair = {"1": {"median": 1.01, "low": 0.97, "high": 1.04}}
    lines = _paired({"paired_statecache_binding": pair,
                     "paired_statecache_statecache@abc123": pair})
    assert lines[-2:] == ["| statecache ÷ the binding | 1.010 (0.97–1.04) | – | – |",
                          "| statecache ÷ statecache@abc123 | 1.010 (0.97–1.04) | – | – |"]


def test_against_config_sets_the_other_revision_apart() -> None:
    # --against HEAD --statecache-config "[engine]\nlone_run_ms = 0" --against-config ""
    # compares two configs of one commit: only this checkout's statecache gets the key
    mine, rev = "[engine]\\nlone_run_ms = 0", "statecache@HEAD"
    assert system_config("statecache", mine=mine, theirs="", against=rev) == \
        "[engine]\nlone_run_ms = 0"
    assert system_config(rev, mine=mine, theirs="", against=rev) == ""
    assert system_config("llama-server", mine=mine, theirs="", against=rev) == ""
    per_token = system_config(PER_TOKEN, mine=mine, theirs="", against=rev)
    assert "lone_run_ms = 0" in per_token and "stream_interval_ms = 0" in per_token
    # without --against-config both run with --statecache-config's tables
    assert system_config(rev, mine=mine, theirs=None, against=rev) == \
        "[engine]\nlone_run_ms = 0"


def test_the_median_comes_with_a_confidence_interval_that_assumes_no_distribution() -> None:
    # 12 repeats: the chance that the median lies below the 3rd lowest ratio is
    # P(binomial(12, 1/2) <= 2) = 79/4096 = 1.9%; below the 4th it would be 7.3%, over
    # the 2.5% that each side of a 95% interval may miss
    xs = [0.80 + 0.01 * i for i in range(12)]
    assert median_ci(xs) == (xs[2], xs[9])
    # the order of the values does not matter, only their ranks
    assert median_ci(list(reversed(xs))) == (xs[2], xs[9])
    # 9 repeats: P(B <= 1) = 10/512 = 2.0%, P(B <= 2) = 9.0%
    assert median_ci(xs[:9]) == (xs[1], xs[7])
    # 40 repeats: P(B <= 13) = 1.9%, P(B <= 14) = 4.0%
    ys = [float(i) for i in range(40)]
    assert median_ci(ys) == (13.0, 26.0)
    # 6 is the fewest for 95%: P(B <= 0) = 1/64 = 1.6%, and the interval is the range
    assert median_ci(xs[:6]) == (xs[0], xs[5])
    # under 6, even the range misses the median more often than 5 times in 100: none
    assert median_ci(xs[:5]) is None
    assert median_ci([1.0]) is None
    assert median_ci([]) is None


def test_too_few_repeats_report_their_range_not_an_interval() -> None:
    runs = {"statecache": {"1": [95.0]}, "binding": {"1": [100.0]}}
    p = paired(runs, "statecache", "binding")["1"]
    assert "ci_low" not in p and p["low"] == p["high"] == pytest.approx(0.95)
    text = "\n".join(_paired({"paired_statecache_binding": {"1": p}}))
    assert "0.950 (0.95–0.95)" in text and "the lowest and highest" in text
    assert "confidence" not in text


def test_paired_ratios_carry_their_interval() -> None:
    binding = [100.0] * 12
    runs = {"statecache": {"1": [80.0 + i for i in range(12)]}, "binding": {"1": binding}}
    p = paired(runs, "statecache", "binding")["1"]
    assert p["n"] == 12
    assert (p["ci_low"], p["ci_high"]) == pytest.approx((0.82, 0.89))
    assert (p["low"], p["high"]) == pytest.approx((0.80, 0.91))
    text = "\n".join(_paired({"paired_statecache_binding": {"1": p}}))
    assert "0.855 (0.82–0.89)" in text and "95% confidence interval" in text
    assert "of 12 repeats" in text


def test_streams_picks_the_stream_counts(tmp_path: Path) -> None:
    # a bad --streams is refused before any server starts
    for bad in ("3", "1,1", "", "1,x"):
        r = subprocess.run([sys.executable, "-m", "bench.batching", "--streams", bad,
                            "--json", str(tmp_path / "x.json")],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "--streams" in r.stderr, (bad, r.stderr)
    assert not (tmp_path / "x.json").exists()


def test_a_run_without_a_rate_is_left_out_not_a_nan_ratio() -> None:
    # the quick bench's tiny model: llama-server's four 64-token streams did not all
    # decode at once, so that run has no aggregate rate (NaN)
    nan = float("nan")
    runs = {"statecache": {"1": [90.0, 96.0, 99.0], "4": [200.0]},
            "llama-server": {"1": [100.0, nan, 100.0], "4": [nan]}}
    p = paired(runs, "statecache", "llama-server")
    assert p["1"]["n"] == 2 and p["1"]["median"] == pytest.approx(0.945)
    assert "4" not in p
    assert finite_median([nan, 3.0, 1.0]) == 2.0
    assert math.isnan(finite_median([nan]))
    itl = {"quiet_p50_ms": 1.0, "quiet_p95_ms": 2.0, "busy_p50_ms": 1.0, "busy_p95_ms": 3.0,
           "busy_p99_ms": 4.0, "busy_max_ms": 5.0, "long_prefill_s": 0.5, "busy_tokens": 9}
    behind = {"short_ttft_s": 0.07, "long_ttft_s": 0.5}
    peer = {"decode_tps": {"1": 1400.0, "2": 1900.0, "4": 2500.0},
            "scaling": {"1": 1.0, "2": 1.36, "4": 1.79}, "itl": itl,
            "short_behind_long": behind}
    ls = {"decode_tps": {"1": 1200.0, "2": 1300.0, "4": nan},
          "scaling": {"1": 1.0, "2": 1.08, "4": nan}, "itl": itl, "short_behind_long": behind}
    text = "\n".join(_batching({"model": "hybrid-tiny", "direct_decode_tps": 1500.0,
                                "statecache": peer, "llama-server": ls,
                                "binding": peer, "paired_statecache_llama-server": p}))
    assert "| 4 streams | 2500.0 (1.79x) | n/a (n/ax) |" in text
    assert "4 streams n/ax" in text and "llama-server n/ax" in text
    assert "in no run of that system did every stream decode at once" in text
    assert "nan" not in text.lower().replace("n/a", "")
