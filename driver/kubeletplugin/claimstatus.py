"""Writing what a driver did with a claim's devices into ``ResourceClaim.status.devices``, off the prepare path.

Kubernetes keeps one ``status.devices`` entry per allocated device (KEP-4817), keyed by driver, pool,
device and shareID, with up to 8 conditions and an opaque ``data`` object of at most 10 KiB. This module
writes a driver's entries with server-side apply (``PATCH .../status`` as ``application/apply-patch+yaml``
under the driver's own field manager), so the allocation and other drivers' entries are never touched,
and applying nothing removes exactly what this driver wrote before.

A prepare only marks its claim (:meth:`ClaimStatusWriter.mark`) and never waits: one worker thread writes,
asking the driver for the claim's entries when the write is made, so marks that arrive before it runs
coalesce into one write carrying the latest state, and a claim has at most one write in flight. When it
writes (:meth:`ClaimStatusWriter._when`), retries and gives up: docs/operations.md, "What a claim shows in
its status".
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from driver.kubeletplugin.calls import ClaimRef
from driver.kubeletplugin.kubeclient import APPLY_PATCH, KubeApiError, KubeClient, api_time, request_json
from driver.kubeletplugin.worker import Worker

log = logging.getLogger(__name__)

MAX_CONDITIONS = 8
MAX_DATA_BYTES = 10 * 1024
DEFAULT_MAX_PENDING = 1024
DEFAULT_QUIET_S = 0.2
DEFAULT_MAX_DELAY_S = 5.0
_REQUEST_TIMEOUT_S = 10.0
# Answers that will not change by asking again: the claim, the server or its rules are as they are.
_REFUSED = (400, 403, 404, 405, 409, 415, 422)

Obj = dict[str, Any]


@dataclass(frozen=True)
class Condition:
    """One ``metav1.Condition`` of a device; its ``lastTransitionTime`` is kept by the writer."""

    type: str
    status: bool | None  # None: Unknown
    reason: str  # CamelCase, as Kubernetes requires
    message: str = ""
    # Since when it holds, as far as the driver knows (RFC 3339): the lastTransitionTime when the writer has
    # no earlier state of it (its first write, or the first after a restart); None: the time of writing.
    since: str | None = None


@dataclass(frozen=True)
class DeviceStatus:
    """What a driver reports for one allocated device: the allocation's keys, conditions and ``data``."""

    pool: str
    device: str
    share_id: str | None = None
    conditions: tuple[Condition, ...] = ()
    data: Mapping[str, Any] = field(default_factory=dict)


# The driver's answer for one claim at the moment of writing; empty: nothing (the claim is not prepared here).
StatusSource = Callable[[ClaimRef], Sequence[DeviceStatus]]


def _status_word(value: bool | None) -> str:
    return "Unknown" if value is None else ("True" if value else "False")


def _key(entry: Obj) -> tuple[str, str, str, str]:
    return (entry["driver"], entry["pool"], entry["device"], entry.get("shareID") or "")


def device_entries(driver: str, statuses: Sequence[DeviceStatus], previous: Sequence[Obj], now: str) -> list[Obj]:
    """The ``status.devices`` entries to apply: a condition whose status did not change since ``previous``
    keeps its ``lastTransitionTime``; ``data`` over 10 KiB is replaced by a note saying so."""
    before = {(_key(e), c["type"]): c for e in previous for c in e.get("conditions") or []}
    entries: list[Obj] = []
    for status in statuses:
        entry: Obj = {"driver": driver, "pool": status.pool, "device": status.device}
        if status.share_id:
            entry["shareID"] = status.share_id
        conditions = []
        for condition in status.conditions[:MAX_CONDITIONS]:
            word = _status_word(condition.status)
            old = before.get((_key(entry), condition.type))
            if old is None:
                since = condition.since or now
            else:
                since = old["lastTransitionTime"] if old["status"] == word else now
            conditions.append({"type": condition.type, "status": word, "reason": condition.reason,
                               "message": condition.message, "lastTransitionTime": since})
        entry["conditions"] = conditions
        data = dict(status.data)
        if len(json.dumps(data, separators=(",", ":")).encode()) > MAX_DATA_BYTES:
            data = {"note": f"this device's status data is over the API's {MAX_DATA_BYTES} bytes and was left out"}
        entry["data"] = data
        entries.append(entry)
    return entries


