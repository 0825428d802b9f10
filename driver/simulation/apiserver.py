"""SIMULATION: a Kubernetes API server double for tests and the demo (not a real cluster), speaking real HTTP.

It serves just what a DRA node plugin and its tests use, well enough for the real
``kubernetes`` Python client end to end: ``/version``, Nodes (read), ResourceSlices (list,
watch, create with ``generateName``, get, replace, delete with preconditions, delete
collection), ResourceClaims (namespaced CRUD and ``/status``), DeviceClasses and Pods (read; tests put
them with ``put_pod``), server-side apply of a claim's ``status.devices`` (``applypatch.py``), and
metadata-only answers (``Accept: ...;as=PartialObjectMetadata``). Objects are
kept as plain dicts, so no field is ever dropped unless a test asks for it
(``dropped_device_fields``, which imitates a server with a feature gate off; consumable capacity
and counters are dropped by the release's own gates).

ResourceSlice writes are checked like a real server checks them for the rules a driver most
often breaks, and answered with ``422 Invalid`` and a Kubernetes ``Status`` naming the field.
This module is the store; the rules, resources and selectors are in ``apiobjects.py``, the HTTP
side (routes, watch streams) in ``apihttp.py``, the event history and watches in ``apiwatch.py``.

Tests drive it with helpers (``add_node``, ``slices``, ``put_claim``, ``wipe_slices``,
``reject_next_slice_writes``, ``expire_watch_history``, ``put_pod``, ``refuse_claim_status``) and
inspect ``requests``: one ``(verb, path)`` per request, where verb is the HTTP method, or ``WATCH``
for a watch (``request_queries``: the same with each request's query parameters).

Manual use: ``python -m driver.simulation.apiserverrun --port 8001 [--node node-1]``.
"""

from __future__ import annotations

import copy
import json
import threading
import uuid
from collections.abc import Callable, Iterable
from http.server import ThreadingHTTPServer
from pathlib import Path

from kubernetes import client

from driver.kubeletplugin.kubeclient import api_time, plain_client
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
    kube_config_for,
    slice_errors,
    unique_name,
)
from driver.simulation.apiwatch import EventLog
from driver.simulation.applypatch import apply_device_status, device_status_errors, status_refused
from driver.simulation.capacitypolicy import consumable_enabled
from driver.simulation.counterrules import partitionable_enabled


