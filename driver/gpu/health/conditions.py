"""GPU conditions NVML reports as a state, not as an event: a recovery action and memory row remapping.

The NVML source reads them (polling, and the recovery-action field when its event arrives); the
simulation reports them from its event file. Both feed the readings through one
:class:`ConditionTracker`, which turns a change of state into the :class:`HealthEvent` that says so,
with the one rule for each:

* Recovery action (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``): anything but none makes the GPU
  unhealthy; back to none clears only ``recovery-action`` (nvml.h: a recovery-action event's
  ``eventData`` is 0, so the action is always read from the field, never from the event).
* Row remapping (``nvmlDeviceGetRemappedRows``): a *pending* remap is no fault. NVIDIA's
  memory-error guide: unaffected applications keep running and new work can start until the next
  GPU reset applies it, so it is logged once and the GPU stays schedulable. A *failed* remap makes
  the GPU unhealthy; clearing it clears only ``row-remapping``.

What cannot be read on a GPU (:class:`WatchGaps`) is logged once when it starts and once when it ends,
and shown by ``inspect``: nvml.h says remapped rows are NOT_SUPPORTED on a GPU in MIG mode with
instances, so a failed remap goes unseen there while instances exist.
"""

from __future__ import annotations

import logging
import threading

from driver.gpu.discovery.inventory import GpuInfo
from driver.gpu.health.model import EventKind, HealthEvent

log = logging.getLogger(__name__)

# XID 154 on a driver whose field 230 cannot be read: some action is asked for, which one is unknown.
UNKNOWN_ACTION = -1
RECOVERY_ACTION_NAMES = {1: "GPU reset", 2: "node reboot", 3: "drain peer-to-peer traffic",
                         4: "drain and reset", 5: "recover the IMEX domain", 6: "bus reset", 7: "system reboot",
                         UNKNOWN_ACTION: "XID 154 reported and NVML field 230 unreadable: a reset is assumed"}


class ConditionTracker:
    """The last recovery action and row-remap state seen per GPU; each reading returns what changed."""

    def __init__(self) -> None:
        self._needs_action: set[str] = set()
        self._remap_pending: set[str] = set()
        self._remap_failed: set[str] = set()

    def recovery_action(self, uuid: str, action: int) -> HealthEvent | None:
        if action != 0 and uuid not in self._needs_action:
            self._needs_action.add(uuid)
            return HealthEvent(uuid, EventKind.RECOVERY_ACTION,
                               detail=RECOVERY_ACTION_NAMES.get(action, f"recovery action {action}"))
        if action == 0 and uuid in self._needs_action:
            self._needs_action.discard(uuid)
            return HealthEvent(uuid, EventKind.RECOVERED, detail="NVML reports no recovery action needed",
                               clears="recovery-action")
        return None

    def row_remap(self, uuid: str, pending: bool, failed: bool) -> HealthEvent | None:
        if pending and uuid not in self._remap_pending:
            self._remap_pending.add(uuid)
            log.warning("a memory row remap is pending on a GPU: it applies at the next GPU reset; running and "
                        "new work is unaffected until then, so the GPU stays schedulable", extra={"uuid": uuid})
        elif not pending and uuid in self._remap_pending:
            self._remap_pending.discard(uuid)
            log.info("no memory row remap pending on the GPU any more", extra={"uuid": uuid})
        if failed and uuid not in self._remap_failed:
            self._remap_failed.add(uuid)
            return HealthEvent(uuid, EventKind.ROW_REMAPPING, detail="remapping failed")
        if not failed and uuid in self._remap_failed:
            self._remap_failed.discard(uuid)
            return HealthEvent(uuid, EventKind.RECOVERED, detail="no failed memory row remapping any more",
                               clears="row-remapping")
        return None


ROW_REMAPPING = "memory row remapping"
RECOVERY_ACTION = "the recovery action"
# nvml.h (nvmlDeviceGetRemappedRows): "On MIG-enabled GPUs with active instances, querying the number of remapped
# rows is not supported".
REMAP_ON_MIG = ("NVML does not report remapped rows on a GPU in MIG mode with instances (nvml.h); a failed remap is "
                "not detected while instances exist (XID 64 still is)")


def remap_unreadable_on(gpu: GpuInfo) -> bool:
    """Whether NVML answers NOT_SUPPORTED for the GPU's remapped rows because of its MIG instances."""
    return gpu.mig_enabled and bool(gpu.mig_instances)


class WatchGaps:
    """What cannot be read on each GPU now, and why; each change is logged once. Changed on the health source's
    thread, read on the publishing one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._gaps: dict[tuple[str, str], str] = {}

    def unreadable(self, uuid: str, what: str, why: str) -> None:
        with self._lock:
            new = self._gaps.get((uuid, what)) is None
            self._gaps[(uuid, what)] = why
        if new:
            log.warning(f"{what} of a GPU cannot be read: {why}", extra={"uuid": uuid, "not_watched": what})

    def readable(self, uuid: str, what: str) -> None:
        with self._lock:
            gone = self._gaps.pop((uuid, what), None) is not None
        if gone:
            log.info(f"{what} of a GPU can be read again", extra={"uuid": uuid, "watched": what})

    def current(self) -> dict[str, dict[str, str]]:
        """GPU UUID -> what cannot be read on it -> why (for ``inspect``)."""
        with self._lock:
            gaps = sorted(self._gaps.items())
        result: dict[str, dict[str, str]] = {}
        for (uuid, what), why in gaps:
            result.setdefault(uuid, {})[what] = why
        return result
