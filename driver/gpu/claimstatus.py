"""What a prepared claim got, as its ``status.devices`` entries say it (and ``inspect`` shows it).

Per allocated device: condition ``Ready`` (the device is configured: CDI spec written, its MPS daemon or
time slice in place) and ``Healthy`` (the GPU's health as the driver sees it), and ``data`` naming the
GPU (its UUID, the MIG UUID of a MIG device, created for the claim or existing), its product and memory,
and for a share each limit with how it is enforced, in the words of the published attributes
(``activeThreadPercentage``, ``computeLimitEnforcement``, ``memoryLimitEnforcement``,
``timeSliceInterval``). Built at the moment of writing from the checkpoint, the current view and the
health monitor. Pure functions; :class:`ClaimStatusSource` gathers their inputs, and leaves what it reported
in ``claim-status.json`` in the state directory, where ``inspect`` shows it.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cdi.atomicfile import write_atomic
from driver.gpu.claimconfig.choices import SHARE_KINDS
from driver.gpu.health.published import DeviceCondition
from driver.gpu.mps.model import MpsDaemonRecord
from driver.gpu.published.devices import quantity_from_bytes
from driver.gpu.published.sharelayout import Enforcement
from driver.gpu.published.targets import NodeView
from driver.gpu.record.checkpoint import Checkpoint, ClaimPhase, ClaimRecord, PreparedDeviceRecord
from driver.kubeletplugin.claimstatus import Condition, DeviceStatus
from driver.kubeletplugin.kubeclient import api_time
from driver.kubeletplugin.types import ClaimRef

log = logging.getLogger(__name__)

_NOT_REASON = re.compile(r"[^A-Za-z0-9_]")
STATUS_FILE = "claim-status.json"


@dataclass(frozen=True)
class Restored:
    """Limits of a claim's MPS daemon that a client changed and the driver set back."""

    count: int
    last: str  # ISO 8601, UTC


def claim_statuses(record: ClaimRecord | None, daemons: Mapping[str, MpsDaemonRecord], view: NodeView,
                   unhealthy: Mapping[str, DeviceCondition], restored: Restored | None) -> list[DeviceStatus]:
    """The entries of a claim; none unless it is completely prepared on this node."""
    if record is None or record.phase != ClaimPhase.PREPARE_COMPLETED:
        return []
    prepared = _rfc3339(record.updated_at)
    return [DeviceStatus(pool=d.device.pool_name, device=d.device.device_name, share_id=d.device.share_id,
                         conditions=(_ready(prepared), _healthy(unhealthy.get(d.device.device_name), prepared)),
                         data=device_data(record, d, daemons, view, restored))
            for d in record.devices]


def _rfc3339(text: str) -> str | None:
    try:
        return api_time(datetime.fromisoformat(text))
    except ValueError:
        return None


def _ready(prepared: str | None) -> Condition:
    return Condition("Ready", True, "Prepared", "configured on this node; its containers get the device through CDI",
                     since=prepared)


def _healthy(problem: DeviceCondition | None, prepared: str | None) -> Condition:
    if problem is None:  # healthy since the prepare, as far as a restarted driver can tell
        return Condition("Healthy", True, "Healthy", "no health event reported for this device's GPU", since=prepared)
    reason = _NOT_REASON.sub("", problem.reason) or "Unhealthy"
    return Condition("Healthy", False, reason if reason[0].isalpha() else "Unhealthy" + reason, problem.message,
                     since=api_time(datetime.fromtimestamp(problem.since, UTC)))


def device_data(record: ClaimRecord, device: PreparedDeviceRecord, daemons: Mapping[str, MpsDaemonRecord],
                view: NodeView, restored: Restored | None) -> dict[str, Any]:
    """The ``data`` of one device: what the claim got on it."""
    target = view.targets.get(device.device.device_name)
    gpu = next((g for g in view.inventory.gpus if g.uuid == device.gpu_uuid), None)
    data: dict[str, Any] = {"type": device.kind, "gpuUUID": device.gpu_uuid}
    if device.mig_uuid:
        data["migUUID"] = device.mig_uuid
    if device.dynamic_mig is not None:
        data["migCreatedForClaim"] = True
        data["migProfile"] = device.dynamic_mig.profile
    elif target is not None and target.mig is not None:
        data["migProfile"] = target.mig.profile
    if gpu is not None:
        data["productName"] = gpu.product_name
    memory = target.memory_bytes if target is not None else (gpu.memory_bytes if gpu is not None else None)
    if memory:
        # A share's own limits are under "sharing"; its memory here is the whole GPU's.
        data["gpuMemory" if device.kind in SHARE_KINDS else "memory"] = quantity_from_bytes(memory)
    if device.admin_access:
        data["adminAccess"] = True
    sharing = _sharing(record, device, daemons, view, restored)
    if sharing:
        data["sharing"] = sharing
    return data


