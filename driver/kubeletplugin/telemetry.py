"""OpenTelemetry traces and metrics of a DRA plugin, with the Prometheus text for ``/metrics``.

Everything lives on one :class:`Telemetry` object that the process creates once and passes
down; there is no module-level state, so tests can build as many as they like. Every claim gets a
span and its counter and latency observations. Spans come from the OpenTelemetry SDK's tracer
provider, with or without a span exporter (one can be added later: :meth:`Telemetry.add_span_processor`);
metrics are the SDK's meters, read by the OpenTelemetry Prometheus exporter into a registry of this
object's own and rendered by ``prometheus_client``. The HTTP port itself is
:mod:`driver.kubeletplugin.httpendpoint`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.view import ExplicitBucketHistogramAggregation, View
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter
from opentelemetry.trace import Tracer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

CONTENT_TYPE = CONTENT_TYPE_LATEST

# What an observed metric's callback returns: one (value, labels) per series.
Observations = Iterable[tuple[float, Mapping[str, str]]]

# Prepare latency is milliseconds when all goes well and seconds when a daemon starts;
# the kubelet gives up at 45 s.
_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 45)


class Telemetry:
    """Tracer, meter instruments and the Prometheus registry of one plugin process."""

    def __init__(self, service_name: str, metric_prefix: str, span_exporter: SpanExporter | None = None, *,
                 scope: str | None = None):
        """``service_name`` names the process in traces; metrics are ``<metric_prefix>_<name>``.

        ``scope`` (default: ``metric_prefix``) names the tracer and meter and prefixes span names
        and attributes (``<scope>.prepare_claim``), so the layer carries no driver's name.
        """
        self.scope = scope if scope is not None else metric_prefix
        resource = Resource.create({"service.name": service_name})
        self.registry = CollectorRegistry()
        # Series as the plugin has always exposed them: no otel_scope_* labels, no target_info metric.
        self._reader = PrometheusMetricReader(disable_target_info=True, prefix=metric_prefix, scope_info_enabled=False,
                                              registry=self.registry)
        views = [
            View(instrument_name="*_duration_seconds",
                 aggregation=ExplicitBucketHistogramAggregation(_LATENCY_BUCKETS)),
        ]
        self._meter_provider = MeterProvider(resource=resource, metric_readers=[self._reader], views=views)
        self._tracer_provider = TracerProvider(resource=resource)
        if span_exporter is not None:
            self.add_span_processor(SimpleSpanProcessor(span_exporter))
        self.tracer: Tracer = self._tracer_provider.get_tracer(self.scope)
        self._meter = self._meter_provider.get_meter(self.scope)
        self._names: set[str] = set()
        self._names_lock = threading.Lock()
        self.prepare_total = self._meter.create_counter(
            self._name("prepare_claims"), description="Claims prepared, by result (success or error)")
        self.prepare_duration = self._meter.create_histogram(
            self._name("prepare_claim_duration_seconds"), unit="s", description="Time to prepare one claim")
        self.unprepare_total = self._meter.create_counter(
            self._name("unprepare_claims"), description="Claims unprepared, by result (success or error)")
        self.unprepare_duration = self._meter.create_histogram(
            self._name("unprepare_claim_duration_seconds"), unit="s", description="Time to unprepare one claim")
        self.slice_sync_total = self._meter.create_counter(
            self._name("resourceslice_syncs"), description="ResourceSlice publishing rounds, by result")

    def add_span_processor(self, processor: SpanProcessor) -> None:
        """Hand every span from now on to ``processor`` (e.g. a ``BatchSpanProcessor`` with an exporter)."""
        self._tracer_provider.add_span_processor(processor)

    def observe_gauge(self, name: str, description: str, read: Callable[[], float]) -> None:
        """Register a gauge whose value is read at scrape time (e.g. prepared claims)."""
        self.observe_labelled(name, description, lambda: [(read(), {})])

    def observe_labelled(self, name: str, description: str, read: Callable[[], Observations], *,
                         counter: bool = False) -> None:
        """Register a gauge (or a monotonic counter) with one series per label set, read at scrape time.

        A reading that raises is logged and leaves only its own metric off the scrape.
        """

        def _callback(_options: CallbackOptions) -> Iterable[Observation]:
            try:
                return [Observation(value, dict(labels)) for value, labels in read()]
            except Exception:  # one broken reading must not take the other metrics off the scrape
                log.exception("reading a metric failed", extra={"metric": name})
                return []

        if counter:
            self._meter.create_observable_counter(self._name(name), callbacks=[_callback], description=description)
        else:
            self._meter.create_observable_gauge(self._name(name), callbacks=[_callback], description=description)

    def render_metrics(self) -> bytes:
        """Every metric in the Prometheus text format (:data:`CONTENT_TYPE`)."""
        return bytes(generate_latest(self.registry))

    def shutdown(self) -> None:
        self._meter_provider.shutdown()
        self._tracer_provider.shutdown()

    def _name(self, name: str) -> str:
        # The SDK only warns about a second instrument of the same name and keeps the first one's readings.
        with self._names_lock:
            if name in self._names:
                raise ValueError(f"metric {name} is registered twice")
            self._names.add(name)
        return name
