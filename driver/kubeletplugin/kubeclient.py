"""Talking to the Kubernetes API server: client setup, server version, and raw JSON requests.

The client is the ``kubernetes`` package's ``ApiClient``: its configuration loading (a kubeconfig file
or the pod's service account), TLS, authentication and token rotation (``refresh_api_key_hook``),
and its REST layer (``ApiClient.rest_client``: the urllib3 pool, TLS settings and retries). Requests
go through that REST layer with plain dict bodies and raw JSON answers. The ``kubernetes`` 37.x
client's typed methods would validate bodies against its own models (rejecting fields it does not
know) and drop unknown fields when reading, which silently loses data a newer server has; raw JSON
keeps every field. Retries: :func:`request_retries`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import re
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from typing import Any, NamedTuple
from urllib.parse import urlencode

import urllib3
from kubernetes import client, config

from driver.kubeletplugin.slicelimits import FALLBACK_MINOR_VERSION

log = logging.getLogger(__name__)

_MINOR = re.compile(r"[0-9]+")

# The client every request goes through: the kubernetes package's own.
KubeClient = client.ApiClient


class KubeConfigError(Exception):
    """Neither a kubeconfig file nor the in-cluster service account could be used."""


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


def request_retries() -> urllib3.Retry:
    """Retry a connection that could not be made, and nothing else.

    urllib3's default (``Retry(3)``) also retries read timeouts, so a request to a hung API server
    would take four read timeouts. A request that was sent is never repeated here: the callers
    have their own retry loops (the kubelet retries prepares, the publisher backs off) and their
    timeouts must mean what they say. A redirect is returned as it is, to be reported as an error.
    """
    return urllib3.Retry(total=2, connect=2, read=0, status=0, other=0, redirect=0, raise_on_redirect=False,
                         backoff_factor=0.2)


def load_api_client(kubeconfig: str | None) -> KubeClient:
    """An ApiClient from the kubeconfig file if one is given, else from the pod's service account.

    Its requests retry only failed connection attempts (:func:`request_retries`).
    """
    configuration = client.Configuration()
    if kubeconfig:
        try:
            config.load_kube_config(  # type: ignore[no-untyped-call]
                config_file=kubeconfig, client_configuration=configuration)
        except (OSError, config.ConfigException, ValueError) as err:
            raise KubeConfigError(f"cannot use kubeconfig {kubeconfig}: {err}") from err
    else:
        try:
            config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
        except config.ConfigException as err:
            raise KubeConfigError(
                "no kubeconfig given and not running in a pod with a service account "
                f"({err}); pass --kubeconfig or run the driver in the cluster") from err
    configuration.retries = request_retries()
    return client.ApiClient(configuration)


def plain_client(server: str, token: str | None = None) -> KubeClient:
    """An ApiClient for an ``http://`` server (tests and the API server double), with an optional bearer
    token; its requests retry as :func:`load_api_client`'s do."""
    configuration = client.Configuration(host=server.rstrip("/"))
    if token:
        configuration.api_key = {"BearerToken": token}
        configuration.api_key_prefix = {"BearerToken": "Bearer"}
    configuration.retries = request_retries()
    return client.ApiClient(configuration)


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


JSON = "application/json"
# Server-side apply: the body is YAML, of which JSON is a subset.
APPLY_PATCH = "application/apply-patch+yaml"
# An object's (or a list's) metadata only, whatever else the object carries (a Node's images, say).
METADATA_ONLY = "application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1"
METADATA_LIST_ONLY = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1"


def send(api: KubeClient, method: str, path: str, *, query: Sequence[tuple[str, str]] = (),
         body: dict[str, Any] | None = None, timeouts: tuple[float, float], content_type: str = JSON,
         accept: str = JSON) -> Response:
    """One request with a JSON body (if any); the whole answer, whatever its status. Raises KubeApiError
    (status 0) when no answer came back. ``timeouts`` is (connect, read) in seconds."""
    response = _open(api, method, path, query=query, body=body, timeouts=timeouts, content_type=content_type,
                     accept=accept)
    try:
        data = response.read()
    except (urllib3.exceptions.HTTPError, OSError) as err:
        raise KubeApiError(0, "ConnectionError", f"{method} {path}: reading the answer failed: {err}") from err
    finally:
        response.release_conn()
    return Response(response.status, str(response.reason or ""), bytes(data))


