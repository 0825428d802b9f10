"""SIMULATION: a Kubernetes API server double for tests and the demo (not a real cluster), speaking real HTTP.

It serves just what a DRA node plugin and its tests use, well enough for the real
``kubernetes`` Python client end to end: ``/version``, Nodes (read), ResourceSlices (list,
watch, create with ``generateName``, get, replace, delete with preconditions, delete
collection), ResourceClaims (namespaced CRUD and ``/status``), DeviceClasses and Pods (read; tests put
them with ``put_pod``). Objects are
kept as plain dicts, so no field is ever dropped unless a test asks for it
(``dropped_device_fields``, which imitates a server with a feature gate off; consumable capacity
and counters are dropped by the release's own gates).

ResourceSlice writes are checked like a real server checks them for the rules a driver most
often breaks, and answered with ``422 Invalid`` and a Kubernetes ``Status`` naming the field.
This module is the store; the rules, resources and selectors are in ``apiobjects.py``, the HTTP
side (routes, watch streams) in ``apihttp.py``.

Tests drive it with helpers (``add_node``, ``slices``, ``put_claim``, ``wipe_slices``,
``reject_next_slice_writes``, ``expire_watch_history``, ``put_pod``) and inspect ``requests``: one
``(verb, path)`` per request, where verb is the HTTP method, or ``WATCH`` for a watch.

Manual use: ``python -m driver.simulation.apiserverrun --port 8001 [--node node-1]``.
"""

from __future__ import annotations

import copy
import json
import random
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import ThreadingHTTPServer
from pathlib import Path

from kubernetes import client

from driver.kubeletplugin.kubeclient import plain_client
from driver.simulation.apihttp import handler_for
from driver.simulation.apiobjects import (
    RESOURCE_API,
    RESOURCES,
    ApiError,
    Obj,
    check_kind,
    drop_disabled_fields,
    event_errors,
    group_of,
    invalid_error,
    slice_errors,
)
from driver.simulation.capacitypolicy import consumable_enabled
from driver.simulation.counterrules import partitionable_enabled

_NAME_SUFFIX_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
_MAX_GENERATE_NAME_BASE = 58
_WATCH_HISTORY = 10_000


@dataclass
class _Event:
    rv: int
    plural: str
    type: str
    obj: Obj