class FakeApiServer:
    """In-memory API server on 127.0.0.1. Thread-safe: all state is guarded by one lock."""

    def __init__(self, minor_version: int = 36, *, dropped_device_fields: Iterable[str] = (),
                 consumable_capacity_gate: bool = False, partitionable_devices_gate: bool = False,
                 claim_device_status_gate: bool = True):
        self.minor_version = minor_version
        self.dropped_device_fields = tuple(dropped_device_fields)
        # DRAConsumableCapacity and DRAPartitionableDevices on a 1.34/1.35 server (on by default from 1.36).
        self.consumable_capacity = consumable_enabled(minor_version, consumable_capacity_gate)
        self.partitionable_devices = partitionable_enabled(minor_version, partitionable_devices_gate)
        # DRAResourceClaimDeviceStatus (beta, on by default from 1.33): off, status.devices is dropped silently.
        self.claim_device_status = claim_device_status_gate
        self._cond = threading.Condition()
        self._store: dict[str, dict[tuple[str, str], Obj]] = {plural: {} for plural in RESOURCES}
        self._rv = 0
        self._events = EventLog(self._cond)
        self._requests: list[tuple[str, str, dict[str, str]]] = []
        self._reject_writes = 0
        self._reject_status = (500, "InternalError", "")
        self._status_refusal: tuple[int, str] | None = None
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
            self._events.stopping = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def kube_config(self, path: str | Path) -> Path:
        """Write a kubeconfig pointing at this server (for a driver subprocess)."""
        target = Path(path)
        target.write_text(json.dumps(kube_config_for(self.url), indent=2))
        return target

    def api_client(self) -> client.ApiClient:
        """The real ``kubernetes`` client for this server, retrying as the driver's does
        (:func:`driver.kubeletplugin.kubeclient.request_retries`)."""
        return plain_client(self.url)

    # ----- test helpers ----------------------------------------------------------------

    def record_request(self, verb: str, path: str, query: dict[str, str] | None = None) -> None:
        """Called by the HTTP handler for every request (``WATCH`` as the verb of a watch)."""
        with self._cond:
            self._requests.append((verb, path, dict(query or {})))

    @property
    def requests(self) -> list[tuple[str, str]]:
        with self._cond:
            return [(verb, path) for verb, path, _ in self._requests]

    @property
    def request_queries(self) -> list[tuple[str, str, dict[str, str]]]:
        """Every request as (verb, path, query parameters)."""
        with self._cond:
            return [(verb, path, dict(query)) for verb, path, query in self._requests]

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
            self._events.expire(self._rv)

    def refuse_claim_status(self, code: int | None, reason: str = "Forbidden") -> None:
        """Refuse every write of a claim's status with ``code`` (403: RBAC without ``resourceclaims/status``);
        None to accept them again."""
        with self._cond:
            self._status_refusal = (code, reason) if code is not None else None

    # ----- storage (callers hold no lock; these take it) -------------------------------

    def _next_rv(self) -> int:
        self._rv += 1
        return self._rv

    def _stored(self, plural: str, namespace: str, name: str) -> Obj:
        """The stored object, or the 404 a real server answers; the caller holds the lock."""
        obj = self._store[plural].get((namespace, name))
        if obj is None:
            raise ApiError(404, "NotFound", f'{plural}.{group_of(RESOURCES[plural])} "{name}" not found')
        return obj

    def _record(self, plural: str, event_type: str, obj: Obj) -> None:
        self._events.record(plural, event_type, obj)

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
                meta["name"] = unique_name(base, lambda n: (namespace, n) in self._store[plural])
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
            meta["creationTimestamp"] = api_time()
            meta["resourceVersion"] = str(self._next_rv())
            obj["apiVersion"], obj["kind"] = resource.api_version, resource.kind
            self._store[plural][(namespace, name)] = obj
            self._record(plural, "ADDED", obj)
            return copy.deepcopy(obj)

    def get_object(self, plural: str, namespace: str, name: str) -> Obj:
        with self._cond:
            return copy.deepcopy(self._stored(plural, namespace, name))

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
            old = self._stored(plural, namespace, name)
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
        with self._cond:
            old = self._stored(plural, namespace, name)
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

    # ----- server-side apply and watch ---------------------------------------------------

    def apply_status(self, plural: str, namespace: str, name: str, patch: Obj, *, manager: str, force: bool) -> Obj:
        """Server-side apply of a ResourceClaim's ``status.devices`` by ``manager`` (see ``applypatch.py``)."""
        resource = RESOURCES[plural]
        if plural != "resourceclaims":
            raise ApiError(405, "MethodNotAllowed", f"this double applies only resourceclaims/status, not {plural}")
        check_kind(resource, patch)
        with self._cond:
            if self._status_refusal is not None:
                raise status_refused(name, *self._status_refusal)
            old = self._stored(plural, namespace, name)
            new = apply_device_status(old, patch, manager, force=force, gate_on=self.claim_device_status)
            status = new.get("status") or {}
            errors = device_status_errors(status.get("devices") or [], status.get("allocation"))
            if errors:
                raise invalid_error(resource, name, errors)
            if new == old:
                return copy.deepcopy(old)  # a no-op apply does not change the resourceVersion
            new["metadata"]["resourceVersion"] = str(self._next_rv())
            self._store[plural][(namespace, name)] = new
            self._record(plural, "MODIFIED", new)
            return copy.deepcopy(new)

    def watch_objects(self, plural: str, namespace: str | None, selector: Callable[[Obj], bool],
                      resource_version: str, timeout_s: float, write: Callable[[Obj], bool], *,
                      bookmarks: bool = False, shape: Callable[[Obj], Obj] = lambda obj: obj) -> None:
        """Stream events until the timeout, the server stops, or the client goes away (``apiwatch.py``)."""
        def stored() -> list[Obj]:
            return [copy.deepcopy(o) for _, o in sorted(self._store[plural].items())]

        self._events.watch(plural, namespace, selector, resource_version, timeout_s, write,
                           current_rv=lambda: self._rv, stored=stored, bookmarks=bookmarks, shape=shape)
