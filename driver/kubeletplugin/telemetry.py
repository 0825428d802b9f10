"""Traces (OpenTelemetry) and metrics (Prometheus text on ``/metrics``) of a DRA plugin.

Everything lives on one :class:`Telemetry` object that the process creates once and passes
down; there is no module-level state, so tests can build as many as they like. Every claim gets a
span and its counter and latency observations. The HTTP port itself is
:mod:`driver.kubeletplugin.httpendpoint`; the instruments and their text are :mod:`.metrics`.

Spans are recorded once something takes them (a span exporter or processor): until then the
OpenTelemetry API's no-op tracer stands in and the SDK is not even imported. Before, the SDK recorded
every claim's spans and dropped them, having nowhere to send them (~1 MiB and ~50 µs of CPU per
prepare+unprepare cycle, docs/benchmarks.md); the spans are the same once an exporter is given.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from opentelemetry.trace import NoOpTracer, Tracer

from driver.kubeletplugin.metrics import CONTENT_TYPE as CONTENT_TYPE
from driver.kubeletplugin.metrics import Metrics, Observations

if TYPE_CHECKING:  # the SDK is imported where spans are first recorded (add_span_processor)
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

# Prepare latency is milliseconds when all goes well and seconds when a daemon starts;
# the kubelet gives up at 45 s.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 45)


class Telemetry:
    """Tracer, metric instruments and the ``/metrics`` text of one plugin process."""

    def __init__(self, service_name: str, metric_prefix: str, span_exporter: SpanExporter | None = None, *,
                 scope: str | None = None):
        """``service_name`` names the process in traces; metrics are ``<metric_prefix>_<name>``.

        ``scope`` (default: ``metric_prefix``) names the tracer and prefixes span names and
        attributes (``<scope>.prepare_claim``), so the layer carries no driver's name.
        """
        self.scope = scope if scope is not None else metric_prefix
        self._service_name = service_name
        self._tracer_provider: TracerProvider | None = None
        self.tracer: Tracer = NoOpTracer()
        if span_exporter is not None:
            from opentelemetry.sdk.trace.export import SimpleSpanProcessor

            self.add_span_processor(SimpleSpanProcessor(span_exporter))
        self._metrics = Metrics(metric_prefix)
        self.prepare_total = self._metrics.counter(
            "prepare_claims", "Claims prepared, by result (success or error)")
        self.prepare_duration = self._metrics.histogram(
            "prepare_claim_duration_seconds", "Time to prepare one claim", _LATENCY_BUCKETS)
        self.unprepare_total = self._metrics.counter(
            "unprepare_claims", "Claims unprepared, by result (success or error)")
        self.unprepare_duration = self._metrics.histogram(
            "unprepare_claim_duration_seconds", "Time to unprepare one claim", _LATENCY_BUCKETS)
        self.slice_sync_total = self._metrics.counter(
            "resourceslice_syncs", "ResourceSlice publishing rounds, by result")

    def add_span_processor(self, processor: SpanProcessor) -> None:
        """Record spans from now on, and hand each to ``processor``."""
        if self._tracer_provider is None:
            # Imported here: a process that exports no spans never loads the SDK (module docstring).
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider

            self._tracer_provider = TracerProvider(resource=Resource.create({"service.name": self._service_name}))
            self.tracer = self._tracer_provider.get_tracer(self.scope)
        self._tracer_provider.add_span_processor(processor)

    def observe_gauge(self, name: str, description: str, read: Callable[[], float]) -> None:
        """Register a gauge whose value is read at scrape time (e.g. prepared claims)."""
        self._metrics.observe(name, description, lambda: [(read(), {})])

    def observe_labelled(self, name: str, description: str, read: Callable[[], Observations], *,
                         counter: bool = False) -> None:
        """Register a gauge (or a monotonic counter) with one series per label set, read at scrape time."""
        self._metrics.observe(name, description, read, counter=counter)

    def render_metrics(self) -> bytes:
        """Every metric in the Prometheus text format (:data:`CONTENT_TYPE`)."""
        return self._metrics.render()

    def shutdown(self) -> None:
        if self._tracer_provider is not None:
            self._tracer_provider.shutdown()