class FakeApiServer:
    """In-memory API server on 127.0.0.1. Thread-safe: all state is guarded by one lock."""

    def __init__(self, minor_version: int = 36, *, dropped_device_fields: Iterable[str] = (),
                 consumable_capacity_gate: bool = False, partitionable_devices_gate: bool = False):
        self.minor_version = minor_version
        self.dropped_device_fields = tuple(dropped_device_fields)
        # DRAConsumableCapacity and DRAPartitionableDevices on a 1.34/1.35 server (on by default from 1.36).
        self.consumable_capacity = consumable_enabled(minor_version, consumable_capacity_gate)
        self.partitionable_devices = partitionable_enabled(minor_version, partitionable_devices_gate)
        self._cond = threading.Condition()
        self._store: dict[str, dict[tuple[str, str], Obj]] = {plural: {} for plural in RESOURCES}
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
        server = ThreadingHTTPServer(("127.0.0.1", port), handler_for(self))
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
        """The real ``kubernetes`` client for this server, retrying as the driver's does
        (:func:`driver.kubeletplugin.kubeclient.request_retries`)."""
        return plain_client(self.url)

    # ----- test helpers ----------------------------------------------------------------

    def record_request(self, verb: str, path: str) -> None:
        """Called by the HTTP handler for every request (``WATCH`` as the verb of a watch)."""
        with self._cond:
            self._requests.append((verb, path))

    @property
    def requests(self) -> list[tuple[str, str]]:
        with self._cond:
            return list(self._requests)

    def add_node(self, name: str, labels: dict[str, str] | None = None) -> str:
        """Create a Node; returns its UID."""
        meta: Obj = {"name": name, "labels": dict(labels or {})}
        node = self.create_object("nodes", "", {"apiVersion": "v1", "kind": "Node", "metadata": meta})
        return str(node["metadata"]["uid"])

    def set_node_labels(self, name: str, labels: dict[str, str]) -> None:
        """Replace a Node's labels (as ``kubectl label`` would)."""
        node = self.get_object("nodes", "", name)
        node["metadata"]["labels"] = dict(labels)
        node["metadata"].pop("resourceVersion", None)
        self.replace_object("nodes", "", name, node, keep_status=True)

    def slices(self, driver: str | None = None, node: str | None = None) -> list[Obj]:
        """Stored ResourceSlices (copies), sorted by name."""
        with self._cond:
            found = [copy.deepcopy(s) for s in self._store["resourceslices"].values()
                     if (driver is None or s["spec"].get("driver") == driver)
                     and (node is None or s["spec"].get("nodeName") == node)]
        return sorted(found, key=lambda s: str(s["metadata"]["name"]))

    def events(self, namespace: str | None = None) -> list[Obj]:
        """Posted events.k8s.io Events (copies)."""
        return list(self.list_objects("events", namespace, lambda _obj: True)["items"])

    def claims(self) -> list[Obj]:
        """Every ResourceClaim, status included (copies)."""
        with self._cond:
            return [copy.deepcopy(c) for _, c in sorted(self._store["resourceclaims"].items())]

    def put_claim(self, claim: Obj) -> Obj:
        """Create or replace a ResourceClaim, status included; returns it as stored.

        A given ``metadata.uid`` is kept. Putting a claim whose UID differs from the stored one
        deletes and recreates it, as when a user replaces a claim.
        """
        body = copy.deepcopy(claim)
        body.setdefault("apiVersion", RESOURCE_API)
        body.setdefault("kind", "ResourceClaim")
        meta = body.setdefault("metadata", {})
        namespace = meta.setdefault("namespace", "default")
        with self._cond:
            existing = self._store["resourceclaims"].get((namespace, meta.get("name", "")))
            if existing is not None and meta.get("uid", existing["metadata"]["uid"]) == existing["metadata"]["uid"]:
                meta.pop("resourceVersion", None)
                return self.replace_object("resourceclaims", namespace, meta["name"], body, keep_status=False)
            if existing is not None:
                self.delete_object("resourceclaims", namespace, meta["name"], preconditions={})
            return self.create_object("resourceclaims", namespace, body)

    def delete_claim(self, namespace: str, name: str) -> None:
        self.delete_object("resourceclaims", namespace, name, preconditions={})

    def put_pod(self, pod: Obj) -> Obj:
        """Create or replace a Pod (clients may only read pods here); a new ``metadata.uid`` re-creates it."""
        body = copy.deepcopy(pod)
        body.setdefault("apiVersion", "v1")
        body.setdefault("kind", "Pod")
        meta = body.setdefault("metadata", {})
        namespace = meta.setdefault("namespace", "default")
        with self._cond:
            if (namespace, meta.get("name", "")) in self._store["pods"]:
                self.delete_object("pods", namespace, meta["name"], preconditions={})
            return self.create_object("pods", namespace, body)

    def wipe_slices(self, node: str) -> int:
        """Delete every slice of a node, as the kubelet does; returns how many were deleted."""
        with self._cond:
            names = [s["metadata"]["name"] for s in self._store["resourceslices"].values()
                     if s["spec"].get("nodeName") == node]
            for name in names:
                self.delete_object("resourceslices", "", name, preconditions={}, by_client=False)
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

    def create_object(self, plural: str, namespace: str, body: Obj) -> Obj:
        resource = RESOURCES[plural]
        obj = copy.deepcopy(body)
        check_kind(resource, obj)
        meta = obj.setdefault("metadata", {})
        with self._cond:
            if not meta.get("name"):
                base = str(meta.get("generateName", ""))
                if not base:
                    raise invalid_error(resource, "", [
                        ("metadata.name", "Required value: name or generateName is required")])
                meta["name"] = self._unique_name(plural, namespace, base)
            name = str(meta["name"])
            if (namespace, name) in self._store[plural]:
                raise ApiError(409, "AlreadyExists", f'{plural}.{group_of(resource)} "{name}" already exists')
            if plural == "resourceslices":
                self._admit_slice(obj, old=None)
            if plural == "events" and (errors := event_errors(obj, namespace)):
                raise invalid_error(resource, name, errors)
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

    def get_object(self, plural: str, namespace: str, name: str) -> Obj:
        resource = RESOURCES[plural]
        with self._cond:
            obj = self._store[plural].get((namespace, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{plural}.{group_of(resource)} "{name}" not found')
            return copy.deepcopy(obj)

    def replace_object(self, plural: str, namespace: str, name: str, body: Obj, *, keep_status: bool,
                 status_only: bool = False) -> Obj:
        resource = RESOURCES[plural]
        obj = copy.deepcopy(body)
        check_kind(resource, obj)
        meta = obj.setdefault("metadata", {})
        if meta.get("name", name) != name:
            raise ApiError(400, "BadRequest", f'the name of the object ({meta.get("name")}) does not match the name '
                                              f"on the URL ({name})")
        with self._cond:
            old = self._store[plural].get((namespace, name))
            if old is None:
                raise ApiError(404, "NotFound", f'{plural}.{group_of(resource)} "{name}" not found')
            sent_rv = meta.get("resourceVersion")
            if sent_rv and sent_rv != old["metadata"]["resourceVersion"]:
                raise ApiError(409, "Conflict", f'Operation cannot be fulfilled on {plural}.{group_of(resource)} '
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

    def delete_object(self, plural: str, namespace: str, name: str, preconditions: Obj, *,
                      by_client: bool = True) -> Obj:
        resource = RESOURCES[plural]
        with self._cond:
            old = self._store[plural].get((namespace, name))
            if old is None:
                raise ApiError(404, "NotFound", f'{plural}.{group_of(resource)} "{name}" not found')
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

    def list_objects(self, plural: str, namespace: str | None, selector: Callable[[Obj], bool]) -> Obj:
        resource = RESOURCES[plural]
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
        drop_disabled_fields(obj, self.dropped_device_fields, consumable_capacity=self.consumable_capacity,
                             partitionable_devices=self.partitionable_devices)
        errors = slice_errors(obj, old, self.minor_version)
        if errors:
            raise invalid_error(RESOURCES["resourceslices"], str(obj.get("metadata", {}).get("name", "")), errors)

    # ----- watch ------------------------------------------------------------------------

    def watch_objects(self, plural: str, namespace: str | None, selector: Callable[[Obj], bool],
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