def request_json(api: KubeClient, method: str, path: str, *,
                 query: Sequence[tuple[str, str]] = (), body: dict[str, Any] | None = None,
                 timeout: float = 30.0, content_type: str = JSON, accept: str = JSON) -> dict[str, Any]:
    """One request with a JSON body (if any); the answer's JSON object. Raises KubeApiError."""
    response = send(api, method, path, query=query, body=body, timeouts=_timeouts(timeout),
                    content_type=content_type, accept=accept)
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

    def __init__(self, response: urllib3.HTTPResponse):
        self._response = response

    def __iter__(self) -> Iterator[dict[str, Any]]:
        buffer = b""
        try:
            for chunk in self._response.stream(amt=None, decode_content=True):
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    if line.strip():
                        yield _decode_event(line)
        except (urllib3.exceptions.HTTPError, OSError, ValueError) as err:
            # ValueError: the stream was closed under the reader (interrupt, then close).
            raise KubeApiError(0, "ConnectionError", f"stream ended: {err}") from err

    def interrupt(self) -> None:
        """Wake a reader blocked on this stream; a no-op once the stream was closed or has ended."""
        # Shutting the socket down wakes a reader blocked in recv (plain or TLS); close() alone
        # can wait for that reader. urllib3 raises ValueError after close() and RuntimeError once
        # a finished stream gave its connection back to the pool: both mean nothing is blocked.
        with contextlib.suppress(OSError, AttributeError, ValueError, RuntimeError):
            self._response.shutdown()

    def close(self) -> None:
        self._response.close()
        self._response.release_conn()


def open_json_lines(api: KubeClient, path: str, *, query: Sequence[tuple[str, str]],
                    timeout: float, accept: str = JSON) -> JsonLineStream:
    """Start a streaming GET (``watch=true``); ``timeout`` bounds each read, not the whole stream."""
    response = _open(api, "GET", path, query=query, body=None, timeouts=_timeouts(timeout), content_type=JSON,
                     accept=accept)
    if not 200 <= response.status <= 299:
        try:
            data = response.read()
        except (urllib3.exceptions.HTTPError, OSError):
            data = b""
        finally:
            response.release_conn()
        raise _error_from_answer("GET", path, response.status, data)
    return JsonLineStream(response)


def _open(api: KubeClient, method: str, path: str, *, query: Sequence[tuple[str, str]],
          body: dict[str, Any] | None, timeouts: tuple[float, float], content_type: str,
          accept: str) -> urllib3.HTTPResponse:
    """One request through the client's REST layer (its connection pool, TLS and retries); the answer unread.

    Headers are built here rather than by ``ApiClient.param_serialize``, whose generic parameter
    sanitising cost more CPU than the rest of a claim read (docs/benchmarks.md); the token still
    comes from ``Configuration.auth_settings()`` on every request (which calls the configuration's
    ``refresh_api_key_hook``), so a rotated service-account token is picked up as the client would.
    """
    headers = dict(api.default_headers)
    headers["Accept"] = accept
    if body is not None:
        headers["Content-Type"] = content_type
    if api.cookie:
        headers["Cookie"] = api.cookie
    bearer = api.configuration.auth_settings().get("BearerToken")
    if bearer and bearer.get("value"):
        headers[str(bearer["key"])] = str(bearer["value"])
    url = api.configuration.host + path
    if query:
        url += "?" + urlencode(list(query))
    for attempt in (1, 2):
        try:
            answer = api.rest_client.request(  # type: ignore[no-untyped-call]
                method, url, headers=headers, body=body, _request_timeout=timeouts)
            break
        except urllib3.exceptions.HTTPError as err:
            if attempt == 1 and method == "GET" and _closed_before_answering(err):
                continue
            raise KubeApiError(0, "ConnectionError", f"{method} {path}: {err}") from err
        except client.ApiException as err:
            raise KubeApiError(int(err.status or 0), str(err.reason or "Error"), f"{method} {path}") from err
    response: urllib3.HTTPResponse = answer.response
    return response


def _closed_before_answering(err: urllib3.exceptions.HTTPError) -> bool:
    """Whether the server closed the connection without a byte of answer: a kept-alive connection it had
    just closed for idleness (urllib3 checks a pooled connection before reuse, but the close can come a
    moment after). A GET is sent again once on a new connection; a read timeout is not this, and is not
    repeated (:func:`request_retries`)."""
    reason = err.reason if isinstance(err, urllib3.exceptions.MaxRetryError) else err
    if not isinstance(reason, urllib3.exceptions.ProtocolError):
        return False
    cause = reason.args[1] if len(reason.args) > 1 else None
    return isinstance(cause, http.client.RemoteDisconnected | ConnectionResetError)


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


def api_time(moment: datetime | None = None) -> str:
    """``moment`` (default: now) as the Kubernetes API writes times: RFC 3339 in UTC, to the second."""
    return (moment or datetime.now(UTC)).astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
