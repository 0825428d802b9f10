"""SIMULATION: a Kubernetes API server double for tests and the demo (not a real cluster), speaking real HTTP.

It serves just what a DRA node plugin and its tests use, well enough for the real
``kubernetes`` Python client end to end: ``/version``, Nodes (read), ResourceSlices (list,
watch, create with ``generateName``, get, replace, delete with preconditions, delete
collection), ResourceClaims (namespaced CRUD and ``/status``) and DeviceClasses. Objects are
kept as plain dicts, so no field is ever dropped unless a test asks for it
(``dropped_device_fields``, which imitates a server with a feature gate off).

ResourceSlice writes are checked like a real server checks them for the rules a driver most
often breaks, and answered with ``422 Invalid`` and a Kubernetes ``Status`` naming the field.

Tests drive it with helpers (``add_node``, ``slices``, ``put_claim``, ``wipe_slices``,
``reject_next_slice_writes``, ``expire_watch_history``) and inspect ``requests``: one
``(verb, path)`` per request, where verb is the HTTP method, or ``WATCH`` for a watch.

Manual use: ``python -m driver.simulation.apiserver --port 8001 [--node node-1]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import random
import re
import select
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from kubernetes import client

Obj = dict[str, Any]

_GROUP = "resource.k8s.io"
_RESOURCE_API = f"{_GROUP}/v1"
_NAME_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_MAX_GENERATE_NAME_BASE = 58
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_ATTRIBUTE_VALUE_FIELDS = ("int", "bool", "string", "version", "ints", "bools", "strings", "versions")
_NODE_SELECTION_FIELDS = ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
_WATCH_HISTORY = 10_000
_DEFAULT_WATCH_SECONDS = 1800


@dataclass(frozen=True)
class _Resource:
    plural: str
    kind: str
    api_version: str
    namespaced: bool
    field_labels: tuple[str, ...]


_RESOURCES = {
    r.plural: r for r in (
        _Resource("nodes", "Node", "v1", False, ("metadata.name",)),
        _Resource("resourceslices", "ResourceSlice", _RESOURCE_API, False,
                  ("metadata.name", "spec.driver", "spec.nodeName", "spec.pool.name")),
        _Resource("resourceclaims", "ResourceClaim", _RESOURCE_API, True, ("metadata.name", "metadata.namespace")),
        _Resource("deviceclasses", "DeviceClass", _RESOURCE_API, False, ("metadata.name",)),
    )
}
_ROUTES = (
    re.compile(r"^/api/v1/(?P<plural>nodes)(?:/(?P<name>[^/]+))?$"),
    re.compile(r"^/apis/resource\.k8s\.io/v1/(?P<plural>resourceslices|deviceclasses|resourceclaims)"
               r"(?:/(?P<name>[^/]+))?$"),
    re.compile(r"^/apis/resource\.k8s\.io/v1/namespaces/(?P<ns>[^/]+)/(?P<plural>resourceclaims)"
               r"(?:/(?P<name>[^/]+)(?:/(?P<sub>status))?)?$"),
)


class ApiError(Exception):
    """An error answer: HTTP status plus the Kubernetes ``Status`` reason and message."""

    def __init__(self, code: int, reason: str, message: str, causes: list[Obj] | None = None):
        super().__init__(message)
        self.code, self.reason, self.message, self.causes = code, reason, message, causes or []

    def status_body(self) -> Obj:
        body: Obj = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                     "message": self.message, "reason": self.reason, "code": self.code}
        if self.causes:
            body["details"] = {"causes": self.causes}
        return body


@dataclass
class _Event:
    rv: int
    plural: str
    type: str
    obj: Obj


class FakeApiServer:
    """In-memory API server on 127.0.0.1. Thread-safe: all state is guarded by one lock."""

    def __init__(self, minor_version: int = 36, *, dropped_device_fields: Iterable[str] = ()):
        self.minor_version = minor_version
        self.dropped_device_fields = tuple(dropped_device_fields)
        self._cond = threading.Condition()
        self._store: dict[str, dict[tuple[str, str], Obj]] = {plural: {} for plural in _RESOURCES}
        self._rv = 0
        self._events: list[_Event] = []
        self._oldest_watchable_rv = 0
        self._requests: list[tuple[str, str]] = []
        self._reject_writes = 0
        self._reject_status = (500, "InternalError", "")
        self._stopping = False
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # ----- lifecycle -------------------------------------------------------------------

    def start(self, port: int = 0) -> str:
        """Serve in a background thread; returns the base URL."""
        server = ThreadingHTTPServer(("127.0.0.1", port), _handler_for(self))
        server.daemon_threads = True
        self._server = server
        # A short poll interval makes stop() quick; tests start and stop many servers.
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="fake-apiserver", daemon=True)
        self._thread.start()
        return self.url

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("FakeApiServer is not started")
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def kube_config(self, path: str | Path) -> Path:
        """Write a kubeconfig pointing at this server (for a driver subprocess)."""
        target = Path(path)
        target.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "fake",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": "fake-token"}}],
            "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        }, indent=2))
        return target

    def api_client(self) -> client.ApiClient:
        return client.ApiClient(client.Configuration(host=self.url))

    # ----- test helpers ----------------------------------------------------------------

    @property
    def requests(self) -> list[tuple[str, str]]:
        with self._cond:
            return list(self._requests)

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> str:
        """Create a Node; returns its UID."""
        meta: Obj = {"name": name, "labels": dict(labels or {})}
        node = self._create("nodes", "", {"apiVersion": "v1", "kind": "Node", "metadata": meta})
        return str(node["metadata"]["uid"])

    def set_node_labels(self, name: str, labels: dict[str, str]) -> None:
        """Replace a Node's labels (as ``kubectl label`` would)."""
        node = self._get("nodes", "", name)
        node["metadata"]["labels"] = dict(labels)
        node["metadata"].pop("resourceVersion", None)
        self._replace("nodes", "", name, node, keep_status=True)

    def slices(self, driver: str | None = None, node: str | None = None) -> list[Obj]:
        """Stored ResourceSlices (copies), sorted by name."""
        with self._cond:
            found = [copy.deepcopy(s) for s in self._store["resourceslices"].values()
                     if (driver is None or s["spec"].get("driver") == driver)
                     and (node is None or s["spec"].get("nodeName") == node)]
        return sorted(found, key=lambda s: str(s["metadata"]["name"]))

    def put_claim(self, claim: Obj) -> Obj:
        """Create or replace a ResourceClaim, status included; returns it as stored.

        A given ``metadata.uid`` is kept. Putting a claim whose UID differs from the stored one
        deletes and recreates it, as when a user replaces a claim.
        """
        body = copy.deepcopy(claim)
        body.setdefault("apiVersion", _RESOURCE_API)
        body.setdefault("kind", "ResourceClaim")
        meta = body.setdefault("metadata", {})
        namespace = meta.setdefault("namespace", "default")
        with self._cond:
            existing = self._store["resourceclaims"].get((namespace, meta.get("name", "")))
            if existing is not None and meta.get("uid", existing["metadata"]["uid"]) == existing["metadata"]["uid"]:
                meta.pop("resourceVersion", None)
                return self._replace("resourceclaims", namespace, meta["name"], body, keep_status=False)
            if existing is not None:
                self._delete("resourceclaims", namespace, meta["name"], preconditions={})
            return self._create("resourceclaims", namespace, body)

    def delete_claim(self, namespace: str, name: str) -> None:
        self._delete("resourceclaims", namespace, name, preconditions={})

    def wipe_slices(self, node: str) -> int:
        """Delete every slice of a node, as the kubelet does; returns how many were deleted."""
        with self._cond:
            names = [s["metadata"]["name"] for s in self._store["resourceslices"].values()
                     if s["spec"].get("nodeName") == node]
            for name in names:
                self._delete("resourceslices", "", name, preconditions={}, by_client=False)
            return len(names)

    def reject_next_slice_writes(self, count: int, message: str = "injected failure", *,
                                 status: int = 500, reason: str = "InternalError") -> None:
        """Fail the next ``count`` ResourceSlice creates/updates/deletes with this answer."""
        with self._cond:
            self._reject_writes = count
            self._reject_status = (status, reason, message)

    def expire_watch_history(self) -> None:
        """Forget past events: watches from an older resourceVersion get 410 Gone."""
        with self._cond:
            self._events.clear()
            self._oldest_watchable_rv = self._rv

    # ----- storage (callers hold no lock; these take it) -------------------------------

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def _record(self, plural: str, event_type: str, obj: Obj) -> None:
        self._events.append(_Event(int(obj["metadata"]["resourceVersion"]), plural, event_type, copy.deepcopy(obj)))
        if len(self._events) > _WATCH_HISTORY:
            dropped = self._events.pop(0)
            self._oldest_watchable_rv = dropped.rv
        self._cond.notify_all()

    def _create(self, plural: str, namespace: str, body: Obj) -> Obj:
        resource = _RESOURCES[plural]
        obj = copy.deepcopy(body)
        _check_kind(resource, obj)
        meta = obj.setdefault("metadata", {})
        with self._cond:
            if not meta.get("name"):
                base = str(meta.get("generateName", ""))
                if not base:
                    raise _invalid(resource, "", [
                        ("metadata.name", "Required value: name or generateName is required")])
                meta["name"] = self._unique_name(plural, namespace, base)
            name = str(meta["name"])
            if (namespace, name) in self._store[plural]:
                raise ApiError(409, "AlreadyExists", f'{plural}.{_group_of(resource)} "{name}" already exists')
            if plural == "resourceslices":
                self._admit_slice(obj, old=None)
            if resource.namespaced:
                meta["namespace"] = namespace
            meta.setdefault("uid", str(uuid.uuid4()))
            meta["creationTimestamp"] = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
            meta["resourceVersion"] = str(self._next_rv())
            obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
            self._store[plural][(namespace, name)] = obj
            self._record(plural, "ADDED", obj)
            return copy.deepcopy(obj)

    def _unique_name(self, plural: str, namespace: str, base: str) -> str:
        base = base[:_MAX_GENERATE_NAME_BASE]
        while True:
            name = base + "".join(random.choice(_NAME_SUFFIX_ALPHABET) for _ in range(5))
            if (namespace, name) not in self._store[plural]:
                return name

    def _get(self, plural: str, namespace: str, name: str) -> Obj:
        resource = _RESOURCES[plural]
        with self._cond:
            obj = self._store[plural].get((namespace, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural}.{_group_of(resource)} "{name}" not found')
            return copy.deepcopy(obj)

    def _replace(self, plural: str, namespace: str, name: str, body: Obj, *, keep_status: bool,
                 status_only: bool = False) -> Obj:
        resource = _RESOURCES[plural]
        obj = copy.deepcopy(body)
        _check_kind(resource, obj)
        meta = obj.setdefault("metadata", {})
        if meta.get("name", name) != name:
            raise ApiError(400, "BadRequest", f'the name of the object ({meta.get("name")}) does not match the name '
                                              f"on the URL ({name})")
        with self._cond:
            old = self._store[plural].get((namespace, name))
            if old is None:
                raise ApiError(404, "NotFound", f'{plural}.{_group_of(resource)} "{name}" not found')
            sent_rv = meta.get("resourceVersion")
            if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {plural}.{_group_of(resource)} '
                                                f'"{name}": the object has been modified; please apply your changes '
                                                "to the latest version and try again")
            if status_only:
                new = copy.deepcopy(old)
                new["status"] = obj.get("status", {})
            else:
                new = obj
                if keep_status and "status" in old:
                    new["status"] = old["status"]
                elif keep_status:
                    new.pop("status", None)
                for key in ("uid", "creationTimestamp"):
                    new["metadata"][key] = old["metadata"][key]
                new["metadata"]["name"] = name
                if resource.namespaced:
                    new["metadata"]["namespace"] = namespace
            if plural == "resourceslices":
                self._admit_slice(new, old=old)
            new["apiVersion"], new["kind"] = resource.api_version, resource.kind
            new["metadata"]["resourceVersion"] = str(self._next_rv())
            self._store[plural][(namespace, name)] = new
            self._record(plural, "MODIFIED", new)
            return copy.deepcopy(new)

    def _delete(self, plural: str, namespace: str, name: str, preconditions: Obj, *, by_client: bool = True) -> Obj:
        resource = _RESOURCES[plural]
        with self._cond:
            old = self._store[plural].get((namespace, name))
            if old is None:
                raise ApiError(404, "NotFound", f'{plural}.{_group_of(resource)} "{name}" not found')
            for field, label in (("uid", "UID"), ("resourceVersion", "ResourceVersion")):
                wanted = preconditions.get(field)
                if wanted and wanted != old["metadata"][field]:
                    raise ApiError(409, "Conflict", f"Precondition failed: {label} in precondition: {wanted}, "
                                                    f"{label} in object meta: {old['metadata'][field]}")
            if plural == "resourceslices" and by_client:
                self._maybe_reject_write()
            del self._store[plural][(namespace, name)]
            gone = copy.deepcopy(old)
            gone["metadata"]["resourceVersion"] = str(self._next_rv())
            self._record(plural, "DELETED", gone)
            return gone

    def _list(self, plural: str, namespace: str | None, selector: Callable[[Obj], bool]) -> Obj:
        resource = _RESOURCES[plural]
        with self._cond:
            items = [copy.deepcopy(o) for (ns, _), o in sorted(self._store[plural].items())
                     if (namespace is None or ns == namespace) and selector(o)]
            return {"apiVersion": resource.api_version, "kind": resource.kind + "List",
                    "metadata": {"resourceVersion": str(self._rv)}, "items": items}

    def _maybe_reject_write(self) -> None:
        if self._reject_writes > 0:
            self._reject_writes -= 1
            code, reason, message = self._reject_status
            raise ApiError(code, reason, message)

    def _admit_slice(self, obj: Obj, old: Obj | None) -> None:
        self._maybe_reject_write()
        for device in obj.get("spec", {}).get("devices") or []:
            if isinstance(device, dict):
                for field in self.dropped_device_fields:
                    device.pop(field, None)
        errors = slice_errors(obj, old, self.minor_version)
        if errors:
            raise _invalid(_RESOURCES["resourceslices"], str(obj.get("metadata", {}).get("name", "")), errors)

    # ----- watch ------------------------------------------------------------------------

    def _watch(self, plural: str, namespace: str | None, selector: Callable[[Obj], bool],
               resource_version: str, timeout_s: float, write: Callable[[Obj], bool]) -> None:
        """Stream events until the timeout, the server stops, or the client goes away."""
        deadline = time.monotonic() + timeout_s

        def wanted(event: _Event) -> bool:
            ns = event.obj["metadata"].get("namespace", "")
            return event.plural == plural and (namespace is None or ns == namespace) and selector(event.obj)

        with self._cond:
            if resource_version in ("", "0"):
                cursor = self._rv
                initial = [_Event(cursor, plural, "ADDED", copy.deepcopy(o))
                           for (ns, _), o in sorted(self._store[plural].items())
                           if (namespace is None or ns == namespace) and selector(o)]
            else:
                cursor = int(resource_version)
                initial = []
                if cursor < self._oldest_watchable_rv:
                    expired = ApiError(410, "Expired", f"too old resource version: {cursor} "
                                                       f"({self._oldest_watchable_rv})").status_body()
                    write({"type": "ERROR", "object": expired})
                    return
        for event in initial:
            if not write({"type": event.type, "object": event.obj}):
                return
        while True:
            with self._cond:
                pending = [e for e in self._events if e.rv > cursor]
                if not pending and not self._stopping:
                    self._cond.wait(timeout=min(0.5, max(0.0, deadline - time.monotonic())))
                    pending = [e for e in self._events if e.rv > cursor]
                stopping = self._stopping
            for event in pending:
                cursor = event.rv
                if wanted(event) and not write({"type": event.type, "object": event.obj}):
                    return
            if stopping or time.monotonic() >= deadline:
                return
            if not pending and not write({}):
                return