def _sharing(record: ClaimRecord, device: PreparedDeviceRecord, daemons: Mapping[str, MpsDaemonRecord],
             view: NodeView, restored: Restored | None) -> dict[str, Any]:
    target = view.targets.get(device.device.device_name)
    shares = target.form if target is not None else None
    driver_version = view.inventory.driver_version
    daemon = daemons.get(device.mps_daemon_id) if device.mps_daemon_id else None
    sharing: dict[str, Any] = {}
    if daemon is not None:
        enforcement = record.mps_enforcement or (
            shares.memory_enforcement(driver_version) if shares is not None else Enforcement.MPS_PER_PROCESS)
        sharing["strategy"] = "MPS"
        sharing["mpsDaemon"] = daemon.spec.daemon_id
        if daemon.spec.active_thread_percentage is not None:
            sharing["activeThreadPercentage"] = daemon.spec.active_thread_percentage
            sharing["computeLimitEnforcement"] = enforcement.value
        pinned = daemon.spec.pinned_memory_limits.get(device.mig_uuid or device.gpu_uuid)
        if pinned is not None:
            sharing["pinnedMemoryLimit"] = quantity_from_bytes(pinned)
            sharing["memoryLimitEnforcement"] = enforcement.value
        if restored is not None:
            sharing["limitsRestored"] = restored.count
            sharing["lastLimitsRestore"] = restored.last
    elif device.consumed_memory_bytes is not None or device.consumed_multiprocessors is not None:
        sharing["strategy"] = "Consumable"
        if device.consumed_memory_bytes is not None:
            sharing["memory"] = quantity_from_bytes(device.consumed_memory_bytes)
        if device.consumed_multiprocessors is not None:
            sharing["multiprocessors"] = device.consumed_multiprocessors
        if shares is not None:
            sharing["memoryLimitEnforcement"] = shares.memory_enforcement(driver_version).value
            sharing["computeLimitEnforcement"] = shares.compute_enforcement(driver_version).value
    if record.timeslice is not None and device.gpu_uuid in record.timeslice.gpu_uuids:
        sharing.setdefault("strategy", "TimeSlicing")
        sharing["timeSliceInterval"] = record.timeslice.interval
    elif shares is not None and shares.strategy == "TimeSlicing":
        sharing["strategy"] = "TimeSlicing"
        sharing["timeSliceInterval"] = shares.interval or "Default"
    if shares is not None and shares.strategy == "TimeSlicing":
        sharing["memoryLimitEnforcement"] = shares.memory_enforcement(driver_version).value
        sharing["computeLimitEnforcement"] = shares.compute_enforcement(driver_version).value
    return sharing


class ClaimStatusSource:
    """The driver's :data:`driver.kubeletplugin.claimstatus.StatusSource`: reads the checkpoint, the view and
    health when a claim's status is written, and keeps count of its MPS limits restored."""

    def __init__(self, checkpoint: Callable[[], Checkpoint], view: Callable[[], NodeView],
                 unhealthy: Callable[[NodeView], Mapping[str, DeviceCondition]], report_path: Path | None = None):
        self._checkpoint = checkpoint
        self._view = view
        self._unhealthy = unhealthy
        self._report_path = report_path
        self._lock = threading.Lock()
        self._restored: dict[str, Restored] = {}
        self._reported: dict[str, list[dict[str, Any]]] = {}

    def limits_restored(self, claim_uid: str) -> None:
        with self._lock:
            before = self._restored.get(claim_uid)
            self._restored[claim_uid] = Restored((before.count if before else 0) + 1, api_time())

    def prepared_claims(self) -> list[ClaimRef]:
        return [ClaimRef(namespace=r.namespace, name=r.name, uid=r.uid) for r in self._checkpoint().claims.values()
                if r.phase == ClaimPhase.PREPARE_COMPLETED]

    def __call__(self, ref: ClaimRef) -> list[DeviceStatus]:
        checkpoint = self._checkpoint()
        record = checkpoint.claims.get(ref.uid)
        if record is None:
            with self._lock:
                self._restored.pop(ref.uid, None)
        view = self._view()
        with self._lock:
            restored = self._restored.get(ref.uid)
        statuses = claim_statuses(record, checkpoint.mps_daemons, view, self._unhealthy(view), restored)
        self._report(ref.uid, statuses)
        return statuses

    def _report(self, uid: str, statuses: Sequence[DeviceStatus]) -> None:
        with self._lock:
            if statuses:
                self._reported[uid] = [shown(s) for s in statuses]
            else:
                self._reported.pop(uid, None)
            text = json.dumps(self._reported, indent=1, sort_keys=True).encode()
            if self._report_path is None:
                return
            try:
                write_atomic(self._report_path, text, mode=0o644, durable=False, sync_data=False)
            except OSError as exc:  # only inspect's view is missing; the claims' status is still written
                log.warning("cannot write %s for inspect: %s", self._report_path, exc)


def shown(status: DeviceStatus) -> dict[str, Any]:
    """One device's status as ``inspect`` shows it: what its ``status.devices`` entry says."""
    return {"device": status.device, "shareID": status.share_id, "data": dict(status.data),
            "conditions": [{"type": c.type, "status": "Unknown" if c.status is None else str(c.status),
                            "reason": c.reason, "message": c.message} for c in status.conditions]}


def add_to_inspect(report: dict[str, Any], path: Path) -> None:
    """Put each prepared claim's ``status.devices`` (as last reported) into an ``inspect`` report."""
    try:
        reported = json.loads(path.read_text())
    except FileNotFoundError:
        return
    except (OSError, ValueError) as exc:
        report["problems"].append(f"{path} cannot be read ({exc}); the driver rewrites it at its next status write")
        return
    for claim in report.get("claims", []):
        claim["status_devices"] = reported.get(claim["uid"], [])


def render_lines(claim: dict[str, Any]) -> list[str]:
    """``inspect``'s lines for one claim's ``status.devices``."""
    lines = []
    for entry in claim.get("status_devices") or []:
        conditions = " ".join(f"{c['type']}={c['status']}" for c in entry["conditions"])
        lines.append(f"    status.devices {entry['device']}: {conditions} "
                     f"{json.dumps(entry['data'], sort_keys=True, separators=(',', ':'))}")
    return lines