def apply_body(ref: ClaimRef, entries: Sequence[Obj]) -> Obj:
    """The apply request's body: the claim's identity (its UID a precondition) and our entries, nothing else."""
    status: Obj = {"devices": list(entries)} if entries else {}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid}, "status": status}


def dropped_by_server(sent: Sequence[Obj], stored: Obj) -> bool:
    """Whether the server's answer lacks entries it was sent: the field is dropped (its feature gate is off)."""
    kept = {_key(e) for e in ((stored.get("status") or {}).get("devices") or []) if isinstance(e, dict)
            and {"driver", "pool", "device"} <= set(e)}
    return any(_key(e) not in kept for e in sent)


@dataclass
class _Pending:
    ref: ClaimRef
    due: float = 0.0  # not before: a retry's backoff
    marked: float = 0.0  # the first mark not yet written
    attempts: int = 0


class ClaimStatusWriter(Worker):
    """Writes claims' ``status.devices`` from one worker thread; :meth:`mark` is all a prepare does.
    :meth:`stop` lets a write in flight finish and leaves marks not yet written."""

    def __init__(self, api: KubeClient, driver_name: str, field_manager: str, source: StatusSource, *,
                 max_pending: int = DEFAULT_MAX_PENDING, initial_backoff: float = 0.5, max_backoff: float = 60.0,
                 quiet: float = DEFAULT_QUIET_S, max_delay: float = DEFAULT_MAX_DELAY_S,
                 clock: Callable[[], str] | None = None):
        super().__init__("claim-status-writer")
        self._api = api
        self._driver = driver_name
        self._manager = field_manager
        self._source = source
        self._max_pending = max_pending
        self._initial_backoff = initial_backoff
        self._max_backoff = max_backoff
        self._quiet = quiet
        self._max_delay = max_delay
        self._last_mark = 0.0
        self._clock = clock or api_time
        self._pending: dict[str, _Pending] = {}
        self._busy = False
        self._disabled: str | None = None
        self._overflowed = False
        self._refusals_logged: set[int] = set()
        # Worker thread only: what the server holds of ours, by claim UID.
        self._written: dict[str, list[Obj]] = {}

    @property
    def disabled(self) -> str | None:
        """Why writing stopped for good (a refusal or a dropped field), None while writing."""
        with self._cond:
            return self._disabled

    def mark(self, ref: ClaimRef) -> None:
        """Write ``ref``'s entries soon (coalesced with earlier marks not yet written); never blocks."""
        with self._cond:
            if self._disabled is not None or self._stopping:
                return
            now = time.monotonic()
            self._last_mark = now
            pending = self._pending.get(ref.uid)
            if pending is not None:
                pending.ref, pending.due = ref, min(pending.due, now)
            elif len(self._pending) >= self._max_pending:
                if not self._overflowed:
                    log.warning("claim status queue full (%d claims): dropping status writes until it drains",
                                self._max_pending, extra={"claim_uid": ref.uid})
                self._overflowed = True
                return
            else:
                self._pending[ref.uid] = _Pending(ref, due=now, marked=now)
            self._cond.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """True once nothing is marked or in flight (for tests and benchmarks; a prepare never waits)."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._pending or self._busy), timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                item = self._next_due()
                if item is None:
                    return
                self._busy = True
            try:
                retry = self._write(item.ref)
            except Exception:  # a bug or a malformed answer must not end the worker
                log.exception("writing claim status failed unexpectedly", extra={"claim_uid": item.ref.uid})
                retry = True
            with self._cond:
                self._busy = False
                if retry and self._disabled is None and item.ref.uid not in self._pending:
                    item.attempts += 1
                    item.due = time.monotonic() + min(self._max_backoff,
                                                      self._initial_backoff * 2 ** (item.attempts - 1))
                    self._pending[item.ref.uid] = item
                if not self._pending:
                    self._overflowed = False
                self._cond.notify_all()

    def _next_due(self) -> _Pending | None:
        """The claim to write now, waiting for one; None when stopping. Caller holds ``_cond``."""
        while not self._stopping:
            if self._disabled is not None:
                self._pending.clear()
            if self._pending:
                item = min(self._pending.values(), key=self._when)
                wait = self._when(item) - time.monotonic()
                if wait <= 0:
                    return self._pending.pop(item.ref.uid)
                self._cond.notify_all()
                self._cond.wait(wait)
            else:
                self._cond.notify_all()
                self._cond.wait()
        return None

    def _when(self, item: _Pending) -> float:
        """When ``item`` may be written: after its backoff, once no claim was marked for ``quiet`` seconds (a
        burst of prepares is not slowed by writes between them, whose GIL time it would wait for), and at the
        latest ``max_delay`` after its first mark. Caller holds ``_cond``."""
        return max(item.due, min(self._last_mark + self._quiet, item.marked + self._max_delay))

    def _write(self, ref: ClaimRef) -> bool:
        """One apply; True when it should be tried again later."""
        previous = self._written.get(ref.uid, [])
        entries = device_entries(self._driver, self._source(ref), previous, self._clock())
        if ref.uid in self._written and entries == previous:
            return False
        path = (f"/apis/resource.k8s.io/v1/namespaces/{quote(ref.namespace, safe='')}/resourceclaims/"
                f"{quote(ref.name, safe='')}/status")
        try:
            stored = request_json(self._api, "PATCH", path, body=apply_body(ref, entries), content_type=APPLY_PATCH,
                                  query=[("fieldManager", self._manager), ("force", "true")],
                                  timeout=_REQUEST_TIMEOUT_S)
        except KubeApiError as err:
            return self._failed(ref, err)
        if dropped_by_server(entries, stored):
            self._disable("the API server dropped status.devices from the claim: its DRAResourceClaimDeviceStatus "
                          "feature gate is probably off; claims will not show their devices' status", ref)
            return False
        if entries:
            self._written[ref.uid] = entries
        else:
            self._written.pop(ref.uid, None)
        return False

    def _failed(self, ref: ClaimRef, err: KubeApiError) -> bool:
        extra = {"claim_uid": ref.uid, "claim_namespace": ref.namespace, "claim_name": ref.name,
                 "status": err.status, "reason": err.reason, "server_message": err.message}
        if err.status not in _REFUSED:
            log.info("writing claim status failed, will retry: %s", err, extra=extra)
            return True
        self._written.pop(ref.uid, None)
        if err.status == 403:
            self._disable(f"the API server refused to let this driver write claim status ({err}); grant "
                          "resourceclaims/status patch and the resourceclaims/driver associated-node verbs", ref)
        elif err.status in (404, 409) and err.status not in self._refusals_logged:
            # Usual at unprepare: a claim made from a template is deleted with its pod.
            self._refusals_logged.add(err.status)
            log.info("a claim was gone or replaced before its status was written (logged once): %s", err,
                     extra=extra)
        elif err.status in (404, 409):
            log.debug("claim gone or replaced, its status is not written", extra=extra)
        elif err.status not in self._refusals_logged:
            self._refusals_logged.add(err.status)
            log.warning("the API server refused a claim status write (logged once): %s", err, extra=extra)
        return False

    def _disable(self, why: str, ref: ClaimRef) -> None:
        with self._cond:
            if self._disabled is None:
                log.error("%s", why, extra={"claim_uid": ref.uid})
            self._disabled = why
            self._pending.clear()
            self._cond.notify_all()