def slice_errors(obj: Obj, old: Obj | None, minor_version: int) -> list[tuple[str, str]]:
    """(field, problem) pairs for the server-side ResourceSlice rules this double enforces."""
    errors: list[tuple[str, str]] = []
    spec = obj.get("spec")
    if not isinstance(spec, dict):
        return [("spec", "Required value")]
    if not spec.get("driver"):
        errors.append(("spec.driver", "Required value"))
    pool = spec.get("pool") or {}
    if not pool.get("name"):
        errors.append(("spec.pool.name", "Required value"))
    if int(pool.get("generation", 0)) < 0:
        errors.append(("spec.pool.generation", "Invalid value: must be greater than or equal to 0"))
    if int(pool.get("resourceSliceCount", 0)) <= 0:
        errors.append(("spec.pool.resourceSliceCount", "Invalid value: must be greater than zero"))
    selected = [f for f in _NODE_SELECTION_FIELDS if spec.get(f) not in (None, False, "")]
    if len(selected) != 1:
        errors.append(("spec", "Invalid value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
                               f"`perDeviceNodeSelection` is required (found {len(selected)})"))
    if old is not None:
        for path in (("driver",), ("pool", "name"), ("nodeName",)):
            if _dig(spec, path) != _dig(old["spec"], path):
                errors.append(("spec." + ".".join(path), "Invalid value: field is immutable"))
    devices = spec.get("devices") or []
    restricted = any(d.get("consumesCounters") or (d.get("taints") and minor_version >= 35)
                     or (minor_version >= 36 and any(k in a for a in (d.get("attributes") or {}).values()
                                                    for k in ("ints", "bools", "strings", "versions")))
                     for d in devices)
    limit = 64 if restricted and minor_version >= 35 else 128
    if len(devices) > limit:
        errors.append(("spec.devices", f"Too many: {len(devices)}: must have at most {limit} items"))
    seen: set[str] = set()
    for i, device in enumerate(devices):
        name = str(device.get("name", ""))
        field = f"spec.devices[{i}]"
        if not name:
            errors.append((field + ".name", "Required value"))
        elif len(name) > 63 or not _DNS_LABEL.match(name):
            errors.append((field + ".name", f'Invalid value: "{name}": a lowercase RFC 1123 label must consist of '
                                            "lower case alphanumeric characters or '-'"))
        elif name in seen:
            errors.append((field + ".name", f'Duplicate value: "{name}"'))
        seen.add(name)
        for key, value in (device.get("attributes") or {}).items():
            where = f"{field}.attributes[{key}]"
            present = [k for k in _ATTRIBUTE_VALUE_FIELDS if k in value]
            if len(present) != 1:
                errors.append((where, f"Invalid value: exactly one value must be specified (found {len(present)})"))
            if isinstance(value.get("string"), str) and len(value["string"].encode()) > 64:
                errors.append((where + ".string", "Too long: may not be more than 64 bytes"))
    return errors


