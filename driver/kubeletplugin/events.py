"""Kubernetes Events about the objects a plugin serves (``events.k8s.io/v1``), posted best effort.

An Event whose ``regarding`` is a user's object (a ResourceClaim) shows in ``kubectl describe`` of
that object: the way to tell a claim's owner what happened to it on the node. Posting never holds
up the caller: events wait in a bounded queue that one thread drains, each request is bounded in
time, and when the queue is full or the API server refuses, the event is dropped and logged (the
plugin's own log line and metrics carry the same facts). The same reason for the same object is
posted at most once per ``min_interval``, so a tenant who repeats a change cannot flood the API
server through the plugin. Needs RBAC ``create`` on ``events.k8s.io`` ``events``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from datetime import UTC, datetime
from typing import Literal
from urllib.parse import quote

from pydantic import BaseModel, ConfigDict

from driver.kubeletplugin.kubeclient import KubeApiError, KubeClient, request_json

log = logging.getLogger(__name__)

EVENTS_API = "events.k8s.io/v1"
# The API server's limits for an Event (k8s.io/kubernetes pkg/apis/core/validation/events.go):
# note at most 1 KiB, action and reason at most 128 characters.
NOTE_MAX = 1024
_FIELD_MAX = 128


class ObjectRef(BaseModel):
    """The object an Event is about (``regarding``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    apiVersion: str
    kind: str
    namespace: str
    name: str
    uid: str


class EventSpec(BaseModel):
    """One Event as the plugin means it; :meth:`body` is what is sent."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    regarding: ObjectRef
    reason: str  # CamelCase, e.g. LimitsReverted
    action: str  # what the plugin did, e.g. RevertLimits
    note: str
    type: Literal["Normal", "Warning"] = "Warning"

    def namespace(self) -> str:
        """Where the Event is posted: its object's namespace; for a cluster-scoped object (a Node) "default", where
        the kubelet's node events are (the API server takes them only there or in kube-system:
        k8s.io/kubernetes pkg/apis/core/validation/events.go, ValidateEventCreate)."""
        return self.regarding.namespace or "default"

    def body(self, controller: str, instance: str, now: datetime) -> dict[str, object]:
        note = self.note if len(self.note) <= NOTE_MAX else self.note[:NOTE_MAX - 1] + "…"
        return {
            "apiVersion": EVENTS_API, "kind": "Event",
            "metadata": {"generateName": f"{self.regarding.name[:200]}.", "namespace": self.namespace()},
            # MicroTime: RFC 3339 with microseconds.
            "eventTime": now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ"),
            "reportingController": controller[:_FIELD_MAX], "reportingInstance": instance[:_FIELD_MAX],
            "action": self.action[:_FIELD_MAX], "reason": self.reason[:_FIELD_MAX], "type": self.type,
            "note": note, "regarding": self.regarding.model_dump(),
        }


class EventRecorder:
    """Posts Events from a queue on its own thread; :meth:`post` never blocks."""

    def __init__(self, api: KubeClient, controller: str, instance: str, *, queue_size: int = 100,
                 min_interval: float = 30.0, request_timeout: float = 5.0) -> None:
        """``controller``: the reporting controller (e.g. the driver name); ``instance``: this plugin
        (e.g. the node name)."""
        self.api = api
        self.controller = controller
        self.instance = instance
        self.min_interval = min_interval
        self.request_timeout = request_timeout
        self._queue: queue.Queue[EventSpec | None] = queue.Queue(maxsize=queue_size)
        self._last_posted: dict[tuple[str, str], float] = {}  # (object uid, reason) -> monotonic time
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def post(self, event: EventSpec) -> bool:
        """Queue ``event``; False if it was dropped (the same reason for the object was posted less than
        ``min_interval`` ago, or the queue is full)."""
        key, now = (event.regarding.uid, event.reason), time.monotonic()
        with self._lock:
            last = self._last_posted.get(key)
            if last is not None and now - last < self.min_interval:
                return False
            self._last_posted[key] = now
            if len(self._last_posted) > 10 * self._queue.maxsize:  # objects come and go: forget old ones
                cutoff = now - self.min_interval
                self._last_posted = {k: t for k, t in self._last_posted.items() if t >= cutoff}
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            log.warning("too many Kubernetes events queued; dropped one", extra={
                "reason": event.reason, "regarding": f"{event.regarding.namespace}/{event.regarding.name}"})
            return False
        return True

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="k8s-events", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Post what is queued within ``timeout`` (roughly), then stop; the rest is dropped."""
        if self._thread is None:
            return
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout)
        self._thread.join(timeout)
        self._thread = None

    def _run(self) -> None:
        while (event := self._queue.get()) is not None:
            self._send(event)

    def _send(self, event: EventSpec) -> None:
        ns = event.namespace()
        path = f"/apis/events.k8s.io/v1/namespaces/{quote(ns, safe='')}/events"
        try:
            request_json(self.api, "POST", path, body=event.body(self.controller, self.instance, datetime.now(UTC)),
                         timeout=self.request_timeout)
        except KubeApiError as exc:
            log.warning("could not post a Kubernetes event", extra={
                "reason": event.reason, "regarding": f"{ns}/{event.regarding.name}", "error": str(exc)})
        except Exception:  # the thread must outlive any one event
            log.exception("posting a Kubernetes event failed", extra={"reason": event.reason})
