"""The requests of one ResourceSlice sync round: list, read the Node owner, delete/update/create.

What the server stored in place of what was sent (defaults added, fields dropped by a disabled
feature gate) is remembered as *adopted*, so the planner does not rewrite it every round; dropped
fields are logged once, loudly. Used by the publisher's worker thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from driver.kubeletplugin.kubeclient import KubeApiError, KubeClient, request_json
from driver.kubeletplugin.sliceplanner import Obj, SliceWrites, canonical_spec, dropped_fields

log = logging.getLogger(__name__)

SLICES_PATH = "/apis/resource.k8s.io/v1/resourceslices"
_REQUEST_TIMEOUT_S = 15.0
_MAX_ADOPTED = 256


class SliceWriteError(Exception):
    """One write of a sync round failed; carries the server's answer."""

    def __init__(self, operation: str, slice_name: str, cause: KubeApiError):
        super().__init__(f"{operation} of ResourceSlice {slice_name} failed: {cause}")
        self.operation, self.slice_name, self.cause = operation, slice_name, cause


class SliceWriter:
    """The API requests of a node's slices, and what the server stored instead of what was sent."""

    def __init__(self, api: KubeClient, driver_name: str, node_name: str,
                 node_uid: Callable[[], str | None] | None = None) -> None:
        """``node_uid``: the Node's UID as a watch knows it; None reads the Node every round instead."""
        self._api = api
        self._node_uid = node_uid
        self._node = node_name
        self._log_extra = {"driver": driver_name, "node": node_name}
        self._adopted: dict[str, str] = {}
        self._owner: Obj | None = None
        self._owner_warned = False
        # Replaced, never changed in place: read from other threads.
        self._gates_off: frozenset[str] = frozenset()

    @property
    def adopted(self) -> dict[str, str]:
        """Canonical sent spec -> canonical stored spec, for the planner."""
        return self._adopted

    @property
    def gates_off(self) -> frozenset[str]:
        """Feature gates the API server showed to be off by dropping fields that need them."""
        return self._gates_off

    def list(self, field_selector: str) -> Obj:
        """The ResourceSliceList of the slices ``field_selector`` picks."""
        return request_json(self._api, "GET", SLICES_PATH, query=[("fieldSelector", field_selector)],
                            timeout=_REQUEST_TIMEOUT_S)

    def apply(self, writes: SliceWrites) -> None:
        """Make the server hold ``writes``; :class:`SliceWriteError` on the first refused write."""
        # Deleting devices the driver no longer has matters most, so deletes go first.
        for old in writes.deletes:
            meta = old["metadata"]
            body = {"apiVersion": "v1", "kind": "DeleteOptions",
                    "preconditions": {"uid": meta["uid"], "resourceVersion": meta["resourceVersion"]}}
            try:
                request_json(self._api, "DELETE", f"{SLICES_PATH}/{meta['name']}", body=body,
                             timeout=_REQUEST_TIMEOUT_S)
            except KubeApiError as err:
                if err.status != 404:
                    raise SliceWriteError("delete", meta["name"], err) from err
        for wanted in writes.updates:
            name = wanted["metadata"]["name"]
            try:
                stored = request_json(self._api, "PUT", f"{SLICES_PATH}/{name}", body=wanted,
                                      timeout=_REQUEST_TIMEOUT_S)
            except KubeApiError as err:
                raise SliceWriteError("update", name, err) from err
            self._adopt(wanted["spec"], stored)
        for wanted in writes.creates:
            try:
                stored = request_json(self._api, "POST", SLICES_PATH, body=wanted, timeout=_REQUEST_TIMEOUT_S)
            except KubeApiError as err:
                raise SliceWriteError("create", wanted["metadata"]["generateName"] + "*", err) from err
            self._adopt(wanted["spec"], stored)

    def _adopt(self, sent: Obj, stored: Obj) -> None:
        stored_spec = stored.get("spec") or {}
        sent_key, stored_key = canonical_spec(sent), canonical_spec(stored_spec)
        if sent_key == stored_key:
            return
        name = stored.get("metadata", {}).get("name", "?")
        dropped, gates = dropped_fields(sent, stored_spec)
        if dropped:
            log.error("the API server dropped or changed fields of ResourceSlice %s: %s; a feature gate is probably "
                      "off on the API server%s. Keeping what the server stored; not retrying.",
                      name, ", ".join(dropped), f" ({', '.join(gates)})" if gates else "",
                      extra={**self._log_extra, "slice": name, "fields": dropped, "feature_gates": gates})
            self._gates_off = self._gates_off | set(gates)
        else:
            log.debug("the API server added defaults to ResourceSlice %s", name, extra={**self._log_extra})
        self._adopted[sent_key] = stored_key
        while len(self._adopted) > _MAX_ADOPTED:
            del self._adopted[next(iter(self._adopted))]

    def node_owner(self) -> Obj | None:
        """The owner reference to the Node, or the last known one (or None) when the Node cannot be read."""
        # A Node deleted and re-registered under the same name has a new UID, and slices pointing at the
        # old one would be garbage-collected: the watch's UID is current; without one, read every round.
        if self._node_uid is not None:
            uid = self._node_uid()
            if uid is None:
                self._warn_no_owner("its UID is not known (yet)")
                return self._owner
        else:
            try:
                uid = str(request_json(self._api, "GET", f"/api/v1/nodes/{self._node}",
                                       timeout=_REQUEST_TIMEOUT_S)["metadata"]["uid"])
            except KubeApiError as err:
                self._warn_no_owner(str(err))
                return self._owner
        self._owner = {"apiVersion": "v1", "kind": "Node", "name": self._node, "uid": uid, "controller": True}
        return self._owner

    def _warn_no_owner(self, why: str) -> None:
        if self._owner is None:
            level = logging.DEBUG if self._owner_warned else logging.WARNING
            log.log(level, "cannot read Node %s, publishing ResourceSlices without an owner reference "
                    "(they will not be garbage-collected with the Node): %s", self._node, why, extra=self._log_extra)
            self._owner_warned = True
