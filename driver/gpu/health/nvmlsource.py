"""Device health on real nodes: NVML events on a waiting thread, plus polling for what events miss.

Which events and polled readings make a device unhealthy and clear it again, why a recovery-action event is
followed by reading NVML's field (its ``eventData`` is 0), how an event in a GPU instance the inventory does not
list yet still reaches only that MIG device, and what is logged as not watched: docs/operations.md, "Device
health" ("Watching", "GPU resets and recovery actions", "What cannot be watched", "XIDs in new MIG instances").
What a recovery action or a row remap means for health is ``conditions.py``'s rule, shared with the simulation;
the XID itself does not decide (``xids.py``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from driver.gpu.discovery.inventory import GpuInfo, NodeInventory
from driver.gpu.discovery.nvmlvalues import as_text
from driver.gpu.health.conditions import (
    RECOVERY_ACTION,
    REMAP_ON_MIG,
    ROW_REMAPPING,
    UNKNOWN_ACTION,
    ConditionTracker,
    WatchGaps,
)
from driver.gpu.health.model import EventKind, HealthEvent
from driver.gpu.health.monitor import Emit
from driver.gpu.health.nvmlnames import (
    GPU_UNAVAILABLE_EVENT,
    RECOVERY_ACTION_EVENT,
    RECOVERY_ACTION_FIELD,
    missing_names,
    nvml_value,
)
from driver.gpu.health.sampling import DeviceSample
from driver.gpu.health.xids import RECOVERY_ACTION_XID, ROW_REMAP_XIDS

log = logging.getLogger(__name__)

# nvml.h: the event did not happen inside a GPU or compute instance.
NO_INSTANCE = 0xFFFFFFFF


def event_for(nvml: Any, event_type: int, event_data: int, uuid: str, mig_uuid: str | None) -> HealthEvent | None:
    """The health event for one NVML event on GPU ``uuid`` (``mig_uuid``: the MIG device it happened in)."""
    target, parent = (mig_uuid, uuid) if mig_uuid is not None else (uuid, None)
    if event_type & nvml.nvmlEventTypeXidCriticalError:
        return HealthEvent(target, EventKind.XID, xid=int(event_data), parent_uuid=parent)
    if event_type & nvml.nvmlEventTypeDoubleBitEccError:
        return HealthEvent(target, EventKind.DOUBLE_BIT_ECC, parent_uuid=parent)
    if event_type & nvml_value(nvml, GPU_UNAVAILABLE_EVENT):
        return HealthEvent(uuid, EventKind.LOST, detail="NVML reported the GPU unavailable")
    return None


def is_recovery_action_event(nvml: Any, event_type: int) -> bool:
    """Whether an NVML event says the GPU's recovery action changed (read the field for the new one)."""
    return bool(event_type & nvml_value(nvml, RECOVERY_ACTION_EVENT))


def mig_uuid_for(gpu: GpuInfo | None, gpu_instance_id: int, compute_instance_id: int) -> str | None:
    if gpu is None or gpu_instance_id == NO_INSTANCE:
        return None
    for mig in gpu.mig_instances:
        if mig.gi_id == gpu_instance_id and compute_instance_id in (NO_INSTANCE, mig.ci_id):
            return mig.uuid
    return None


def live_mig_uuid(nvml: Any, handle: Any, gpu_instance_id: int, compute_instance_id: int) -> str | None:
    """The MIG device of GPU instance ``gpu_instance_id`` as NVML lists it now (None: there is none)."""
    try:
        count = int(nvml.nvmlDeviceGetMaxMigDeviceCount(handle))
    except nvml.NVMLError:
        return None
    for index in range(count):
        try:
            mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, index)
            if int(nvml.nvmlDeviceGetGpuInstanceId(mig)) != gpu_instance_id:
                continue
            if compute_instance_id not in (NO_INSTANCE, int(nvml.nvmlDeviceGetComputeInstanceId(mig))):
                continue
            return as_text(nvml.nvmlDeviceGetUUID(mig))
        except nvml.NVMLError:
            continue  # an empty slot (NOT_FOUND), or one destroyed while listed
    return None