def _dig(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        obj = obj.get(key) if isinstance(obj, dict) else None
    return obj


def _group_of(resource: _Resource) -> str:
    return _GROUP if "/" in resource.api_version else ""


def _check_kind(resource: _Resource, obj: Obj) -> None:
    kind = obj.get("kind")
    if kind and kind != resource.kind:
        raise ApiError(400, "BadRequest", f"the body kind {kind} does not match the resource kind {resource.kind}")


def _invalid(resource: _Resource, name: str, errors: list[tuple[str, str]]) -> ApiError:
    details = [f"{field}: {problem}" for field, problem in errors]
    message = f'{resource.kind}.{_group_of(resource)} "{name}" is invalid: ' + (
        details[0] if len(details) == 1 else "[" + ", ".join(details) + "]")
    causes = [{"reason": "FieldValueInvalid", "message": problem, "field": field} for field, problem in errors]
    return ApiError(422, "Invalid", message, causes)


def _field_selector(resource: _Resource, text: str) -> Callable[[Obj], bool]:
    """``a=b,c!=d`` on the resource's supported field labels."""
    terms: list[tuple[tuple[str, ...], str, bool]] = []
    for term in filter(None, text.split(",")):
        negate = "!=" in term
        key, _, value = term.partition("!=" if negate else "=")
        value = value.removeprefix("=")
        if key not in resource.field_labels:
            raise ApiError(400, "BadRequest", f'field label not supported: "{key}"')
        terms.append((tuple(key.split(".")), value, negate))
    return lambda obj: all((str(_dig(obj, path) or "") == value) != negate for path, value, negate in terms)


def _label_selector(text: str) -> Callable[[Obj], bool]:
    """Equality-based label selectors: ``a=b``, ``a!=b``, ``a``, ``!a``."""
    terms: list[tuple[str, str | None, bool]] = []
    for term in filter(None, (t.strip() for t in text.split(","))):
        if "!=" in term:
            key, _, value = term.partition("!=")
            terms.append((key, value, True))
        elif "=" in term:
            key, _, value = term.partition("=")
            terms.append((key, value.removeprefix("="), False))
        else:
            terms.append((term.removeprefix("!"), None, term.startswith("!")))

    def matches(obj: Obj) -> bool:
        labels = obj.get("metadata", {}).get("labels") or {}
        return all(
            ((key in labels) != negate) if value is None else ((labels.get(key) == value) != negate)
            for key, value, negate in terms)

    return matches


def _handler_for(api: FakeApiServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        # Headers and body go out in separate writes; with Nagle on, the body waits for the
        # client's delayed ACK (~40 ms per request on Linux), which a real API server never adds.
        disable_nagle_algorithm = True

        def log_message(self, format: str, *args: object) -> None:
            return

        def do_GET(self) -> None:
            self._serve("GET")

        def do_POST(self) -> None:
            self._serve("POST")

        def do_PUT(self) -> None:
            self._serve("PUT")

        def do_DELETE(self) -> None:
            self._serve("DELETE")

        def do_PATCH(self) -> None:
            self._serve("PATCH")

        def _serve(self, method: str) -> None:
            parts = urlsplit(self.path)
            query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
            watching = method == "GET" and query.get("watch") in ("true", "1")
            with api._cond:
                api._requests.append(("WATCH" if watching else method, parts.path))
            try:
                body = self._read_body()
                if watching:
                    self._stream_watch(parts.path, query)
                    return
                code, answer = self._dispatch(method, parts.path, query, body)
            except ApiError as err:
                code, answer = err.code, err.status_body()
            self._send_json(code, answer)

        def _read_body(self) -> Obj:
            length = int(self.headers.get("Content-Length") or 0)
            if not length:
                return {}
            try:
                body = json.loads(self.rfile.read(length))
            except ValueError as err:
                raise ApiError(400, "BadRequest", f"request body is not JSON: {err}") from err
            if not isinstance(body, dict):
                raise ApiError(400, "BadRequest", "request body must be a JSON object")
            return body

        def _send_json(self, code: int, answer: Obj) -> None:
            data = json.dumps(answer).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _route(self, path: str) -> tuple[_Resource, str | None, str | None, str | None]:
            for route in _ROUTES:
                match = route.match(path)
                if match:
                    groups = match.groupdict()
                    resource = _RESOURCES[groups["plural"]]
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
            read_only = resource.plural == "nodes"
            if name is None:
                if method == "GET":
                    return 200, api._list(resource.plural, namespace, self._selector(resource, query))
                if method == "POST" and not read_only and (namespace is not None or not resource.namespaced):
                    return 201, api._create(resource.plural, ns, body)
                if method == "DELETE" and resource.plural == "resourceslices":
                    listed = api._list(resource.plural, None, self._selector(resource, query))
                    for item in listed["items"]:
                        api._delete(resource.plural, "", item["metadata"]["name"], preconditions={}, by_client=False)
                    return 200, listed
            elif method == "GET":
                return 200, api._get(resource.plural, ns, name)
            elif method == "PUT" and not read_only:
                if sub == "status":
                    return 200, api._replace(resource.plural, ns, name, body, keep_status=False, status_only=True)
                return 200, api._replace(resource.plural, ns, name, body,
                                         keep_status=resource.plural == "resourceclaims")
            elif method == "DELETE" and not read_only:
                return 200, api._delete(resource.plural, ns, name, preconditions=body.get("preconditions") or {})
            raise ApiError(405, "MethodNotAllowed", f"{method} is not supported on {path} by this test double")

        def _selector(self, resource: _Resource, query: dict[str, str]) -> Callable[[Obj], bool]:
            by_field = _field_selector(resource, query.get("fieldSelector", ""))
            by_label = _label_selector(query.get("labelSelector", ""))
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

            timeout_s = float(query.get("timeoutSeconds") or _DEFAULT_WATCH_SECONDS)
            api._watch(resource.plural, namespace, selector, query.get("resourceVersion", ""), timeout_s, write)
            try:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
            except OSError:
                pass
            self.close_connection = True

    return Handler


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Kubernetes API server double (test support, in memory)")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--minor-version", type=int, default=36, help="Kubernetes 1.<minor> to pretend to be")
    parser.add_argument("--node", action="append", default=[], help="create a Node with this name (repeatable)")
    args = parser.parse_args(argv)
    server = FakeApiServer(minor_version=args.minor_version)
    url = server.start(port=args.port)
    for node in args.node:
        server.add_node(node)
    print(f"fake Kubernetes API server (test double) listening on {url}", flush=True)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    main()
