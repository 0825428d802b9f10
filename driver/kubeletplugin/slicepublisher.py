"""Publishing one node-local pool of devices as ResourceSlices: the worker that writes and watches.

The driver hands over its devices (:meth:`ResourceSlicePublisher.update`); one worker thread
makes the API server match them and keeps it that way. What to write is decided by the pure
:mod:`.sliceplanner`, the writes are done by :mod:`.slicewriter`; this module runs the rounds and
the watch, like the Go ``k8s.io/dynamic-resource-allocation/resourceslice`` controller.

Every request sends and reads raw JSON, so no field is lost in the client's models. Changes made
by others (the kubelet deletes a node's slices when it starts and when it loses the driver) are
seen through a watch and repaired after ``resync_delay``. Failures are retried with exponential
backoff.
"""

from __future__ import annotations

import logging
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from opentelemetry.trace import Status, StatusCode

from driver.kubeletplugin.kubeclient import (
    JsonLineStream,
    KubeApiError,
    KubeClient,
    open_json_lines,
    server_minor_version,
)
from driver.kubeletplugin.slicelimits import limits_for
from driver.kubeletplugin.slicemodel import CounterSet, Device, PlannedSlice
from driver.kubeletplugin.sliceplanner import (
    InvalidDevices,
    plan_slices,
    slice_writes,
)
from driver.kubeletplugin.slicevalidation import validate_driver_and_pool
from driver.kubeletplugin.slicewriter import SLICES_PATH, SliceWriteError, SliceWriter
from driver.kubeletplugin.telemetry import Telemetry
from driver.kubeletplugin.worker import Worker

log = logging.getLogger(__name__)

_INITIAL_BACKOFF_S = 1.0
# Each watch lasts 5 to 10 minutes (as client-go's reflectors do) and resumes from the last resourceVersion
# seen, so an idle node costs well under one request a minute; update() and stop() interrupt it at once.
_MIN_WATCH_SECONDS = 300
# A watch that ends sooner than this without an event is treated as a failure (with backoff), so
# a proxy that closes watches at once cannot make the publisher re-watch in a hot loop.
_MIN_WATCH_LIFETIME_S = 1.0
# After writing, the next round runs at once to confirm the result; a bounded number of times,
# so a server that keeps changing what it stores cannot make a hot loop.
_MAX_CONFIRMING_ROUNDS = 3


@dataclass(frozen=True)
class _RoundResult:
    failed: bool = False
    wrote: bool = False
    list_resource_version: str | None = None


