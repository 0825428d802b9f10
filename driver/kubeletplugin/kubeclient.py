"""Talking to the Kubernetes API server: a small HTTP client, the server version, raw JSON requests and watches.

Every request is plain JSON over kept-alive HTTP/1.1 connections (:mod:`.httpconn`, a small pool per
client). The driver needs a handful of requests (a claim GET per prepare, pods for tenancy,
ResourceSlices, Events, ``/version``), all with raw JSON: typed clients validate bodies against their
own models and drop fields they do not know, which silently loses data a newer server has. The
``kubernetes`` package is not used: importing it costs ~0.45 s of CPU and ~35 MiB, and its REST layer
(urllib3) took twice the CPU of ``http.client`` per claim read, which took three times this module's
(docs/benchmarks.md).

Retries: a connection that could not be made is tried twice more (0.2 s, then 0.4 s later); a request
that was sent is never repeated, except a GET whose kept-alive connection turned out to be closed by the
server before any answer came. The callers have their own retry loops (the kubelet retries prepares, the
publisher backs off), so their timeouts must mean what they say.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import select
import socket
import ssl
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, NamedTuple
from urllib.parse import urlencode, urlsplit

from driver.kubeletplugin.httpconn import Connection, Head, ServerClosed
from driver.kubeletplugin.kubeconfig import ClusterAccess, load_access
from driver.kubeletplugin.kubeconfig import KubeConfigError as KubeConfigError
from driver.kubeletplugin.slicelimits import FALLBACK_MINOR_VERSION

log = logging.getLogger(__name__)

_MINOR = re.compile(r"[0-9]+")
CONNECT_RETRIES = 2
_RETRY_BACKOFF_S = 0.2
# Idle connections kept per client: the kubelet sends a few prepares at once, each reads its claim.
MAX_IDLE_CONNECTIONS = 8
# What a kept-alive connection the server has closed in the meantime fails with, before any answer.
_DROPPED = (ServerClosed, ConnectionResetError, BrokenPipeError)


class KubeApiError(Exception):
    """A request failed: the server answered an error status, or it could not be reached.

    ``status`` is the HTTP status, or 0 when no answer came back. ``reason`` and ``message``
    come from the Kubernetes ``Status`` body when there is one.
    """

    def __init__(self, status: int, reason: str, message: str):
        super().__init__(f"{status} {reason}: {message}" if status else f"{reason}: {message}")
        self.status = status
        self.reason = reason
        self.message = message


class Response(NamedTuple):
    """A whole answer: status, reason phrase and body."""

    status: int
    reason: str
    data: bytes


class KubeClient:
    """Requests to one API server; thread-safe (each request has a connection of its own while it runs)."""

    def __init__(self, access: ClusterAccess, *, connect_retries: int = CONNECT_RETRIES,
                 max_idle: int = MAX_IDLE_CONNECTIONS):
        url = urlsplit(access.server)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise KubeConfigError(f"API server {access.server!r} is not an http(s) URL")
        self._access = access
        self._host = url.hostname
        self._port = url.port or (443 if url.scheme == "https" else 80)
        self._prefix = url.path.rstrip("/")
        self._tls = access.ssl_context() if url.scheme == "https" else None
        self._connect_retries = connect_retries
        self._max_idle = max_idle
        self._idle: list[Connection] = []
        self._lock = threading.Lock()

    @property
    def server(self) -> str:
        return self._access.server

    def request(self, method: str, path: str, *, query: Sequence[tuple[str, str]] = (), body: bytes | None = None,
                timeouts: tuple[float, float]) -> Response:
        """One request; the whole answer. ``timeouts`` is (connect, read) in seconds. Raises KubeApiError
        (status 0) when no answer came back."""
        target = self._target(path, query)
        headers = self._headers(body is not None)
        for attempt in (1, 2):
            conn, reused = self._connection(method, path, timeouts)
            try:
                conn.send(method, target, headers, body)
                head = conn.read_head()
                data = conn.read_body(head)
            except _DROPPED as err:
                conn.close()
                if reused and method == "GET" and attempt == 1:
                    continue  # the server closed the idle connection before this request reached it
                raise KubeApiError(0, "ConnectionError", f"{method} {path}: {_describe(err)}") from err
            except OSError as err:  # timeouts and HttpProtocolError included
                conn.close()
                raise KubeApiError(0, "ConnectionError", f"{method} {path}: {_describe(err)}") from err
            if head.keep_alive:
                self._give_back(conn)
            else:
                conn.close()
            return Response(head.status, head.reason, data)
        raise AssertionError("unreachable: the second attempt returns or raises")

    def open_stream(self, path: str, *, query: Sequence[tuple[str, str]],
                    timeouts: tuple[float, float]) -> tuple[Connection, Head]:
        """A GET whose answer is read as it comes (a watch), on a connection of its own that the caller closes."""
        try:
            conn = self._connect(timeouts)
        except OSError as err:
            raise KubeApiError(0, "ConnectionError", f"GET {path}: {_describe(err)}") from err
        try:
            conn.send("GET", self._target(path, query), self._headers(False), None)
            return conn, conn.read_head()
        except OSError as err:
            conn.close()
            raise KubeApiError(0, "ConnectionError", f"GET {path}: {_describe(err)}") from err

    def close(self) -> None:
        """Close the idle connections (requests still work afterwards: they open new ones)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _target(self, path: str, query: Sequence[tuple[str, str]]) -> str:
        return self._prefix + path + ("?" + urlencode(list(query)) if query else "")

    def _headers(self, with_body: bool) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if with_body:
            headers["Content-Type"] = "application/json"
        token = self._access.token()  # asked on every request: a rotated service-account token is picked up
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _connection(self, method: str, path: str, timeouts: tuple[float, float]) -> tuple[Connection, bool]:
        """An idle connection the server has not closed, or a new one; and whether it was reused."""
        while True:
            with self._lock:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                try:
                    return self._connect(timeouts), False
                except OSError as err:
                    raise KubeApiError(0, "ConnectionError", f"{method} {path}: {_describe(err)}") from err
            if not _readable(conn.sock):
                conn.settimeout(timeouts[1])
                return conn, True
            conn.close()  # readable while idle: the server closed it (or sent something unasked)

    def _connect(self, timeouts: tuple[float, float]) -> Connection:
        connect_timeout, read_timeout = timeouts
        for attempt in range(self._connect_retries + 1):
            try:
                conn = Connection(self._host, self._port, tls=self._tls, timeout=connect_timeout)
            except ssl.SSLError:
                raise  # a certificate problem does not go away by trying again
            except OSError:
                if attempt == self._connect_retries:
                    raise
                time.sleep(_RETRY_BACKOFF_S * (attempt + 1))
                continue
            conn.settimeout(read_timeout)
            return conn
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _give_back(self, conn: Connection) -> None:
        with self._lock:
            if len(self._idle) < self._max_idle:
                self._idle.append(conn)
                return
        conn.close()


