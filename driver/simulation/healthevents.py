"""SIMULATION: device health events read from a JSON-lines file while the driver runs.

``TESSERA_SIM_EVENTS`` names the file; each line is one event, appended by a test or the demo::

    {"uuid": "GPU-...", "xid": 79}
    {"uuid": "MIG-...", "xid": 94}
    {"uuid": "GPU-...", "xid": 94, "gpu_instance": 3, "compute_instance": 0}
    {"uuid": "GPU-...", "double_bit_ecc": true}
    {"uuid": "GPU-...", "lost": true}
    {"uuid": "GPU-...", "recovered": true}
    {"uuid": "GPU-...", "recovery_action": 1}
    {"uuid": "GPU-...", "row_remap": {"pending": true, "failed": false}}

They become the same :class:`HealthEvent` the NVML source reports: an XID as NVML's
``nvmlEventTypeXidCriticalError`` carries it (the MIG UUID when NVML names a GPU instance, or the GPU and
the ``gpuInstanceId``/``computeInstanceId`` NVML's event data holds, resolved as the NVML source does: from
the inventory, else from what the simulated NVML lists now, for an instance made since the last rescan), a lost
GPU as ``NVML_ERROR_GPU_IS_LOST`` from polling, recovery as a GPU answering again after a reset.
``recovery_action`` is a reading of ``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION`` (0: none) and
``row_remap`` one of ``nvmlDeviceGetRemappedRows``; both go through the NVML source's own rule
(``driver/gpu/health/conditions.py``), so a pending remap leaves the GPU schedulable there too.
A bad line is logged with its line number and skipped; the file may appear after the driver starts.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from driver.gpu.discovery.inventory import NodeInventory
from driver.gpu.health.conditions import (
    REMAP_ON_MIG,
    ROW_REMAPPING,
    ConditionTracker,
    WatchGaps,
    remap_unreadable_on,
)
from driver.gpu.health.model import EventKind, HealthEvent
from driver.gpu.health.monitor import Emit
from driver.gpu.health.nvmlsource import NO_INSTANCE, mig_uuid_for
from driver.gpu.health.sampling import DeviceSample

log = logging.getLogger(__name__)

EVENTS_ENV = "TESSERA_SIM_EVENTS"
POLL_INTERVAL_S = 0.1


class RowRemap(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    pending: bool = False
    failed: bool = False


class SimulatedEvent(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    uuid: str
    xid: int | None = None
    double_bit_ecc: bool = False
    lost: bool = False
    recovered: bool = False
    recovery_action: int | None = Field(default=None, ge=0)
    row_remap: RowRemap | None = None
    gpu_instance: int | None = Field(default=None, ge=0)  # NVML's gpuInstanceId: the event happened in it
    compute_instance: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _exactly_one(self) -> SimulatedEvent:
        count = ((self.xid is not None) + self.double_bit_ecc + self.lost + self.recovered
                 + (self.recovery_action is not None) + (self.row_remap is not None))
        if count != 1:
            raise ValueError("an event needs exactly one of xid (a number), double_bit_ecc, lost, recovered, "
                             "recovery_action (a number) or row_remap")
        if self.gpu_instance is None and self.compute_instance is not None:
            raise ValueError("compute_instance needs gpu_instance (a compute instance is inside a GPU instance)")
        if self.gpu_instance is not None and self.xid is None and not self.double_bit_ecc:
            raise ValueError("gpu_instance goes with an xid or double_bit_ecc event (NVML scopes only those)")
        return self

    def kind(self) -> EventKind:
        if self.xid is not None:
            return EventKind.XID
        if self.double_bit_ecc:
            return EventKind.DOUBLE_BIT_ECC
        return EventKind.LOST if self.lost else EventKind.RECOVERED


def parse_line(text: str, where: str) -> SimulatedEvent:
    try:
        return SimulatedEvent.model_validate(json.loads(text))
    except (json.JSONDecodeError, ValidationError) as err:
        raise ValueError(f"{where}: not a health event ({err}); expected e.g. "
                         '{"uuid": "GPU-...", "xid": 79}') from err


def poll_gaps(gaps: WatchGaps, inventory: NodeInventory) -> None:
    """What the NVML source's poll finds unreadable: remapped rows of MIG GPUs with instances (nvml.h)."""
    for gpu in inventory.gpus:
        if remap_unreadable_on(gpu):
            gaps.unreadable(gpu.uuid, ROW_REMAPPING, REMAP_ON_MIG)
        else:
            gaps.readable(gpu.uuid, ROW_REMAPPING)