class ResourceSlicePublisher(Worker):
    """Keeps the ResourceSlices of one node-local pool equal to the devices it was given.

    Each sync round is a span ``<scope>.publish_resourceslices`` (the telemetry's scope) and counts in
    ``slice_sync_total`` with ``result`` = ``changed``, ``unchanged`` or ``error``; an update
    refused by validation counts as ``invalid``.
    """

    def __init__(self, api: KubeClient, driver_name: str, node_name: str, telemetry: Telemetry, *,
                 minor_version: int | None = None, resync_delay: float = 2.0, max_backoff: float = 300.0,
                 initial_backoff: float = _INITIAL_BACKOFF_S, node_uid: Callable[[], str | None] | None = None,
                 min_watch_seconds: int = _MIN_WATCH_SECONDS):
        """``node_uid``: the Node's UID as a watch knows it (:class:`.nodewatch.NodeWatch`); None reads the Node
        at every sync round instead."""
        problems = validate_driver_and_pool(driver_name, node_name)
        if problems:
            raise ValueError("cannot publish ResourceSlices: " + "; ".join(problems))
        super().__init__("resourceslice-publisher")
        self._api = api
        self._driver = driver_name
        self._node = node_name
        self._telemetry = telemetry
        self._limits = limits_for(minor_version if minor_version is not None else server_minor_version(api))
        self._resync_delay = resync_delay
        self._min_watch = min_watch_seconds
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._selector = f"spec.driver={driver_name},spec.nodeName={node_name}"
        self._log_extra = {"driver": driver_name, "node": node_name}
        # Shared with callers, guarded by _cond (the worker's).
        self._desired: list[PlannedSlice] | None = None
        self._desired_version = 0
        self._synced_version = 0
        self._server_changed = False
        self._published_devices = 0
        self._wake = False
        # Worker thread only.
        self._writer = SliceWriter(api, driver_name, node_name, node_uid)
        self._backoff = initial_backoff
        self._watch_backoff = initial_backoff

    @property
    def kubernetes_minor_version(self) -> int:
        return self._limits.minor_version

    @property
    def server_gates_off(self) -> frozenset[str]:
        """Feature gates the API server showed to be off by dropping fields of the slices sent to it."""
        return self._writer.gates_off

    @property
    def published_device_count(self) -> int:
        """Devices in the last state confirmed to be on the server."""
        with self._cond:
            return self._published_devices

    def update(self, devices: Sequence[Device], counter_sets: Sequence[CounterSet] = ()) -> list[str]:
        """Set the devices (and the counter sets they consume from) to publish; the problems that
        stopped it, empty when accepted.

        Invalid devices are logged and not sent; the previous state stays.
        """
        try:
            slices = plan_slices(list(devices), self._driver, self._limits, list(counter_sets))
        except InvalidDevices as invalid:
            problems = invalid.problems
            log.error("not publishing ResourceSlices: %d problem(s) with the devices, keeping the previous state: %s",
                      len(problems), "; ".join(problems), extra={**self._log_extra, "problems": problems})
            self._telemetry.slice_sync_total.add(1, {"result": "invalid"})
            return list(problems)
        with self._cond:
            if slices == self._desired:
                return []  # a rescan that found nothing new costs the API server nothing
            self._desired = slices
            self._desired_version += 1
            self._wake = True
            self._cond.notify_all()
            self._interrupt()
        return []

    def resync(self) -> None:
        """Sync again at once (e.g. the Node was re-created: the owner reference changes)."""
        with self._cond:
            self._wake = True
            self._cond.notify_all()
            self._interrupt()

    def stop(self, timeout: float = 10.0) -> bool:
        """Stop the worker; True if it ended within ``timeout``. Published slices stay."""
        return super().stop(timeout)

    def wait_synced(self, timeout: float) -> bool:
        """True once the latest devices are on the server and nothing has changed them since."""
        with self._cond:
            return self._cond.wait_for(lambda: bool(self._desired_version) and not self._server_changed
                                       and self._synced_version == self._desired_version, timeout)

    # ----- worker ----------------------------------------------------------------------------

    def _run(self) -> None:
        next_round = 0.0
        confirming_rounds = 0
        list_rv: str | None = None
        while True:
            with self._cond:
                if self._stopping:
                    return
                if self._wake:
                    self._wake = False
                    next_round = 0.0
                if self._desired is None:
                    self._cond.wait()
                    continue
            now = time.monotonic()
            if next_round <= now:
                result = self._sync_round()
                if result.failed:
                    next_round, confirming_rounds = now + self._backoff, 0
                    self._backoff = min(self._backoff * 2, self._max_backoff)
                    continue
                self._backoff = self._initial_backoff
                if result.wrote and confirming_rounds < _MAX_CONFIRMING_ROUNDS:
                    next_round, confirming_rounds = now, confirming_rounds + 1
                elif result.wrote:
                    next_round, confirming_rounds = now + self._resync_delay, 0
                else:
                    next_round, confirming_rounds = math.inf, 0
                    list_rv = result.list_resource_version
            elif next_round == math.inf:
                outcome, list_rv = self._watch(list_rv)
                if outcome in ("changed", "expired"):
                    next_round = time.monotonic() + self._resync_delay
                elif outcome == "failed":
                    next_round = time.monotonic() + max(self._resync_delay, self._watch_backoff)
                    self._watch_backoff = min(self._watch_backoff * 2, self._max_backoff)
            else:
                with self._cond:
                    if not (self._wake or self._stopping):
                        self._cond.wait(next_round - now)

    def _sync_round(self) -> _RoundResult:
        with self._cond:
            desired = self._desired or [PlannedSlice()]
            version = self._desired_version
        device_count = sum(len(s.devices) for s in desired)
        scope = self._telemetry.scope
        with self._telemetry.tracer.start_as_current_span(f"{scope}.publish_resourceslices") as span:
            span.set_attribute(f"{scope}.resourceslice.device_count", device_count)
            span.set_attribute(f"{scope}.resourceslice.slice_count", len(desired))
            try:
                owner = self._writer.node_owner()
                listed = self._writer.list(self._selector)
                writes = slice_writes(listed.get("items") or [], desired, driver_name=self._driver,
                                 node_name=self._node, owner=owner, adopted=self._writer.adopted)
                span.set_attribute(f"{scope}.resourceslice.generation", writes.generation)
                self._writer.apply(writes)
            except (KubeApiError, SliceWriteError) as err:
                self._log_failure(err)
                span.set_status(Status(StatusCode.ERROR, str(err)))
                self._telemetry.slice_sync_total.add(1, {"result": "error"})
                return _RoundResult(failed=True)
            except Exception as err:
                # A malformed answer or a bug must not end the worker: it retries with backoff.
                log.exception("publishing ResourceSlices failed unexpectedly, retrying in %.1fs", self._backoff,
                              extra=self._log_extra)
                span.set_status(Status(StatusCode.ERROR, repr(err)))
                self._telemetry.slice_sync_total.add(1, {"result": "error"})
                return _RoundResult(failed=True)
        self._telemetry.slice_sync_total.add(1, {"result": "changed" if not writes.empty else "unchanged"})
        if not writes.empty:
            log.info("ResourceSlices written", extra={
                **self._log_extra, "generation": writes.generation, "slices_deleted": len(writes.deletes),
                "slices_updated": len(writes.updates), "slices_created": len(writes.creates), "devices": device_count})
            return _RoundResult(wrote=True)
        with self._cond:
            if version == self._desired_version:
                self._synced_version = version
                self._server_changed = False
                self._published_devices = device_count
                self._cond.notify_all()
        return _RoundResult(list_resource_version=str(listed.get("metadata", {}).get("resourceVersion") or "") or None)

    def _log_failure(self, err: KubeApiError | SliceWriteError) -> None:
        cause = err.cause if isinstance(err, SliceWriteError) else err
        log.error("publishing ResourceSlices failed, retrying in %.1fs: %s", self._backoff, err, extra={
            **self._log_extra, "status": cause.status, "reason": cause.reason, "server_message": cause.message,
            "retry_in_s": self._backoff})

    def _watch(self, resource_version: str | None) -> tuple[str, str | None]:
        """Watch our slices until one changes ("changed"), the server ends the watch with an error
        such as 410 Gone ("expired": list again), the watch times out ("ended"), it fails
        ("failed"), or update()/stop() interrupt it ("interrupted"). Returns the outcome and the
        resourceVersion to resume from."""
        seconds = random.randint(self._min_watch, 2 * self._min_watch)
        query = [("fieldSelector", self._selector), ("watch", "true"), ("allowWatchBookmarks", "true"),
                 ("timeoutSeconds", str(seconds))]
        if resource_version:
            query.append(("resourceVersion", resource_version))
        try:
            stream = open_json_lines(self._api, SLICES_PATH, query=query, timeout=seconds + 30)
        except KubeApiError as err:
            log.warning("cannot watch ResourceSlices: %s", err, extra=self._log_extra)
            return "failed", resource_version
        with self._cond:
            if self._wake or self._stopping:
                stream.close()
                return "interrupted", resource_version
            self._stream = stream
        try:
            return self._follow(stream, resource_version)
        finally:
            with self._cond:
                self._stream = None
            stream.close()

    def _follow(self, stream: JsonLineStream, resource_version: str | None) -> tuple[str, str | None]:
        """Read the open watch until it has an outcome (those of :meth:`_watch`)."""
        opened = time.monotonic()
        try:
            for event in stream:
                kind = event.get("type")
                obj = event.get("object") or {}
                if kind == "BOOKMARK":
                    resource_version = obj.get("metadata", {}).get("resourceVersion") or resource_version
                    continue
                if kind == "ERROR":
                    # Usually 410 Gone: the resourceVersion is too old. A fresh list fixes it.
                    log.info("ResourceSlice watch ended by the server: %s", obj.get("message", obj),
                             extra=self._log_extra)
                    return "expired", None
                log.info("ResourceSlice %s %s by someone else, re-syncing in %.1fs",
                         obj.get("metadata", {}).get("name", "?"), str(kind).lower(), self._resync_delay,
                         extra=self._log_extra)
                with self._cond:
                    self._server_changed = True
                    self._cond.notify_all()
                self._watch_backoff = self._initial_backoff
                return "changed", resource_version
        except KubeApiError as err:
            with self._cond:
                if self._wake or self._stopping:
                    return "interrupted", resource_version
            log.warning("ResourceSlice watch broke: %s", err, extra=self._log_extra)
            return "failed", resource_version
        with self._cond:
            if self._wake or self._stopping:
                return "interrupted", resource_version
        if time.monotonic() - opened < _MIN_WATCH_LIFETIME_S:
            log.warning("ResourceSlice watch ended at once, watching again later", extra=self._log_extra)
            return "failed", resource_version
        self._watch_backoff = self._initial_backoff
        return "ended", resource_version
