"""SIMULATION: the kubelet's side of the device health stream, and what a pod's status would show.

As the kubelet does (kubelet contract reference, section 4.3): it opens ``NodeWatchResources`` on
the plugin's endpoint, v1 when the plugin advertises it and else v1alpha1; every message is the
complete list for the driver; each listed device is stamped with the receive time, and a device
not re-reported within its ``health_check_timeout_seconds`` (30 s when 0) reads ``Unknown``; when
the stream ends all of the driver's health is forgotten. :func:`allocated_resources_status`
builds a container's ``allocatedResourcesStatus`` entry for a claim from that cache.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc

from driver.kubeletplugin.api import (
    drahealth_v1_pb2,
    drahealth_v1_pb2_grpc,
    drahealth_v1alpha1_pb2,
    drahealth_v1alpha1_pb2_grpc,
)

KUBELET_DEFAULT_HEALTH_TIMEOUT_S = 30
_HEALTH_NAMES = {0: "Unknown", 1: "Healthy", 2: "Unhealthy"}
# The health APIs a 1.37 kubelet knows, in its order of preference: their messages have the same fields.
_HEALTH_APIS = {"v1.DRAResourceHealth": (drahealth_v1_pb2, drahealth_v1_pb2_grpc),
                "v1alpha1.DRAResourceHealth": (drahealth_v1alpha1_pb2, drahealth_v1alpha1_pb2_grpc)}


@dataclass(frozen=True)
class ReportedHealth:
    health: str  # Healthy | Unhealthy | Unknown
    message: str
    timeout_s: int
    last_updated_time: int
    received_at: float


def health_api_version(supported_versions: tuple[str, ...]) -> str | None:
    """The health API a 1.37 kubelet would use for a plugin advertising ``supported_versions``."""
    return next((version for version in _HEALTH_APIS if version in supported_versions), None)


class HealthWatch:
    """One open ``NodeWatchResources`` stream and the kubelet's health cache for the driver."""

    def __init__(self, endpoint: str, api_version: str):
        if api_version not in _HEALTH_APIS:
            raise ValueError(f"unknown health API {api_version!r}")
        self.api_version = api_version
        self._channel = grpc.insecure_channel(f"unix://{endpoint}")
        self._lock = threading.Condition()
        self._cache: dict[tuple[str, str], ReportedHealth] = {}
        self.messages = 0
        self.ended: str | None = None
        pb2, pb2_grpc = _HEALTH_APIS[api_version]
        self._call: Any = pb2_grpc.DRAResourceHealthStub(self._channel).NodeWatchResources(
            pb2.NodeWatchResourcesRequest())
        self._thread = threading.Thread(target=self._read, name="kubelet-health-watch", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._call.cancel()
        self._thread.join(5)
        self._channel.close()

    def _read(self) -> None:
        try:
            for response in self._call:
                now = time.monotonic()
                with self._lock:
                    for d in response.devices:
                        timeout = d.health_check_timeout_seconds
                        self._cache[(d.device.pool_name, d.device.device_name)] = ReportedHealth(
                            health=_HEALTH_NAMES.get(int(d.health), "Unknown"), message=d.message,
                            timeout_s=timeout if timeout > 0 else KUBELET_DEFAULT_HEALTH_TIMEOUT_S,
                            last_updated_time=int(d.last_updated_time), received_at=now)
                    self.messages += 1
                    self._lock.notify_all()
            ended = "the plugin ended the stream"
        except grpc.RpcError as err:
            ended = f"stream failed: {err.code()}"
        with self._lock:
            # The kubelet clears the driver's health when the stream ends.
            self._cache.clear()
            self.ended = ended
            self._lock.notify_all()

    def device(self, pool: str, device: str) -> ReportedHealth | None:
        """What the kubelet knows about one device; health reads Unknown once stale."""
        with self._lock:
            found = self._cache.get((pool, device))
        if found is None:
            return None
        if time.monotonic() - found.received_at > found.timeout_s:
            return ReportedHealth("Unknown", found.message, found.timeout_s, found.last_updated_time,
                                  found.received_at)
        return found

    def wait_ended(self, timeout: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self.ended is not None, timeout)

    def wait_messages(self, count: int, timeout: float) -> bool:
        with self._lock:
            return self._lock.wait_for(lambda: self.messages >= count, timeout)


def allocated_resources_status(watch: HealthWatch, driver: str, pod_claim_name: str,
                               devices: list[tuple[str, str, tuple[str, ...]]]) -> dict[str, Any]:
    """``containerStatuses[].allocatedResourcesStatus[]`` for one claim: devices are (pool, device, CDI IDs).

    ``resourceID`` is the device's first CDI ID, or ``<driver>/<pool>/<device>`` without one.
    """
    resources = []
    for pool, device, cdi_ids in devices:
        reported = watch.device(pool, device)
        entry = {"resourceID": cdi_ids[0] if cdi_ids else f"{driver}/{pool}/{device}",
                 "health": reported.health if reported is not None else "Unknown"}
        if reported is not None and reported.message:
            entry["message"] = reported.message
        resources.append(entry)
    return {"name": f"claim:{pod_claim_name}", "resources": resources}
