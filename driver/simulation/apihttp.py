"""SIMULATION: the HTTP side of the API server double: routes, JSON bodies, chunked watch streams.

A ``PATCH`` with ``Content-Type: application/apply-patch+yaml`` is a server-side apply (its body YAML,
``fieldManager`` required, ``force`` optional); other patch types are refused with 415, as this double
does not implement them. ``Accept: application/json;as=PartialObjectMetadata;g=meta.k8s.io;v=v1`` (or
``PartialObjectMetadataList``) gets objects as their metadata only, as from a real server.
"""

from __future__ import annotations

import json
import re
import select
import socket
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler
from typing import Protocol
from urllib.parse import parse_qs, urlsplit

import yaml

from driver.simulation.apiobjects import (
    RESOURCES,
    ApiError,
    Obj,
    Resource,
    field_selector,
    label_selector,
    metadata_only,
)

DEFAULT_WATCH_SECONDS = 1800
APPLY_PATCH = "application/apply-patch+yaml"
ROUTES = (
    re.compile(r"^/api/v1/(?P<plural>nodes)(?:/(?P<name>[^/]+))?$"),
    re.compile(r"^/api/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>pods)(?:/(?P<name>[^/]+))?$"),
    re.compile(r"^/apis/resource\.k8s\.io/v1/(?P<plural>resourceslices|deviceclasses|resourceclaims)"
               r"(?:/(?P<name>[^/]+))?$"),
    re.compile(r"^/apis/events\.k8s\.io/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>events)(?:/(?P<name>[^/]+))?$"),
    re.compile(r"^/apis/resource\.k8s\.io/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>resourceclaims)"
               r"(?:/(?P<name>[^/]+)(?:/(?P<sub>status))?)?$"),
)


class ApiStore(Protocol):
    """What the HTTP side asks of the server double (``apiserver.FakeApiServer``): its objects and its request log."""

    @property
    def minor_version(self) -> int: ...

    def record_request(self, verb: str, path: str, query: dict[str, str] | None = None) -> None: ...

    def list_objects(self, plural: str, namespace: str | None, selector: Callable[[Obj], bool]) -> Obj: ...

    def create_object(self, plural: str, namespace: str, body: Obj) -> Obj: ...

    def get_object(self, plural: str, namespace: str, name: str) -> Obj: ...

    def replace_object(self, plural: str, namespace: str, name: str, body: Obj, *, keep_status: bool,
                       status_only: bool = False) -> Obj: ...

    def delete_object(self, plural: str, namespace: str, name: str, preconditions: Obj, *,
                      by_client: bool = True) -> Obj: ...

    def apply_status(self, plural: str, namespace: str, name: str, patch: Obj, *, manager: str,
                     force: bool) -> Obj: ...

    def watch_objects(self, plural: str, namespace: str | None, selector: Callable[[Obj], bool],
                      resource_version: str, timeout_s: float, write: Callable[[Obj], bool], *,
                      bookmarks: bool = False, shape: Callable[[Obj], Obj] = ...) -> None: ...


