"""``python -m bench.soak``: sessions over the four APIs with clients that leave and
malformed requests, every compared reply equal to the cache-off server's, and a clean
exit on SIGINT; and the soak does report a reply that differs."""

from __future__ import annotations

from pathlib import Path

import pytest

import bench.soak as soak_mod
from bench.soak import soak, summary


def test_a_short_soak_passes(hybrid_path: Path, tmp_path: Path) -> None:
    # an amount of work, not a time: 8 s gave 10 replies beside a hog on each core
    res = soak(hybrid_path, seconds=0, replies=20, clients=3, ram_budget="8MiB",
               compare=0.5, log_dir=tmp_path, on_tick=lambda _: None)
    assert res["failures"] == [], summary(res)
    assert res["replies"] >= 20 and res["compared"] > 0, summary(res)
    assert res["exits"] == {"statecache": 0, "no-cache": 0}
    # an 8 MiB budget holds a few states: the pool evicted and wrote to disk
    m = res["metrics"]
    assert m['statecache_evictions_total{tier="ram"}'] > 0 and m["statecache_disk_writes_total"] > 0
    assert m["statecache_disk_write_errors_total"] == 0 and m["statecache_pool_quarantined"] == 0


def test_a_reply_that_differs_from_the_cold_one_is_a_failure(
        hybrid_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real = soak_mod.ask
    cold_urls: set[str] = set()

    def ask(url: str, api: str, *args: object, **kw: object) -> str | None:
        out = real(url, api, *args, **kw)  # type: ignore[arg-type]
        if url in cold_urls and out is not None:
            return out + "!"  # what a restored state that is not the one we saved gives
        return out

    real_client = soak_mod.session_client

    def client(i: int, url: str, cold_url: str, *rest: object) -> None:
        cold_urls.add(cold_url)
        real_client(i, url, cold_url, *rest)  # type: ignore[arg-type]

    monkeypatch.setattr(soak_mod, "ask", ask)
    monkeypatch.setattr(soak_mod, "session_client", client)
    res = soak(hybrid_path, seconds=0, replies=3, clients=1, ram_budget="64MiB",
               compare=1.0, log_dir=tmp_path, on_tick=lambda _: None)
    assert res["compared"] > 0
    assert len(res["failures"]) == res["compared"], summary(res)
    assert "cold" in res["failures"][0]
