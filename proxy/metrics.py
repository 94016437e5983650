"""Prometheus text exposition (format 0.0.4) of the engine's counters.

``engine.metrics()`` returns a dict of numbers and nested dicts of numbers; a
nested dict's keys become label values, one level per label. The keys known
below get their Prometheus name, type, help and label names; any other key is
still exported, as ``statecache_<key>`` (a counter if it ends in ``_total``,
else a gauge) with labels named ``key``, ``key2``, … for its nesting.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(slots=True, frozen=True)
class MetricSpec:
    name: str
    kind: str  # counter | gauge
    help: str
    labels: tuple[str, ...] = ()


ENGINE_METRICS: dict[str, MetricSpec] = {
    "requests": MetricSpec("statecache_requests_total", "counter",
                           "Generation requests finished, by finish reason.", ("reason",)),
    "hits": MetricSpec("statecache_cache_hits_total", "counter",
                       "Requests by where their starting state came from (cold, lane, ram, "
                       "disk) and the role of the checkpoint used.", ("source", "role")),
    "tokens_prefilled": MetricSpec("statecache_prefilled_tokens_total", "counter",
                                   "Prompt tokens run through the model."),
    "tokens_reused": MetricSpec("statecache_reused_tokens_total", "counter",
                                "Prompt tokens served from a kept or restored state."),
    "tokens_generated": MetricSpec("statecache_generated_tokens_total", "counter",
                                   "Tokens generated."),
    "bytes": MetricSpec("statecache_checkpoint_bytes", "gauge",
                        "Bytes of checkpoints held, per tier.", ("tier",)),
    "checkpoints": MetricSpec("statecache_checkpoints", "gauge",
                              "Checkpoints held, per tier.", ("tier",)),
    "evictions": MetricSpec("statecache_evictions_total", "counter",
                            "Checkpoints evicted, per tier.", ("tier",)),
    "queue_depth": MetricSpec("statecache_queue_depth", "gauge",
                              "Requests waiting for a lane."),
    "lanes_busy": MetricSpec("statecache_lanes_busy", "gauge", "Lanes generating now."),
}
HTTP_SPEC = MetricSpec("statecache_http_requests_total", "counter",
                       "HTTP requests answered, by route and status code.", ("route", "code"))

_NAME_BAD = re.compile(r"[^a-zA-Z0-9_]")


def _spec_for(key: str) -> MetricSpec:
    if key in ENGINE_METRICS:
        return ENGINE_METRICS[key]
    name = "statecache_" + _NAME_BAD.sub("_", key)
    kind = "counter" if name.endswith("_total") else "gauge"
    return MetricSpec(name, kind, f"Engine metric {key!r}.")


def _leaves(value: object, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], float]]:
    if isinstance(value, Mapping):
        for k in sorted(value, key=str):
            yield from _leaves(value[k], (*path, str(k)))
    elif isinstance(value, int | float):
        yield path, float(value) if isinstance(value, float) else int(value)
    # strings and other values are not samples: skipped


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def _label_names(spec: MetricSpec, depth: int) -> tuple[str, ...]:
    extra = tuple("key" if i == 0 else f"key{i + 1}" for i in range(depth - len(spec.labels)))
    return (spec.labels + extra)[:depth]


def format_family(spec: MetricSpec, value: object) -> list[str]:
    """The ``# HELP``/``# TYPE`` lines and samples of one metric."""
    samples = list(_leaves(value))
    if not samples:
        return []
    lines = [f"# HELP {spec.name} {spec.help}", f"# TYPE {spec.name} {spec.kind}"]
    for path, v in samples:
        names = _label_names(spec, len(path))
        labels = ",".join(f'{n}="{_escape(x)}"' for n, x in zip(names, path, strict=True))
        lines.append(f"{spec.name}{{{labels}}} {_number(v)}" if labels
                     else f"{spec.name} {_number(v)}")
    return lines


def format_metrics(engine_metrics: Mapping[str, object],
                   http_counts: Mapping[tuple[str, int], int] | None = None) -> str:
    """The whole /metrics page."""
    lines: list[str] = []
    for key in sorted(engine_metrics):
        lines += format_family(_spec_for(key), engine_metrics[key])
    if http_counts:
        nested: dict[str, dict[str, int]] = {}
        for (route, code), n in http_counts.items():
            nested.setdefault(route, {})[str(code)] = n
        lines += format_family(HTTP_SPEC, nested)
    return "\n".join(lines) + "\n"
