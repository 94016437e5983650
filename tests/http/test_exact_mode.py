"""``cache.exact``: every reply and its logprobs bit-identical to the cache-off server's,
under constant eviction (``python -m bench.exact`` at 200 requests is the full check);
and the default mode, which says in ``/admin/requests`` when a reply left the exact path
and why (docs/exact.md)."""

from __future__ import annotations

from pathlib import Path

from bench.exact import check, summary


def test_exact_mode_answers_as_the_cache_off_server(hybrid_path: Path, tmp_path: Path) -> None:
    t = check(hybrid_path, 30, exact=True, ram_budget="4MiB", log_dir=tmp_path,
              on_tick=lambda _: None)
    assert t.failures == [] and t.equal == t.requests == 30, summary(t)
    assert t.exact_path == 30 and not t.breaks, summary(t)
    # the check means something: states were reused, and evicted all the time
    assert t.cached >= 10 and t.kinds["ram_evictions"] > 0, summary(t)
    assert {"follow-up", "edit", "regenerate"} <= set(t.kinds), summary(t)


def test_the_default_mode_says_which_replies_left_the_exact_path(
        hybrid_path: Path, tmp_path: Path) -> None:
    """The default mode restores off the grid and cuts its prefills at its checkpoints:
    its logprobs differ from the cold server's in the last bits, from the first request
    on (issue 47: 1 of 100 bit-identical). Those replies say so; none that says it took
    the exact path differs."""
    t = check(hybrid_path, 12, exact=False, ram_budget="4MiB", log_dir=tmp_path,
              on_tick=lambda _: None)
    assert t.failures, summary(t)
    assert t.exact_path < t.requests and t.said_exact_but_differ == 0, summary(t)
    # the hybrid's prefill stops at its partial checkpoints; its restores are at pages
    assert {"prefill off the grid", "checkpoint off the grid"} <= set(t.breaks), summary(t)
