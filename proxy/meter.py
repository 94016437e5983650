"""Typed metrics: counters, gauges and histograms declared once with their name, help and
labels, incremented where things happen, rendered in Prometheus' text format (0.0.4).

A family holds its samples by label values; nothing is built as a string and parsed
back. Increments come from the engine thread and the event loop; each is one dict
update under the GIL, as a ``collections.Counter``'s would be.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
Labels = tuple[str, ...]


class Family:
    """One metric family: its samples by label values (in ``labels``' order)."""

    kind = "untyped"

    def __init__(self, name: str, help_: str, labels: Sequence[str] = ()) -> None:
        self.name, self.help, self.labels = name, help_, tuple(labels)
        self._values: dict[Labels, float] = {}

    def _key(self, values: Sequence[str]) -> Labels:
        if len(values) != len(self.labels):
            raise ValueError(f"{self.name} takes labels {self.labels}, got {values!r}")
        return tuple(str(v) for v in values)

    def get(self, *values: str) -> float:
        return self._values.get(self._key(values), 0)

    def put(self, values: Sequence[str], value: float) -> None:
        """Set the sample of ``values`` (a value read from elsewhere: a report, a gauge)."""
        self._values[self._key(values)] = value

    def samples(self) -> Iterator[tuple[str, Labels, float]]:
        """(name suffix, label values, value) of each sample."""
        for key, v in self._values.items():
            yield "", key, v

    def __bool__(self) -> bool:
        return bool(self._values)


class Counter(Family):
    kind = "counter"

    def inc(self, *values: str, by: float = 1) -> None:
        key = self._key(values)
        self._values[key] = self._values.get(key, 0) + by


class Gauge(Family):
    kind = "gauge"

    def set(self, value: float, *values: str) -> None:
        self.put(values, value)


class Histogram(Family):
    """Observations counted in cumulative buckets (``le``), with their sum and count."""

    kind = "histogram"

    def __init__(self, name: str, help_: str, buckets: Sequence[float],
                 labels: Sequence[str] = ()) -> None:
        super().__init__(name, help_, labels)
        self.buckets = tuple(sorted(buckets))
        self._counts: dict[Labels, list[int]] = {}
        self._sums: dict[Labels, float] = {}

    def observe(self, value: float, *values: str) -> None:
        key = self._key(values)
        counts = self._counts.setdefault(key, [0] * (len(self.buckets) + 1))
        for i, le in enumerate(self.buckets):
            if value <= le:
                counts[i] += 1
        counts[-1] += 1
        self._sums[key] = self._sums.get(key, 0.0) + value

    def samples(self) -> Iterator[tuple[str, Labels, float]]:
        for key, counts in self._counts.items():
            for le, n in zip((*self.buckets, math.inf), counts, strict=True):
                yield "_bucket", (*key, _number(le)), n
            yield "_sum", key, self._sums[key]
            yield "_count", key, counts[-1]

    def label_names(self, suffix: str) -> Labels:
        return (*self.labels, "le") if suffix == "_bucket" else self.labels

    def __bool__(self) -> bool:
        return bool(self._counts)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(v: float) -> str:
    if isinstance(v, int):
        return str(int(v))  # bools too: 0 / 1
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


def render(families: Iterable[Family]) -> str:
    """The families that hold samples, by name, each sample sorted by its labels."""
    lines: list[str] = []
    for fam in sorted((f for f in families if f), key=lambda f: f.name):
        lines += [f"# HELP {fam.name} {fam.help}", f"# TYPE {fam.name} {fam.kind}"]
        rows = []
        for suffix, values, v in fam.samples():
            names = fam.label_names(suffix) if isinstance(fam, Histogram) else fam.labels
            body = ",".join(f'{k}="{_escape(x)}"' for k, x in zip(names, values, strict=True))
            rows.append((values, f"{fam.name}{suffix}{{{body}}} {_number(v)}" if body
                         else f"{fam.name}{suffix} {_number(v)}"))
        if not isinstance(fam, Histogram):  # a histogram's buckets stay in order
            rows.sort(key=lambda r: r[0])
        lines += [text for _, text in rows]
    return "\n".join(lines) + "\n"
