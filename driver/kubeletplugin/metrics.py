"""Counters, histograms and gauges read at scrape time, rendered in the Prometheus text format (0.0.4).

The plugin's metrics are a handful of instruments updated once per claim and read by a scraper every
few seconds; this is all of it, in place of the OpenTelemetry metrics SDK and its Prometheus exporter.
Those cost ~140 ms of CPU and ~3 MiB to import, and a counter add or histogram record went through
several layers (views, exemplar filters, aggregations) on every claim (docs/benchmarks.md). Names,
labels and the text are what the exporter rendered: counters end in ``_total``, histograms have
``_bucket{le=...}``, ``_count`` and ``_sum``. Spans stay OpenTelemetry's (:mod:`.telemetry`).
"""

from __future__ import annotations

import logging
import math
import threading
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TypeVar

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

Labels = tuple[tuple[str, str], ...]
# What an observed metric's callback returns: one (value, labels) per series.
Observations = Iterable[tuple[float, Mapping[str, str]]]


def _labels(attributes: Mapping[str, str] | None) -> Labels:
    return tuple(sorted((str(k), str(v)) for k, v in attributes.items())) if attributes else ()


class Counter:
    """A monotonic sum per label set."""

    def __init__(self, name: str, description: str):
        self.name = name
        self.description = description
        self._lock = threading.Lock()
        self._values: dict[Labels, float] = {}

    def add(self, amount: float, attributes: Mapping[str, str] | None = None) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} cannot go down (add {amount})")
        key = _labels(attributes)
        with self._lock:
            self._values[key] = self._values.get(key, 0.0) + amount

    def _lines(self, name: str) -> list[str]:
        total = name if name.endswith("_total") else f"{name}_total"
        with self._lock:
            values = sorted(self._values.items())
        return [*_header(total, self.description, "counter"),
                *(f"{total}{_text_labels(labels)} {_number(value)}" for labels, value in values)]


@dataclass
class _Buckets:
    counts: list[int]
    total: float = 0.0
    count: int = 0


class Histogram:
    """Counts of values at or below each bound (``le``), their sum and count, per label set."""

    def __init__(self, name: str, description: str, bounds: tuple[float, ...]):
        self.name = name
        self.description = description
        self._bounds = tuple(sorted(bounds))
        self._lock = threading.Lock()
        self._series: dict[Labels, _Buckets] = {}

    def record(self, value: float, attributes: Mapping[str, str] | None = None) -> None:
        key = _labels(attributes)
        index = bisect_left(self._bounds, value)  # the first bound >= value; past the end: only +Inf
        with self._lock:
            series = self._series.get(key)
            if series is None:
                series = self._series[key] = _Buckets([0] * (len(self._bounds) + 1))
            series.counts[index] += 1
            series.total += value
            series.count += 1

    def _lines(self, name: str) -> list[str]:
        with self._lock:
            snapshot = sorted((labels, list(s.counts), s.total, s.count) for labels, s in self._series.items())
        lines = _header(name, self.description, "histogram")
        for labels, counts, total, count in snapshot:
            cumulative = 0
            for bound, bucket in zip((*self._bounds, math.inf), counts, strict=True):
                cumulative += bucket
                lines.append(f"{name}_bucket{_text_labels((('le', _bound(bound)), *labels))} {_number(cumulative)}")
            lines.append(f"{name}_count{_text_labels(labels)} {_number(count)}")
            lines.append(f"{name}_sum{_text_labels(labels)} {_number(total)}")
        return lines


class _Observed:
    """A gauge or counter whose series are read from a callback at every scrape."""

    def __init__(self, name: str, description: str, read: Callable[[], Observations], counter: bool):
        self.name = name
        self.description = description
        self._read = read
        self._counter = counter

    def _lines(self, name: str) -> list[str]:
        if self._counter and not name.endswith("_total"):
            name = f"{name}_total"
        try:
            series = sorted((_labels(labels), value) for value, labels in self._read())
        except Exception:  # one broken reading must not take the other metrics off the scrape
            log.exception("reading a metric failed", extra={"metric": name})
            series = []
        return [*_header(name, self.description, "counter" if self._counter else "gauge"),
                *(f"{name}{_text_labels(labels)} {_number(value)}" for labels, value in series)]


_Instrument = TypeVar("_Instrument", Counter, Histogram, _Observed)


class Metrics:
    """Every instrument of one process (or one test), rendered with a name prefix."""

    def __init__(self, prefix: str):
        self._prefix = prefix
        self._lock = threading.Lock()
        self._instruments: list[Counter | Histogram | _Observed] = []

    def counter(self, name: str, description: str) -> Counter:
        return self._add(Counter(name, description))

    def histogram(self, name: str, description: str, bounds: tuple[float, ...]) -> Histogram:
        return self._add(Histogram(name, description, bounds))

    def observe(self, name: str, description: str, read: Callable[[], Observations], *, counter: bool = False) -> None:
        """A gauge (or a monotonic counter) with one series per label set, read at scrape time."""
        self._add(_Observed(name, description, read, counter))

    def render(self) -> bytes:
        with self._lock:
            instruments = list(self._instruments)
        lines: list[str] = []
        for instrument in instruments:
            lines.extend(instrument._lines(f"{self._prefix}_{instrument.name}" if self._prefix else instrument.name))
        return ("\n".join(lines) + "\n").encode() if lines else b""

    def _add(self, instrument: _Instrument) -> _Instrument:
        with self._lock:
            if any(i.name == instrument.name for i in self._instruments):
                raise ValueError(f"metric {instrument.name} is registered twice")
            self._instruments.append(instrument)
        return instrument


def _header(name: str, description: str, kind: str) -> list[str]:
    text = description.replace("\\", "\\\\").replace("\n", "\\n")
    return [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]


def _text_labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{_label_name(k)}="{_escape(v)}"' for k, v in labels) + "}"


def _label_name(name: str) -> str:
    # Prometheus label names are [a-zA-Z_][a-zA-Z0-9_]*.
    cleaned = "".join(c if c.isascii() and (c.isalnum() or c == "_") else "_" for c in name)
    return cleaned if cleaned and not cleaned[0].isdigit() else f"_{cleaned}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return "NaN" if math.isnan(value) else repr(float(value))


def _bound(value: float) -> str:
    """A bucket's ``le`` as the exporter wrote it: ``0.005``, ``1``, ``45``, ``+Inf``."""
    return "+Inf" if math.isinf(value) else format(value, "g")
