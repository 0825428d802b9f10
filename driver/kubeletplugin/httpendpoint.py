"""The plugin's HTTP port: ``/healthz``, ``/readyz`` (or any plain-text routes) and ``/metrics``.

Served from the first moments of the process, before the driver has initialised, so the kubelet's
probes get an answer (``/readyz`` says not ready) instead of a refused connection; ``/metrics``
answers 503 until the telemetry is attached (:meth:`RouteServer.serve_metrics`).

A GET, its answer and the connection's end are all that probes and scrapers need, so this is plain
sockets: ``http.server`` brings ``http.client``, ``email`` and ``html`` along, ~10 ms on the
registration path and ~1 MiB for the life of the process (docs/benchmarks.md).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping

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
_MAX_REQUEST = 65536  # a probe's GET is a few hundred bytes
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error",
            503: "Service Unavailable"}


class RouteServer:
    """Plain-text routes and ``/metrics`` on one port; each connection answered on a daemon thread, then closed."""

    def __init__(self, host: str, port: int, routes: Mapping[str, Route], *,
                 connection_timeout_s: float = DEFAULT_CONNECTION_TIMEOUT_S,
                 route_cache_s: float = DEFAULT_ROUTE_CACHE_S):
        """``host`` ``"::"`` listens on IPv6 and IPv4 alike, or on IPv4 only (``0.0.0.0``) where the
        machine has no IPv6. A connection that sends no whole request within ``connection_timeout_s``
        is closed. Each route's answer is reused for ``route_cache_s`` (:class:`CachedRoute`); their
        text is sent as is, so it must not name host paths (the port is reachable from the pod network)."""
        self._routes = {path: CachedRoute(route, route_cache_s) for path, route in routes.items()}
        self._connection_timeout_s = connection_timeout_s
        # The renderer of /metrics and its content type, once the telemetry exists (serve_metrics).
        self._metrics: tuple[Callable[[], bytes], str] | None = None
        self._stopping = threading.Event()
        self._listener = _listen(host, port)
        # A short accept timeout keeps shutdown() prompt.
        self._listener.settimeout(0.05)
        self._thread = threading.Thread(target=self._accept, name="metrics-http", daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        """The bound port (useful when 0 was asked for)."""
        return int(self._listener.getsockname()[1])

    def serve_metrics(self, render: Callable[[], bytes], content_type: str) -> None:
        """Answer ``/metrics`` with ``render()`` from now on."""
        self._metrics = (render, content_type)

    def shutdown(self) -> None:
        self._stopping.set()
        self._thread.join()
        self._listener.close()

    def _accept(self) -> None:
        while not self._stopping.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._answer, args=(conn,), name="metrics-http-conn", daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn, contextlib.suppress(OSError):
            conn.settimeout(self._connection_timeout_s)
            request = b""
            while b"\r\n\r\n" not in request and b"\n\n" not in request:
                data = conn.recv(4096)
                if not data or len(request) > _MAX_REQUEST:
                    return  # gone, or not a probe's request
                request += data
            method, _, target = request.split(b"\r\n", 1)[0].decode("latin-1").partition(" ")
            status, content_type, body = self._route(method, target.split(" ", 1)[0].split("?", 1)[0])
            conn.sendall(f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\nContent-Type: {content_type}\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body)

    def _route(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method != "GET":
            return 405, _TEXT, b"only GET\n"
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


def _listen(host: str, port: int) -> socket.socket:
    if host == "::":
        try:
            sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        except OSError as err:
            if err.errno not in _NO_IPV6_ERRNOS:
                raise
            log.warning("no IPv6 on this machine, serving HTTP on IPv4 only", extra={"port": port, "error": str(err)})
            return _bound(socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("0.0.0.0", port))
        # Linux defaults to dual-stack, but net.ipv6.bindv6only (and other systems) may not.
        sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        try:
            return _bound(sock, (host, port))
        except OSError as err:
            if err.errno not in _NO_IPV6_ERRNOS:
                raise
            log.warning("no IPv6 on this machine, serving HTTP on IPv4 only", extra={"port": port, "error": str(err)})
            return _bound(socket.socket(socket.AF_INET, socket.SOCK_STREAM), ("0.0.0.0", port))
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return _bound(socket.socket(family, socket.SOCK_STREAM), (host, port))


def _bound(sock: socket.socket, address: tuple[str, int]) -> socket.socket:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(64)
    except BaseException:
        sock.close()
        raise
    return sock