def _readable(sock: socket.socket) -> bool:
    """Whether an idle connection has something to read: the server closed it (EOF) or broke the protocol."""
    poller = select.poll()  # not select.select: it cannot take descriptors above 1023
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _describe(err: BaseException) -> str:
    if isinstance(err, TimeoutError | socket.timeout):
        return f"timed out ({err})"
    return str(err) or type(err).__name__


def load_api_client(kubeconfig: str | None) -> KubeClient:
    """A client from the kubeconfig file if one is given, else from the pod's service account."""
    return KubeClient(load_access(kubeconfig))


def plain_client(server: str, token: str | None = None) -> KubeClient:
    """A client for an ``http://`` server (tests and the API server double), with an optional bearer token."""
    return KubeClient(ClusterAccess(server=server.rstrip("/"), token=lambda: token))


def parse_minor_version(minor: str) -> int | None:
    """The number in a ``/version`` ``minor`` field: "36" and "36+" (managed clusters) give 36."""
    match = _MINOR.match(minor.strip())  # a prefix: "36+" is 36
    return int(match.group(0)) if match else None


def server_minor_version(api: KubeClient) -> int:
    """The server's Kubernetes minor version from GET /version; 34 (the oldest supported) if unknown."""
    try:
        answer = request_json(api, "GET", "/version", timeout=10.0)
    except KubeApiError as err:
        log.warning("cannot read the API server version, assuming Kubernetes 1.%d limits",
                    FALLBACK_MINOR_VERSION, extra={"error": str(err)})
        return FALLBACK_MINOR_VERSION
    minor = parse_minor_version(str(answer.get("minor", "")))
    if str(answer.get("major", "")).strip() != "1" or minor is None:
        log.warning("unexpected API server version, assuming Kubernetes 1.%d limits", FALLBACK_MINOR_VERSION,
                    extra={"major": answer.get("major"), "minor": answer.get("minor")})
        return FALLBACK_MINOR_VERSION
    return minor


