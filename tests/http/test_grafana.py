"""The Grafana dashboard (``docs/grafana-statecache.json``) queries only what ``/metrics``
serves: every ``statecache_*`` name in it (panels, template variables) is a family the
proxy exports after a short workload, with the labels the dashboard groups by; a
histogram's ``_bucket`` series carry ``le``. The JSON is what Grafana's import expects:
unique panel ids, each query with a reference id, one data-source variable."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.http.conftest import serve, until_metrics
from tests.http.test_metrics_names import SYSTEM
from tests.store import Store

pytestmark = pytest.mark.http

DASHBOARD = Path(__file__).parents[2] / "docs" / "grafana-statecache.json"
_NAME = re.compile(r"\bstatecache_[a-z0-9_]+")
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
_SELECTOR = re.compile(r"\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
_LEGEND = re.compile(r"\{\{\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\}\}")
_TYPE = re.compile(r"^# TYPE (\S+) (\S+)$")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? ")
SCRAPE_LABELS = {"instance", "job"}  # added by Prometheus, not by the proxy
SUFFIXES = ("_bucket", "_sum", "_count")


def exported(text: str) -> tuple[dict[str, str], dict[str, set[str]]]:
    """Each family's type, and the label names of each series name that has samples."""
    kinds: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    for line in text.splitlines():
        if m := _TYPE.match(line):
            kinds[m[1]] = m[2]
        elif m := _SAMPLE.match(line):
            names = {kv.split("=", 1)[0] for kv in (m[2] or "").split(",") if kv}
            labels.setdefault(m[1], set()).update(names)
    return kinds, labels


def _strings(node: Any) -> Iterator[str]:
    if isinstance(node, str):
        yield node
    elif isinstance(node, dict):
        for v in node.values():
            yield from _strings(v)
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v)


def _targets(dashboard: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            yield panel["title"], target


def problems(dashboard: dict[str, Any], text: str) -> list[str]:
    """What in the dashboard ``/metrics`` (``text``) does not have; empty when all is."""
    kinds, labels = exported(text)
    out = []
    for name in sorted({n for s in _strings(dashboard) for n in _NAME.findall(s)}):
        base = next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s)
                     and kinds.get(name.removesuffix(s)) == "histogram"), name)
        if base not in kinds:
            out.append(f"{name}: no such family")
        elif name not in labels:
            out.append(f"{name}: a family without samples")
        elif name.endswith("_bucket") and "le" not in labels[name]:
            out.append(f"{name}: no le label")
    for title, target in _targets(dashboard):
        expr = target["expr"]
        have = set().union(*(labels.get(n, set()) for n in _NAME.findall(expr)))
        used = {w.strip() for m in _BY.findall(expr) for w in m.split(",") if w.strip()}
        used |= {m for sel in _SELECTOR.findall(expr) for m in _MATCHER.findall(sel)}
        used |= set(_LEGEND.findall(target.get("legendFormat", "")))
        for label in sorted(used - have - SCRAPE_LABELS):
            out.append(f"{title!r}: label {label!r} is on none of {_NAME.findall(expr)}")
    return out


def test_the_checks_find_a_metric_or_label_that_is_not_served() -> None:
    text = ('# TYPE statecache_a_total counter\nstatecache_a_total{tier="ram"} 1\n'
            "# TYPE statecache_h histogram\n"
            'statecache_h_bucket{le="+Inf"} 1\nstatecache_h_sum 1\nstatecache_h_count 1\n'
            "# TYPE statecache_quiet counter\n")
    ok = {"panels": [{"title": "t", "targets": [
        {"expr": 'sum by (tier) (rate(statecache_a_total{instance=~"$i"}[1m]))'},
        {"expr": "histogram_quantile(0.5, sum by (le) (rate(statecache_h_bucket[1m])))"}]}]}
    assert problems(ok, text) == []
    for expr, why in [("statecache_b_total", "statecache_b_total: no such family"),
                      ("statecache_quiet", "statecache_quiet: a family without samples"),
                      ("sum by (cause) (statecache_a_total)", "label 'cause' is on none"),
                      ("statecache_a_total{role=\"x\"}", "label 'role' is on none")]:
        bad = {"panels": [{"title": "t", "targets": [{"expr": expr}]}]}
        assert any(why in p for p in problems(bad, text)), (expr, problems(bad, text))


def test_the_dashboard_is_importable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"] and dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for title, target in _targets(dashboard):
        assert target["refId"] and target["expr"], title
    for s in _strings(dashboard):  # every data source is the variable's
        assert "DS_" not in s or s.startswith("${datasource}"), s
    # what the issue asks the dashboard to show, each on a panel of its own
    titles = " | ".join(p["title"] for p in dashboard["panels"]).lower()
    for what in ("reused", "first token", "decode tokens/s", "bytes per tier", "evictions",
                 "misses by cause"):
        assert what in titles, what


async def test_every_metric_the_dashboard_queries_is_in_metrics(
        hybrid_path: Path, tmp_path: Path) -> None:
    """A workload that touches each panel: two turns and a miss, checkpoints in RAM, on
    disk and in a shared store (a real Valkey)."""
    store = Store(tmp_path / "store").start()
    try:
        async with serve(hybrid_path, tmp_path / "ckpt", cache__remote__url=store.url,
                         engine__idle_save_s=0.2) as srv:
            chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi"}]
            r = await srv.client.chat.completions.create(model="m", messages=chat,
                                                         max_tokens=8, temperature=0)
            chat += [{"role": "assistant", "content": r.choices[0].message.content or ""},
                     {"role": "user", "content": "And?"}]
            await srv.client.chat.completions.create(model="m", messages=chat, max_tokens=8,
                                                     temperature=0)
            edited = [{"role": "system", "content": SYSTEM[:200] + "Changed. " + SYSTEM[200:]},
                      *chat[1:]]  # a miss: the system prompt changed
            await srv.client.chat.completions.create(model="m", messages=edited,
                                                     max_tokens=4, temperature=0)
            # idle lanes saved, written to disk and the store
            text = await until_metrics(srv, lambda m: (
                m.get("statecache_idle_saves_total", 0) >= 1
                and m.get('statecache_remote_total{event="writes"}', 0) >= 1
                and m.get("statecache_disk_write_queue") == 0
                and m.get("statecache_remote_write_queue") == 0))
    finally:
        store.stop()
    found = problems(json.loads(DASHBOARD.read_text()), text)
    assert not found, "the dashboard asks for what /metrics does not serve:\n" + \
        "\n".join(found)
