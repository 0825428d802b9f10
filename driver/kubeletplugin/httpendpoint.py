"""The plugin's HTTP port: ``/healthz``, ``/readyz`` (or any plain-text routes) and ``/metrics``.

Served from the first moments of the process, before the driver has initialised, so the kubelet's
probes get an answer (``/readyz`` says not ready) instead of a refused connection; ``/metrics``
answers 503 until the telemetry is attached (:meth:`RouteServer.serve_metrics`).

The port is reachable from the pod network, so requests are parsed by the standard library's
``http.server`` (``ThreadingHTTPServer``: one daemon thread per connection), not by hand.
"""

from __future__ import annotations

import errno
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

log = logging.getLogger(__name__)

Route = Callable[[], tuple[int, str]]

# A client that connects and then stalls holds a server thread until this passes.
DEFAULT_CONNECTION_TIMEOUT_S = 10.0
# How long a route's answer is reused. Probes and scrapers may come often (or a flood of
# requests from anything that can reach the port); each liveness check dials both gRPC sockets,
# so at most one check runs per this interval whatever the request rate.
DEFAULT_ROUTE_CACHE_S = 1.0
# What binding an IPv6 socket fails with on a machine (or pod) without IPv6.
_NO_IPV6_ERRNOS = frozenset({errno.EAFNOSUPPORT, errno.EADDRNOTAVAIL, errno.EPROTONOSUPPORT})
_TEXT = "text/plain; charset=utf-8"


class RouteServer:
    """Plain-text routes and ``/metrics`` on one port, served by ``http.server`` on a daemon thread."""

    def __init__(self, host: str, port: int, routes: Mapping[str, Route], *,
                 connection_timeout_s: float = DEFAULT_CONNECTION_TIMEOUT_S,
                 route_cache_s: float = DEFAULT_ROUTE_CACHE_S):
        """``host`` ``"::"`` listens on IPv6 and IPv4 alike, or on IPv4 only (``0.0.0.0``) where the
        machine has no IPv6. A connection idle for ``connection_timeout_s`` is closed. Each route's
        answer is reused for ``route_cache_s`` (:class:`CachedRoute`); their text is sent as is, so it
        must not name host paths (the port is reachable from the pod network)."""
        self._routes = {path: CachedRoute(route, route_cache_s) for path, route in routes.items()}
        # The renderer of /metrics and its content type, once the telemetry exists (serve_metrics).
        self._metrics: tuple[Callable[[], bytes], str] | None = None
        self._server = _bind(host, port, self._handler(connection_timeout_s))
        self._server.daemon_threads = True
        # A short poll interval keeps shutdown() prompt.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="metrics-http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound port (useful when 0 was asked for)."""
        return int(self._server.server_address[1])

    def serve_metrics(self, render: Callable[[], bytes], content_type: str) -> None:
        """Answer ``/metrics`` with ``render()`` from now on."""
        self._metrics = (render, content_type)

    def shutdown(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def _route(self, path: str) -> tuple[int, str, bytes]:
        metrics = self._metrics
        if path == "/metrics" and metrics is not None:
            render, content_type = metrics
            return 200, content_type, render()
        if path == "/metrics":
            return 503, _TEXT, b"metrics are not available yet: the plugin is starting\n"
        if path in self._routes:
            status, text = self._routes[path]()
            return status, _TEXT, text.encode()
        return 404, _TEXT, b"not found\n"

    def _handler(self, connection_timeout_s: float) -> type[BaseHTTPRequestHandler]:
        server = self

        class _Handler(BaseHTTPRequestHandler):
            # Applied to each connection's socket by StreamRequestHandler.
            timeout = connection_timeout_s

            def do_GET(self) -> None:
                status, content_type, body = server._route(self.path.split("?", 1)[0])
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                # Scrapes every few seconds would drown the driver's own log.
                return

        return _Handler


class CachedRoute:
    """A route whose answer is computed at most once per ``ttl_s``, however many requests come.

    Requests that arrive while the answer is being computed wait for it instead of starting
    their own. A route that raises answers 500 without details (the exception is logged).
    ``clock`` is injectable for tests.
    """

    def __init__(self, route: Route, ttl_s: float, clock: Callable[[], float] = time.monotonic):
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


class _HTTPServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        # socketserver prints a traceback to stderr for any exception in a handler: a scraper that hangs up
        # mid-answer, or a client sending garbage to a port reachable from the pod network. Neither is the
        # driver's fault; one debug line says what happened.
        log.debug("an HTTP client went away or sent what could not be answered",
                  extra={"client": str(client_address), "error": repr(sys.exc_info()[1])})


class _DualStackHTTPServer(_HTTPServer):
    """Listens on IPv6 with IPv4 mapped in, so ``::`` also accepts IPv4 clients."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        # Linux defaults to dual-stack, but net.ipv6.bindv6only (and other systems) may not.
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _bind(host: str, port: int, handler: type[BaseHTTPRequestHandler]) -> ThreadingHTTPServer:
    if host == "::":
        try:
            return _DualStackHTTPServer((host, port), handler)
        except OSError as err:
            if err.errno not in _NO_IPV6_ERRNOS:
                raise
            log.warning("no IPv6 on this machine, serving HTTP on IPv4 only", extra={"port": port, "error": str(err)})
            host = "0.0.0.0"
    if ":" in host:
        return _DualStackHTTPServer((host, port), handler)
    return _HTTPServer((host, port), handler)