def send(api: KubeClient, method: str, path: str, *, query: Sequence[tuple[str, str]] = (),
         body: dict[str, Any] | None = None, timeouts: tuple[float, float]) -> Response:
    """One request with a JSON body (if any); the whole answer, whatever its status. Raises KubeApiError
    (status 0) when no answer came back. ``timeouts`` is (connect, read) in seconds."""
    payload = json.dumps(body).encode() if body is not None else None
    return api.request(method, path, query=query, body=payload, timeouts=timeouts)


def request_json(api: KubeClient, method: str, path: str, *,
                 query: Sequence[tuple[str, str]] = (), body: dict[str, Any] | None = None,
                 timeout: float = 30.0) -> dict[str, Any]:
    """One request with a JSON body (if any); the answer's JSON object. Raises KubeApiError."""
    response = send(api, method, path, query=query, body=body, timeouts=_timeouts(timeout))
    if not 200 <= response.status <= 299:
        raise _error_from_answer(method, path, response.status, response.data)
    try:
        decoded = json.loads(response.data) if response.data else {}
    except ValueError as err:
        raise KubeApiError(response.status, "BadResponse", f"{method} {path}: answer is not JSON: {err}") from err
    if not isinstance(decoded, dict):
        raise KubeApiError(response.status, "BadResponse", f"{method} {path}: answer is not a JSON object")
    return decoded


def _timeouts(timeout: float) -> tuple[float, float]:
    read_timeout = float(timeout)
    return min(10.0, read_timeout), read_timeout


class JsonLineStream:
    """An open streaming answer (a watch) read as one JSON object per line.

    ``interrupt()`` may be called from another thread to end a blocked read promptly.
    """

    def __init__(self, conn: Connection, head: Head):
        self._conn = conn
        self._head = head

    def __iter__(self) -> Iterator[dict[str, Any]]:
        buffer = b""
        try:
            for data in self._conn.chunks() if self._head.chunked else self._conn.read_available():
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield _decode_event(line)
        except (OSError, ValueError) as err:
            # ValueError: the stream was closed under the reader (interrupt, then close).
            raise KubeApiError(0, "ConnectionError", f"stream ended: {_describe(err)}") from err

    def interrupt(self) -> None:
        """Wake a reader blocked on this stream; a no-op once the stream was closed or has ended."""
        # Shutting the socket down wakes a reader blocked in recv (plain or TLS); close() alone can wait
        # for that reader. On a socket already closed it fails, which means nothing is blocked.
        with contextlib.suppress(OSError):
            self._conn.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._conn.close()


def open_json_lines(api: KubeClient, path: str, *, query: Sequence[tuple[str, str]],
                    timeout: float) -> JsonLineStream:
    """Start a streaming GET (``watch=true``); ``timeout`` bounds each read, not the whole stream."""
    conn, head = api.open_stream(path, query=query, timeouts=_timeouts(timeout))
    if not 200 <= head.status <= 299:
        try:
            data = conn.read_body(head)
        except OSError:
            data = b""
        conn.close()
        raise _error_from_answer("GET", path, head.status, data)
    return JsonLineStream(conn, head)


def _error_from_answer(method: str, path: str, status: int, data: bytes) -> KubeApiError:
    reason, message = "", ""
    try:
        body = json.loads(data)
        if isinstance(body, dict):
            reason, message = str(body.get("reason", "")), str(body.get("message", ""))
    except ValueError:
        message = data[:500].decode("utf-8", errors="replace")
    return KubeApiError(status, reason or "Error", message or f"{method} {path} answered HTTP {status}")


def _decode_event(line: bytes) -> dict[str, Any]:
    try:
        event = json.loads(line)
    except ValueError as err:
        raise KubeApiError(0, "BadResponse", f"watch event is not JSON: {err}") from err
    if not isinstance(event, dict):
        raise KubeApiError(0, "BadResponse", "watch event is not a JSON object")
    return event
