"""The node's device health, turned into what the rest of the driver needs.

From the monitor's GPU/MIG health and the view in force: the devices to publish (with a taint on
each unhealthy one, where taints are published), the kubelet health board (every published
device, Healthy or Unhealthy with the reason), the prepare refusals, and the health metrics.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path

from driver.gpu.health.monitor import HealthMonitor
from driver.gpu.health.published import (
    DeviceCondition,
    TaintEffect,
    health_taint,
    unhealthy_devices,
    with_taints,
)
from driver.gpu.health.report import write_report
from driver.gpu.health.sampling import DeviceSampler
from driver.gpu.published.targets import NodeView
from driver.kubeletplugin.healthservice import DeviceHealthStatus, Health, HealthBoard
from driver.kubeletplugin.slicemodel import Device, DeviceTaint
from driver.kubeletplugin.telemetry import Telemetry

log = logging.getLogger(__name__)

Series = Iterable[tuple[float, Mapping[str, str]]]


class NodeHealth:
    def __init__(self, monitor: HealthMonitor, board: HealthBoard, *, driver_name: str, pool_name: str,
                 taint_effect: TaintEffect, report_path: Path | None = None,
                 clock: Callable[[], float] = time.time):
        """``report_path``: where to keep the health file that ``inspect`` reads."""
        self.monitor = monitor
        self.board = board
        self.driver_name = driver_name
        self.pool_name = pool_name
        self.taint_effect = taint_effect
        self.taints_enabled = False
        self._clock = clock
        self._report_path = report_path
        self._reported: tuple[list[DeviceHealthStatus], dict[str, dict[str, str]]] | None = None
        # What the health source cannot read on each GPU (set once the source is open); in the report for inspect.
        self.not_watched: Callable[[], dict[str, dict[str, str]]] = dict
        self._lock = threading.Lock()
        # Device name -> (healthy, since): the time a device's state was determined stays put
        # while it does not change, so unchanged lists are not re-sent as changes.
        self._since: dict[str, tuple[Health, float]] = {}

    def unhealthy(self, view: NodeView) -> dict[str, DeviceCondition]:
        return unhealthy_devices(view.targets, self.monitor.health())

    def problems(self, view: NodeView) -> dict[str, str]:
        """Device name -> why it is unhealthy, for refusing new claims on it."""
        return {name: f"{c.reason}: {c.message}" for name, c in self.unhealthy(view).items()}

    def taints(self, view: NodeView) -> dict[str, list[DeviceTaint]]:
        """Device name -> the taints it carries while unhealthy, for matching a claim's tolerations. Also
        while taints are not published: a claim that tolerates them asked for unhealthy devices."""
        return {name: [health_taint(c, self.driver_name, self.taint_effect)]
                for name, c in self.unhealthy(view).items()}

    def devices(self, view: NodeView) -> list[Device]:
        """The view's devices as they are published: tainted when unhealthy and taints are on."""
        if not self.taints_enabled:
            return list(view.devices)
        return with_taints(view.devices, self.unhealthy(view), self.driver_name, self.taint_effect)

    def update_board(self, view: NodeView) -> None:
        unhealthy = self.unhealthy(view)
        failed = self.monitor.failed
        now = self._clock()
        entries = []
        with self._lock:
            since: dict[str, tuple[Health, float]] = {}
            for device in view.devices:
                condition = unhealthy.get(device.name)
                if failed is not None:
                    health, message = Health.UNKNOWN, failed
                elif condition is None:
                    health, message = Health.HEALTHY, ""
                else:
                    health, message = Health.UNHEALTHY, f"{condition.reason}: {condition.message}"
                previous = self._since.get(device.name)
                stamp = previous[1] if previous is not None and previous[0] == health else now
                since[device.name] = (health, stamp)
                entries.append(DeviceHealthStatus(self.pool_name, device.name, health, message, stamp))
            self._since = since
            reported = (entries, self.not_watched())
            if self._report_path is not None and reported != self._reported:
                try:
                    write_report(self._report_path, entries, reported[1])
                    self._reported = reported
                except OSError as exc:
                    log.warning("cannot write the device health file for inspect",
                                extra={"path": str(self._report_path), "reason": str(exc)})
        self.board.update(entries)

    def register_metrics(self, telemetry: Telemetry, view: Callable[[], NodeView], sampler: DeviceSampler) -> None:
        """Per-device health, XIDs by code, and each GPU's temperature, power and memory in use."""

        def health() -> Series:
            current = view()
            unhealthy = self.unhealthy(current)
            for name, target in sorted(current.targets.items()):
                reason = unhealthy[name].reason if name in unhealthy else ""
                yield (0.0 if name in unhealthy else 1.0), {"device": name, "gpu_uuid": target.gpu.uuid,
                                                            "reason": reason}

        def xids() -> Series:
            for xid, count in sorted(self.monitor.xid_counts().items()):
                yield float(count), {"xid": str(xid)}

        def readings(pick: Callable[[float | None, float | None, int | None], float | None]) -> Callable[[], Series]:
            def read() -> Series:
                for uuid, sample in sorted(sampler.sample().items()):
                    value = pick(sample.temperature_celsius, sample.power_watts, sample.memory_used_bytes)
                    if value is not None:
                        yield float(value), {"gpu_uuid": uuid}
            return read

        telemetry.observe_labelled("device_healthy", "1 if the published device is healthy, 0 if not (reason label)",
                                   health)
        telemetry.observe_labelled("gpu_xid_errors", "XID errors reported by the GPUs since the plugin started, "
                                   "by XID code", xids, counter=True)
        telemetry.observe_labelled("gpu_temperature_celsius", "GPU temperature",
                                   readings(lambda t, _p, _m: t))
        telemetry.observe_labelled("gpu_power_watts", "GPU power draw", readings(lambda _t, p, _m: p))
        telemetry.observe_labelled("gpu_memory_used_bytes", "GPU memory in use",
                                   readings(lambda _t, _p, m: None if m is None else float(m)))