def handler_for(api: ApiStore) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in separate writes; with Nagle on, the body waits for the
        # client's delayed ACK (~40 ms per request on Linux), which a real API server never adds.
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: object) -> None:
            return

        def do_GET(self) -> None:
            self._serve(self.command)

        do_POST = do_PUT = do_DELETE = do_PATCH = do_GET

        def _serve(self, method: str) -> None:
            parts = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            watching = method == "GET" and query.get("watch") in ("true", "1")
            api.record_request("WATCH" if watching else method, parts.path, query)
            try:
                body = self._read_body()
                if watching:
                    self._stream_watch(parts.path, query)
                    return
                code, answer = self._dispatch(method, parts.path, query, body)
                if self._metadata_only() and code == 200:
                    answer = _as_metadata(answer)
            except ApiError as err:
                code, answer = err.code, err.status_body()
            self._send_json(code, answer)

        def _read_body(self) -> Obj:
            length = int(self.headers.get("Content-Length") or 0)
            if not length:
                return {}
            raw = self.rfile.read(length)
            try:
                body = yaml.safe_load(raw) if self._content_type() == APPLY_PATCH else json.loads(raw)
            except (ValueError, yaml.YAMLError) as err:
                raise ApiError(400, "BadRequest", f"request body is not {self._content_type()}: {err}") from err
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "request body must be a JSON object")
            return body

        def _content_type(self) -> str:
            return str(self.headers.get("Content-Type") or "").split(";")[0].strip()

        def _metadata_only(self) -> bool:
            return "as=PartialObjectMetadata" in str(self.headers.get("Accept") or "")

        def _send_json(self, code: int, answer: Obj) -> None:
            data = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, path: str) -> tuple[Resource, str | None, str | None, str | None]:
            for route in ROUTES:
                match = route.match(path)
                if match:
                    groups = match.groupdict()
                    resource = RESOURCES[groups["plural"]]
                    namespace = groups.get("ns")
                    if resource.namespaced and namespace is None and groups.get("name"):
                        break
                    return resource, namespace, groups.get("name"), groups.get("sub")
            raise ApiError(404, "NotFound", f"the server could not find the requested resource ({path})")

        def _dispatch(self, method: str, path: str, query: dict[str, str], body: Obj) -> tuple[int, Obj]:
            if path.rstrip("/") == "/version":
                if method != "GET":
                    raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on /version")
                return 200, {"major": "1", "minor": str(api.minor_version),
                             "gitVersion": f"v1.{api.minor_version}.0-fake", "gitCommit": "0" * 40,
                             "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
                             "goVersion": "go1.25.0", "compiler": "gc", "platform": "linux/amd64"}
            resource, namespace, name, sub = self._route(path)
            ns = namespace or ""
            read_only = resource.plural in ("nodes", "pods")  # tests put pods with put_pod
            if name is None:
                if method == "GET":
                    return 200, api.list_objects(resource.plural, namespace, self._selector(resource, query))
                if method == "POST" and not read_only and (namespace is not None or not resource.namespaced):
                    return 201, api.create_object(resource.plural, ns, body)
                if method == "DELETE" and resource.plural == "resourceslices":
                    listed = api.list_objects(resource.plural, None, self._selector(resource, query))
                    for item in listed["items"]:
                        api.delete_object(resource.plural, "", item["metadata"]["name"], preconditions={},
                                          by_client=False)
                    return 200, listed
            elif method == "GET":
                return 200, api.get_object(resource.plural, ns, name)
            elif method == "PUT" and not read_only:
                if sub == "status":
                    return 200, api.replace_object(resource.plural, ns, name, body, keep_status=False, status_only=True)
                return 200, api.replace_object(resource.plural, ns, name, body,
                                         keep_status=resource.plural == "resourceclaims")
            elif method == "PATCH" and not read_only and sub == "status":
                if self._content_type() != APPLY_PATCH:
                    raise ApiError(415, "UnsupportedMediaType", f"the body of the request was in an unknown format "
                                                                f"for this test double: {self._content_type()}")
                manager = query.get("fieldManager", "")
                if not manager:
                    raise ApiError(422, "Invalid", "metadata.managedFields.fieldManager: Required value: is required "
                                                   "for apply patch")
                return 200, api.apply_status(resource.plural, ns, name, body, manager=manager,
                                             force=query.get("force") == "true")
            elif method == "DELETE" and not read_only:
                return 200, api.delete_object(resource.plural, ns, name, preconditions=body.get("preconditions") or {})
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {path} by this test double")

        def _selector(self, resource: Resource, query: dict[str, str]) -> Callable[[Obj], bool]:
            by_field = field_selector(resource, query.get("fieldSelector", ""))
            by_label = label_selector(query.get("labelSelector", ""))
            return lambda obj: by_field(obj) and by_label(obj)

        def _stream_watch(self, path: str, query: dict[str, str]) -> None:
            resource, namespace, name, _ = self._route(path)
            if name is not None:
                raise ApiError(405, "MethodNotAllowed", "watch a collection with ?watch=true")
            selector = self._selector(resource, query)
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def write(event: Obj) -> bool:
                # An empty event is a liveness probe: nothing is sent, but a closed client is noticed.
                try:
                    if not event:
                        readable, _, _ = select.select([self.connection], [], [], 0)
                        return not (readable and not self.connection.recv(1, socket.MSG_PEEK))
                    line = json.dumps(event).encode() + b"\n"
                    self.wfile.write(f"{len(line):x}\r\n".encode() + line + b"\r\n")
                    self.wfile.flush()
                    return True
                except OSError:
                    return False

            timeout_s = float(query.get("timeoutSeconds") or DEFAULT_WATCH_SECONDS)
            api.watch_objects(resource.plural, namespace, selector, query.get("resourceVersion", ""), timeout_s, write,
                              bookmarks=query.get("allowWatchBookmarks") == "true",
                              shape=metadata_only if self._metadata_only() else lambda obj: obj)
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                pass
            self.close_connection = True

    return Handler


def _as_metadata(answer: Obj) -> Obj:
    """A GET's answer as metadata only: an object, or a list of them."""
    if "items" not in answer:
        return metadata_only(answer)
    return {"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadataList",
            "metadata": answer.get("metadata", {}), "items": [metadata_only(o) for o in answer["items"]]}
