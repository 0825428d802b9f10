"""Health events and the health of one GPU or MIG device, as the monitor keeps them.

Every source (NVML events and polling on a real node, the simulation's event file) reports
:class:`HealthEvent`; :func:`apply_event` is the one rule for what an event does. Pure; no I/O.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from enum import StrEnum

from driver.gpu.health.xids import classify_xid


class EventKind(StrEnum):
    XID = "xid"  # an XID critical-error event (NVML nvmlEventTypeXidCriticalError)
    DOUBLE_BIT_ECC = "double-bit-ecc"  # uncorrectable memory error (nvmlEventTypeDoubleBitEccError)
    LOST = "lost"  # the GPU does not answer (NVML_ERROR_GPU_IS_LOST, or its handle is gone)
    RECOVERY_ACTION = "recovery-action"  # NVML asks for a reset, drain or reboot
    ROW_REMAPPING = "row-remapping"  # a memory row remap is pending (needs a reset) or failed
    RECOVERED = "recovered"  # the device works again (answers after being lost, reset done)


@dataclass(frozen=True)
class HealthEvent:
    """Something that happened to ``uuid`` (a ``GPU-`` or ``MIG-`` UUID).

    ``parent_uuid`` is the GPU of a MIG device, so that a GPU's recovery also clears its MIG devices.
    ``clears`` (RECOVERED only): the one reason this recovery refers to (a GPU that answers again
    clears ``gpu-lost``, nothing else); None means the device as a whole was recovered (reset).
    """

    uuid: str
    kind: EventKind
    xid: int | None = None
    detail: str = ""
    parent_uuid: str | None = None
    clears: str | None = None


@dataclass(frozen=True)
class UuidHealth:
    """An unhealthy GPU or MIG device. ``reason`` is short and label-value shaped (taint value).

    ``more``: further ``(reason, message)`` conditions that arose while it was unhealthy; shown
    only once the first is cleared, so a recovery from one condition never hides another.
    """

    reason: str
    message: str
    since: float
    parent_uuid: str | None = None
    more: tuple[tuple[str, str], ...] = ()


def _clear(health: UuidHealth, reason: str | None) -> UuidHealth | None:
    """``health`` without ``reason`` (None: every reason); None when nothing is left."""
    if reason is None:
        return None
    if health.reason != reason:
        return replace(health, more=tuple(m for m in health.more if m[0] != reason))
    if not health.more:
        return None
    (next_reason, next_message), *rest = health.more
    return replace(health, reason=next_reason, message=next_message, more=tuple(rest))


Health = Mapping[str, UuidHealth]  # only unhealthy UUIDs are present


def apply_event(health: Health, event: HealthEvent, ignored_xids: Collection[int], now: float) -> dict[str, UuidHealth]:
    """The health after ``event``; the input is not changed. A device already unhealthy keeps its first
    reason, and remembers the others until each is cleared."""
    result = dict(health)
    if event.kind is EventKind.RECOVERED:
        # A recovery from one condition (no recovery action needed any more) says nothing about another
        # (an XID 79, a double-bit ECC error): only the reason it refers to goes.
        for uuid in [u for u, h in result.items() if u == event.uuid or h.parent_uuid == event.uuid]:
            left = _clear(result[uuid], event.clears)
            if left is None:
                del result[uuid]
            else:
                result[uuid] = left
        return result
    if event.kind is EventKind.XID:
        if event.xid is None:
            raise ValueError(f"an XID event for {event.uuid} carries no XID number")
        verdict = classify_xid(event.xid, ignored_xids)
        if not verdict.makes_unhealthy:
            return result
        reason, message = f"xid-{event.xid}", verdict.why
    elif event.kind is EventKind.DOUBLE_BIT_ECC:
        reason, message = "ecc-double-bit", "uncorrectable (double-bit) ECC memory error"
    elif event.kind is EventKind.LOST:
        reason, message = "gpu-lost", "the GPU has fallen off the bus or stopped answering NVML"
    elif event.kind is EventKind.ROW_REMAPPING:
        reason, message = "row-remapping", "memory row remapping is pending or failed"
    else:
        reason, message = "recovery-action", "NVML asks for a recovery action"
    if event.detail:
        message = f"{message}: {event.detail}"
    current = result.get(event.uuid)
    if current is None:
        result[event.uuid] = UuidHealth(reason, message, now, event.parent_uuid)
    elif reason != current.reason and reason not in (m[0] for m in current.more):
        result[event.uuid] = replace(current, more=(*current.more, (reason, message)))
    return result
