"""Device health on real nodes: NVML events on a waiting thread, plus polling for what events miss.

Events (nvml.h, ``nvmlDeviceRegisterEvents`` / ``nvmlEventSetWait_v2``): XID critical errors
(``eventData`` is the XID), double-bit ECC errors, GPU unavailable, and recovery-action changes,
each registered only where ``nvmlDeviceGetSupportedEventTypes`` says the GPU has it. An event
with a ``gpuInstanceId`` other than 0xFFFFFFFF happened inside that GPU instance: it is reported
for the MIG device with that GPU (and compute) instance, so only that MIG device goes unhealthy.
Polling (every ``poll_interval`` seconds) catches a GPU that stopped answering
(``NVML_ERROR_GPU_IS_LOST``), NVML's recovery action (``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``:
a GPU reset, drain or reboot needed) and memory row remapping pending or failed
(``nvmlDeviceGetRemappedRows``); a GPU that answers again, or whose recovery action or failed
remap went away after a reset, is reported recovered from that condition only.

A recovery-action event carries no action: nvml.h says ``eventData`` "Stores Xid error for the
device in the event of nvmlEventTypeXidCriticalError, eventData is 0 for any other event". The
action is read from the field value when the event arrives. What a recovery action or a row remap
means for health is ``conditions.py``'s rule, shared with the simulation.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from driver.gpu.discovery.inventory import GpuInfo, NodeInventory
from driver.gpu.health.conditions import ConditionTracker
from driver.gpu.health.model import EventKind, HealthEvent
from driver.gpu.health.monitor import Emit
from driver.gpu.health.sampling import DeviceSample

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
    if event_type & getattr(nvml, "nvmlEventTypeGpuUnavailableError", 0):
        return HealthEvent(uuid, EventKind.LOST, detail="NVML reported the GPU unavailable")
    return None


def is_recovery_action_event(nvml: Any, event_type: int) -> bool:
    """Whether an NVML event says the GPU's recovery action changed (read the field for the new one)."""
    return bool(event_type & getattr(nvml, "nvmlEventTypeGpuRecoveryAction", 0))


def mig_uuid_for(gpu: GpuInfo | None, gpu_instance_id: int, compute_instance_id: int) -> str | None:
    if gpu is None or gpu_instance_id == NO_INSTANCE:
        return None
    for mig in gpu.mig_instances:
        if mig.gi_id == gpu_instance_id and compute_instance_id in (NO_INSTANCE, mig.ci_id):
            return mig.uuid
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

    def describe(self) -> str:
        return "NVML events and polling"

    def run(self, emit: Emit, stop: threading.Event) -> None:
        nvml = self._nvml
        nvml.nvmlInit()
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
        wanted = (nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeDoubleBitEccError
                  | getattr(nvml, "nvmlEventTypeGpuUnavailableError", 0)
                  | getattr(nvml, "nvmlEventTypeGpuRecoveryAction", 0))
        for gpu in self._inventory().gpus:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
                supported = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
                nvml.nvmlDeviceRegisterEvents(handle, wanted & supported, event_set)
            except nvml.NVMLError as err:
                # Without events the GPU is still polled (lost GPU, recovery action).
                log.warning("cannot watch NVML events of a GPU; it is only polled",
                            extra={"uuid": gpu.uuid, "reason": str(err)})

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
        event = event_for(nvml, int(data.eventType), int(data.eventData), uuid,
                          mig_uuid_for(gpu, int(data.gpuInstanceId), int(data.computeInstanceId)))
        if event is not None:
            emit(event)

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
            self._poll_row_remapping(gpu.uuid, handle, emit)

    def _poll_row_remapping(self, uuid: str, handle: Any, emit: Emit) -> None:
        nvml = self._nvml
        try:
            _corrected, _uncorrected, pending, failed = nvml.nvmlDeviceGetRemappedRows(handle)
        except (nvml.NVMLError, AttributeError):
            return  # not supported (pre-Ampere GPUs) or a pynvml without it
        if (event := self._conditions.row_remap(uuid, bool(pending), bool(failed))) is not None:
            emit(event)

    def _check_recovery_action(self, uuid: str, handle: Any, emit: Emit) -> None:
        """Read ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (on its event, and at each poll)."""
        nvml = self._nvml
        field = getattr(nvml, "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION", None)
        if field is None:
            return
        try:
            value = nvml.nvmlDeviceGetFieldValues(handle, [field])[0]
        except (nvml.NVMLError, IndexError):
            return
        if getattr(value, "nvmlReturn", 0) != 0:
            return  # not supported by this GPU or driver
        if (event := self._conditions.recovery_action(uuid, int(value.value.uiVal))) is not None:
            emit(event)