class NvmlHealthSource:
    """A :class:`driver.gpu.health.monitor.HealthSource` and sampler over NVML (``nvml``: the pynvml module)."""

    def __init__(self, nvml: Any, inventory: Callable[[], NodeInventory], poll_interval: float = 5.0,
                 wait_ms: int = 1000):
        self._nvml = nvml
        self._inventory = inventory
        self._poll_interval = poll_interval
        self._wait_ms = wait_ms
        self._lost: set[str] = set()
        self._conditions = ConditionTracker()
        self._gaps = WatchGaps()
        self._events_said: set[str] = set()  # GPUs whose missing event types were logged

    def describe(self) -> str:
        return "NVML events and polling"

    def run(self, emit: Emit, stop: threading.Event) -> None:
        nvml = self._nvml
        nvml.nvmlInit()
        if missing := missing_names(nvml):
            log.info("this pynvml lacks some NVML names; nvml.h's values are used for them (the driver says "
                     "whether it supports each)", extra={"names": missing})
        event_set = None
        try:
            event_set = nvml.nvmlEventSetCreate()
            self._register(event_set)
            next_poll = 0.0
            while not stop.is_set():
                if time.monotonic() >= next_poll:
                    self._poll(emit)
                    next_poll = time.monotonic() + self._poll_interval
                self._wait_once(event_set, emit, stop)
        finally:
            if event_set is not None:
                nvml.nvmlEventSetFree(event_set)
            nvml.nvmlShutdown()

    def sample(self) -> dict[str, DeviceSample]:
        nvml = self._nvml
        samples: dict[str, DeviceSample] = {}
        for gpu in self._inventory().gpus:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            except nvml.NVMLError:
                continue
            samples[gpu.uuid] = self._sample(handle)
        return samples

    def _sample(self, handle: Any) -> DeviceSample:
        nvml = self._nvml
        return DeviceSample(
            temperature_celsius=self._optional(lambda: float(nvml.nvmlDeviceGetTemperature(
                handle, nvml.NVML_TEMPERATURE_GPU))),
            # nvmlDeviceGetPowerUsage answers milliwatts.
            power_watts=self._optional(lambda: nvml.nvmlDeviceGetPowerUsage(handle) / 1000.0),
            memory_used_bytes=self._optional(lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).used)))

    def _optional(self, read: Callable[[], Any]) -> Any:
        try:
            return read()
        except self._nvml.NVMLError:
            return None

    def _register(self, event_set: Any) -> None:
        nvml = self._nvml
        kinds = {"XID": int(nvml.nvmlEventTypeXidCriticalError),
                 "double-bit ECC": int(nvml.nvmlEventTypeDoubleBitEccError),
                 "GPU unavailable": nvml_value(nvml, GPU_UNAVAILABLE_EVENT),
                 "recovery action": nvml_value(nvml, RECOVERY_ACTION_EVENT)}
        wanted = 0
        for bit in kinds.values():
            wanted |= bit
        for gpu in self._inventory().gpus:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
                supported = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
                nvml.nvmlDeviceRegisterEvents(handle, wanted & supported, event_set)
            except nvml.NVMLError as err:
                # Without events the GPU is still polled (lost GPU, recovery action).
                log.warning("cannot watch NVML events of a GPU; it is only polled",
                            extra={"uuid": gpu.uuid, "reason": str(err)})
                continue
            lacking = [name for name, bit in kinds.items() if not bit & supported]
            if lacking and gpu.uuid not in self._events_said:
                self._events_said.add(gpu.uuid)
                # The recovery action and a lost GPU are polled anyway; XIDs and ECC errors have no poll.
                unseen = [k for k in lacking if k in ("XID", "double-bit ECC")]
                log.warning("the GPU's driver does not report some NVML event types: "
                            + (f"{' and '.join(unseen)} errors go unseen; " if unseen else "")
                            + f"the recovery action and a lost GPU are polled every {self._poll_interval:g} s",
                            extra={"uuid": gpu.uuid, "events_not_reported": lacking})

    def not_watched(self) -> dict[str, dict[str, str]]:
        """GPU UUID -> what cannot be read on it now -> why (for ``inspect``)."""
        return self._gaps.current()

    def _wait_once(self, event_set: Any, emit: Emit, stop: threading.Event) -> None:
        nvml = self._nvml
        try:
            data = nvml.nvmlEventSetWait_v2(event_set, self._wait_ms)
        except nvml.NVMLError as err:
            if getattr(err, "value", None) != nvml.NVML_ERROR_TIMEOUT:
                log.warning("waiting for NVML events failed", extra={"reason": str(err)})
                stop.wait(1.0)
            return
        try:
            uuid = str(nvml.nvmlDeviceGetUUID(data.device))
        except nvml.NVMLError as err:
            log.warning("NVML event for a GPU that cannot be named", extra={"reason": str(err)})
            return
        if is_recovery_action_event(nvml, int(data.eventType)):
            self._check_recovery_action(uuid, data.device, emit)
            return
        gpu = next((g for g in self._inventory().gpus if g.uuid == uuid), None)
        gi, ci = int(data.gpuInstanceId), int(data.computeInstanceId)
        mig_uuid = mig_uuid_for(gpu, gi, ci)
        if mig_uuid is None and gi != NO_INSTANCE:
            # An instance made since the inventory was read: NVML knows it, the inventory will at the next rescan.
            mig_uuid = live_mig_uuid(nvml, data.device, gi, ci)
            if mig_uuid is None:
                log.warning("an NVML event names a GPU instance that no longer exists; reported for its whole GPU",
                            extra={"uuid": uuid, "gpu_instance": gi, "compute_instance": ci})
        event = event_for(nvml, int(data.eventType), int(data.eventData), uuid, mig_uuid)
        if event is None:
            return
        emit(event)
        if event.kind is EventKind.XID and event.xid == RECOVERY_ACTION_XID:
            self._check_recovery_action(uuid, data.device, emit, announced=True)
        elif event.kind is EventKind.XID and event.xid in ROW_REMAP_XIDS and gpu is not None:
            self._poll_row_remapping(gpu, data.device, emit)

    def poll_once(self, emit: Emit) -> None:
        """One poll of every GPU, NVML already initialised (``scripts/health-probe.py`` on a real node)."""
        self._poll(emit)

    def _poll(self, emit: Emit) -> None:
        nvml = self._nvml
        for gpu in self._inventory().gpus:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
                nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU)
            except nvml.NVMLError as err:
                lost = getattr(err, "value", None) in (nvml.NVML_ERROR_GPU_IS_LOST, nvml.NVML_ERROR_NOT_FOUND)
                if lost and gpu.uuid not in self._lost:
                    self._lost.add(gpu.uuid)
                    emit(HealthEvent(gpu.uuid, EventKind.LOST, detail=str(err)))
                continue
            if gpu.uuid in self._lost:
                self._lost.discard(gpu.uuid)
                emit(HealthEvent(gpu.uuid, EventKind.RECOVERED, detail="the GPU answers NVML again",
                                 clears="gpu-lost"))
            self._check_recovery_action(gpu.uuid, handle, emit)
            self._poll_row_remapping(gpu, handle, emit)

    def _poll_row_remapping(self, gpu: GpuInfo, handle: Any, emit: Emit) -> None:
        nvml = self._nvml
        what = ROW_REMAPPING
        try:
            _corrected, _uncorrected, pending, failed = nvml.nvmlDeviceGetRemappedRows(handle)
        except AttributeError:
            self._gaps.unreadable(gpu.uuid, what, "this pynvml has no nvmlDeviceGetRemappedRows; a failed remap is "
                                                  "not detected (XID 64 still is)")
            return
        except nvml.NVMLError as err:
            self._gaps.unreadable(gpu.uuid, what, _remap_unreadable(nvml, gpu, err))
            return
        self._gaps.readable(gpu.uuid, what)
        if (event := self._conditions.row_remap(gpu.uuid, bool(pending), bool(failed))) is not None:
            emit(event)

    def _check_recovery_action(self, uuid: str, handle: Any, emit: Emit, announced: bool = False) -> None:
        """Read ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (on its event or XID 154, and at each poll). ``announced``:
        XID 154 said the action changed; where the field cannot be read, a reset is then assumed to be asked for
        (cleared when the field reads none, else by a plugin restart) rather than the XID being ignored."""
        nvml = self._nvml
        what = RECOVERY_ACTION
        try:
            value = nvml.nvmlDeviceGetFieldValues(handle, [nvml_value(nvml, RECOVERY_ACTION_FIELD)])[0]
            returned = int(getattr(value, "nvmlReturn", 0))
            why = (f"the driver answers NVML field 230 with error {returned} (older than r570, or not on this GPU)"
                   if returned != 0 else "")
        except (nvml.NVMLError, IndexError) as err:
            why = f"NVML field 230 could not be read ({err})"
        if why:
            self._gaps.unreadable(uuid, what, f"{why}; a GPU asking for a reset is seen only through its XIDs "
                                              "(XID 154 is then taken as asking for one)")
            action = UNKNOWN_ACTION if announced else None
        else:
            self._gaps.readable(uuid, what)
            action = int(value.value.uiVal)
        if action is not None and (event := self._conditions.recovery_action(uuid, action)) is not None:
            emit(event)


def _remap_unreadable(nvml: Any, gpu: GpuInfo, err: Exception) -> str:
    if getattr(err, "value", None) != nvml.NVML_ERROR_NOT_SUPPORTED:
        return f"nvmlDeviceGetRemappedRows failed ({err}); a failed remap is not detected (XID 64 still is)"
    if gpu.mig_enabled:  # instances made since the inventory was read count too
        return REMAP_ON_MIG
    return "this GPU does not support row remapping (before Ampere); a failed remap is not detected (XID 64 still is)"
