"""OpenTelemetry traces and metrics for a DRA plugin, with a Prometheus ``/metrics`` endpoint.

Everything lives on one :class:`Telemetry` object that the process creates once and passes
down; there is no module-level state, so tests can build as many as they like.
"""

from __future__ import annotations

import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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

# A client that connects and then stalls holds a server thread until this passes.
DEFAULT_CONNECTION_TIMEOUT_S = 10.0
# How long a health route's answer is reused. Probes and scrapers may come often (or a flood of
# requests from anything that can reach the port); each liveness check dials both gRPC sockets,
# so at most one check runs per this interval whatever the request rate.
DEFAULT_ROUTE_CACHE_S = 1.0
# What binding an IPv6 socket fails with on a machine (or pod) without IPv6.
_NO_IPV6_ERRNOS = frozenset({errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT})

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
        self._reader = PrometheusMetricReader(prefix=metric_prefix, registry=self.registry)
        views = [
            View(instrument_name="*_duration_seconds",
                 aggregation=ExplicitBucketHistogramAggregation(_LATENCY_BUCKETS)),
        ]
        self._meter_provider = MeterProvider(resource=resource, metric_readers=[self._reader], views=views)
        self._tracer_provider = TracerProvider(resource=resource)
        if span_exporter is not None:
            self.add_span_processor(SimpleSpanProcessor(span_exporter))
        self.tracer: Tracer = self._tracer_provider.get_tracer(self.scope)
        meter = self._meter_provider.get_meter(self.scope)
        self._meter = meter
        self.prepare_total = meter.create_counter(
            "prepare_claims", description="Claims prepared, by result (success or error)")
        self.prepare_duration = meter.create_histogram(
            "prepare_claim_duration_seconds", unit="s", description="Time to prepare one claim")
        self.unprepare_total = meter.create_counter(
            "unprepare_claims", description="Claims unprepared, by result (success or error)")
        self.unprepare_duration = meter.create_histogram(
            "unprepare_claim_duration_seconds", unit="s", description="Time to unprepare one claim")
        self.slice_sync_total = meter.create_counter(
            "resourceslice_syncs", description="ResourceSlice publishing rounds, by result")
        self._server: ThreadingHTTPServer | None = None

    def add_span_processor(self, processor: SpanProcessor) -> None:
        self._tracer_provider.add_span_processor(processor)

    def observe_gauge(self, name: str, description: str, read: Callable[[], float]) -> None:
        """Register a gauge whose value is read at scrape time (e.g. prepared claims)."""

        def _callback(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(read())]

        self._meter.create_observable_gauge(name, callbacks=[_callback], description=description)

    def observe_labelled(self, name: str, description: str,
                         read: Callable[[], Iterable[tuple[float, Mapping[str, str]]]], *,
                         counter: bool = False) -> None:
        """Register a gauge (or a monotonic counter) with one series per label set, read at scrape time."""

        def _callback(_options: CallbackOptions) -> Iterable[Observation]:
            return [Observation(value, dict(labels)) for value, labels in read()]

        if counter:
            self._meter.create_observable_counter(name, callbacks=[_callback], description=description)
        else:
            self._meter.create_observable_gauge(name, callbacks=[_callback], description=description)

    def render_metrics(self) -> bytes:
        return bytes(generate_latest(self.registry))

    def serve_metrics(self, host: str, port: int,
                      extra_routes: dict[str, Callable[[], tuple[int, str]]] | None = None, *,
                      connection_timeout_s: float = DEFAULT_CONNECTION_TIMEOUT_S,
                      route_cache_s: float = DEFAULT_ROUTE_CACHE_S) -> int:
        """Serve ``/metrics`` (and any extra routes, e.g. ``/healthz``) in a daemon thread.

        ``host`` ``"::"`` listens on IPv6 and IPv4 alike, or on IPv4 only (``0.0.0.0``) where the
        machine has no IPv6. A connection idle for ``connection_timeout_s`` is closed. Each extra
        route's answer is reused for ``route_cache_s`` (see :class:`CachedRoute`); their text is
        sent as is, so it must not name host paths (the port is reachable from the pod network).
        Returns the bound port
        (useful when ``port`` is 0).
        """
        routes = {path: CachedRoute(route, route_cache_s) for path, route in (extra_routes or {}).items()}
        telemetry = self

        class _Handler(BaseHTTPRequestHandler):
            # Applied to each connection's socket by StreamRequestHandler.
            timeout = connection_timeout_s

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    body, status, ctype = telemetry.render_metrics(), 200, CONTENT_TYPE_LATEST
                elif path in routes:
                    status, text = routes[path]()
                    body, ctype = text.encode(), "text/plain; charset=utf-8"
                else:
                    body, status, ctype = b"not found\n", 404, "text/plain; charset=utf-8"
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                # Scrapes every few seconds would drown the driver's own log.
                return

        server = _bind_http_server(host, port, _Handler)
        server.daemon_threads = True
        self._server = server
        # A short poll interval keeps shutdown() prompt.
        threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, name="metrics-http",
                         daemon=True).start()
        return int(server.server_address[1])

    def shutdown(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._meter_provider.shutdown()
        self._tracer_provider.shutdown()


class CachedRoute:
    """A route whose answer is computed at most once per ``ttl_s``, however many requests come.

    Requests that arrive while the answer is being computed wait for it instead of starting
    their own. A route that raises answers 500 without details (the exception is logged).
    ``clock`` is injectable for tests.
    """

    def __init__(self, route: Callable[[], tuple[int, str]], ttl_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._route = route
        self._ttl_s = ttl_s
        self._clock = clock
        self._lock = threading.Lock()
        self._answer: tuple[int, str] | None = None
        self._at = 0.0

    def __call__(self) -> tuple[int, str]:
        with self._lock:
            if self._answer is None or self._clock() - self._at >= self._ttl_s:
                try:
                    self._answer = self._route()
                except Exception:
                    # The exception may name host paths; the log is the place for them.
                    log.exception("HTTP health route failed")
                    self._answer = (500, "internal error; see the plugin log\n")
                self._at = self._clock()
            return self._answer


class _DualStackHTTPServer(ThreadingHTTPServer):
    """Listens on IPv6 with IPv4 mapped in, so ``::`` also accepts IPv4 clients."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        # Linux defaults to dual-stack, but net.ipv6.bindv6only (and other systems) may not.
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _bind_http_server(host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    if host == "::":
        try:
            return _DualStackHTTPServer((host, port), handler)
        except OSError as err:
            if err.errno not in _NO_IPV6_ERRNOS:
                raise
            log.warning("no IPv6 on this machine, serving HTTP on IPv4 only", extra={"port": port, "error": str(err)})
            host = "0.0.0.0"
    return ThreadingHTTPServer((host, port), handler)