class SimulatedHealthEvents:
    """A :class:`driver.gpu.health.monitor.HealthSource` reading ``path`` as it grows."""

    def __init__(self, path: Path, inventory: Callable[[], NodeInventory],
                 current: Callable[[], NodeInventory] | None = None, gaps: WatchGaps | None = None):
        """``current``: what the simulated NVML lists now (a fresh discovery), for events in instances made since
        ``inventory`` was read; ``gaps``: where what NVML cannot report is kept."""
        self._path = path
        self._inventory = inventory
        self._current = current
        self._conditions = ConditionTracker()
        self.gaps = gaps if gaps is not None else WatchGaps()

    def describe(self) -> str:
        return f"SIMULATION: events from {self._path}"

    def run(self, emit: Emit, stop: threading.Event) -> None:
        offset, line_number, pending = 0, 0, b""
        while not stop.is_set():
            poll_gaps(self.gaps, self._inventory())
            try:
                with self._path.open("rb") as handle:
                    if os.fstat(handle.fileno()).st_size < offset:  # truncated: start over
                        offset, line_number, pending = 0, 0, b""
                    handle.seek(offset)
                    chunk = handle.read()
            except FileNotFoundError:
                chunk = b""
            offset += len(chunk)
            pending += chunk
            *lines, pending = pending.split(b"\n")  # a line without its newline is still being written
            for raw in lines:
                line_number += 1
                if raw.strip():
                    self._emit_line(raw.decode(errors="replace"), f"{self._path} line {line_number}", emit)
            stop.wait(POLL_INTERVAL_S)

    def _emit_line(self, text: str, where: str, emit: Emit) -> None:
        try:
            event = parse_line(text, where)
        except ValueError as err:
            log.error("SIMULATION: skipping a bad health event", extra={"reason": str(err)})
            return
        if event.recovery_action is not None:
            self._emit_change(self._conditions.recovery_action(event.uuid, event.recovery_action), emit)
            return
        if event.row_remap is not None:
            if any(remap_unreadable_on(g) for g in self._inventory().gpus if g.uuid == event.uuid):
                log.warning("SIMULATION: a row_remap reading for a GPU in MIG mode with instances is ignored: NVML "
                            "answers NOT_SUPPORTED there", extra={"uuid": event.uuid, "where": where})
                return
            remap = event.row_remap
            self._emit_change(self._conditions.row_remap(event.uuid, remap.pending, remap.failed), emit)
            return
        uuid, parent = event.uuid, self._parent_of(event.uuid)
        if event.gpu_instance is not None:
            mig = self._mig_uuid(event.uuid, event.gpu_instance, event.compute_instance)
            uuid, parent = (mig, event.uuid) if mig is not None else (event.uuid, None)
        emit(HealthEvent(uuid=uuid, kind=event.kind(), xid=event.xid, detail="SIMULATION", parent_uuid=parent))

    def _mig_uuid(self, gpu_uuid: str, gi: int, ci: int | None) -> str | None:
        """The MIG device NVML's (GPU, GPU instance, compute instance) names, as the NVML source finds it."""
        ci_id = NO_INSTANCE if ci is None else ci
        for inventory in (self._inventory, self._current):
            if inventory is None:
                continue
            gpu = next((g for g in inventory().gpus if g.uuid == gpu_uuid), None)
            if (found := mig_uuid_for(gpu, gi, ci_id)) is not None:
                return found
        log.warning("an NVML event names a GPU instance that no longer exists; reported for its whole GPU",
                    extra={"uuid": gpu_uuid, "gpu_instance": gi, "compute_instance": ci})
        return None

    @staticmethod
    def _emit_change(event: HealthEvent | None, emit: Emit) -> None:
        if event is not None:
            emit(event)

    def _parent_of(self, uuid: str) -> str | None:
        for gpu in self._inventory().gpus:
            if any(m.uuid == uuid for m in gpu.mig_instances):
                return gpu.uuid
        return None


class SimulatedHealth:
    """The simulated node's health source: the event file (if any) plus steady simulated readings."""

    def __init__(self, path: Path | None, inventory: Callable[[], NodeInventory],
                 current: Callable[[], NodeInventory] | None = None):
        self._inventory = inventory
        self._gaps = WatchGaps()
        self._events = SimulatedHealthEvents(path, inventory, current, self._gaps) if path is not None else None

    def describe(self) -> str:
        return self._events.describe() if self._events else f"SIMULATION: no events ({EVENTS_ENV} unset)"

    def run(self, emit: Emit, stop: threading.Event) -> None:
        if self._events is not None:
            self._events.run(emit, stop)
            return
        while not stop.is_set():
            poll_gaps(self._gaps, self._inventory())
            stop.wait(POLL_INTERVAL_S)

    def not_watched(self) -> dict[str, dict[str, str]]:
        return self._gaps.current()

    def sample(self) -> dict[str, DeviceSample]:
        # SIMULATION: an idle GPU's readings (about what nvidia-smi shows for an idle H100).
        return {gpu.uuid: DeviceSample(temperature_celsius=34.0, power_watts=70.0, memory_used_bytes=0)
                for gpu in self._inventory().gpus}
