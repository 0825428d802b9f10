"""The kubelet's device health stream, ``DRAResourceHealth.NodeWatchResources``, in v1 and v1alpha1.

The driver keeps a :class:`HealthBoard` up to date with the health of every device it publishes.
Each kubelet stream gets the complete list at once, again on every change, and again every
``resend_s`` seconds (the kubelet marks a device ``Unknown`` when it is not re-reported within its
``health_check_timeout_seconds``, and treats every message as the complete list: kubelet contract
reference, section 4). The stream stays open until the kubelet cancels it or the plugin stops.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import grpc

from driver.kubeletplugin.api import (
    drahealth_v1_pb2,
    drahealth_v1_pb2_grpc,
    drahealth_v1alpha1_pb2,
    drahealth_v1alpha1_pb2_grpc,
)

# The strings a plugin advertises in GetInfo for the services added by add_health_services.
HEALTH_SERVICE_VERSIONS: tuple[str, ...] = ("v1.DRAResourceHealth", "v1alpha1.DRAResourceHealth")
# The kubelet cuts longer messages to 1021 characters plus "...".
MAX_MESSAGE_CHARS = 1024
DEFAULT_TIMEOUT_S = 30
DEFAULT_RESEND_S = 10.0


class Health(StrEnum):
    """Member names are those of the wire enum ``HealthStatus`` (the same in v1 and v1alpha1)."""

    UNKNOWN = "Unknown"
    HEALTHY = "Healthy"
    UNHEALTHY = "Unhealthy"


@dataclass(frozen=True)
class DeviceHealthStatus:
    pool: str
    device: str
    health: Health
    message: str = ""
    # Unix seconds when the driver determined this state.
    updated_at: float = 0.0


class HealthBoard:
    """The current health of every device, shared by all streams; thread-safe."""

    def __init__(self, timeout_s: int = DEFAULT_TIMEOUT_S, resend_s: float = DEFAULT_RESEND_S):
        if timeout_s <= 0 or not 0 < resend_s < timeout_s:
            raise ValueError(f"resend_s ({resend_s}) must be above 0 and below timeout_s ({timeout_s}): the "
                             "kubelet marks devices Unknown when they are not re-reported within the timeout")
        self.timeout_s = timeout_s
        self.resend_s = resend_s
        self._changed = threading.Condition()
        self._devices: tuple[DeviceHealthStatus, ...] = ()
        self._version = 0
        self._closed = False
        self._streams = 0

    def update(self, devices: Sequence[DeviceHealthStatus]) -> None:
        """Replace the list; streams send it when it differs from the last one (the first list always)."""
        with self._changed:
            if tuple(devices) == self._devices and self._version > 0:
                return
            self._devices = tuple(devices)
            self._version += 1
            self._changed.notify_all()

    def current(self) -> tuple[DeviceHealthStatus, ...]:
        with self._changed:
            return self._devices

    @property
    def open_streams(self) -> int:
        with self._changed:
            return self._streams

    def close(self) -> None:
        """End every stream (the plugin is stopping)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def reopen(self) -> None:
        """Accept streams again (the plugin is starting)."""
        with self._changed:
            self._closed = False

    def stream(self, is_active: Any = lambda: True) -> Iterator[tuple[DeviceHealthStatus, ...]]:
        """The list now, then on every change and every ``resend_s``, while ``is_active()`` and not closed.

        A stream opened before the first :meth:`update` (the driver is still initialising) waits for it:
        the kubelet takes every message as the complete list, so an empty one would be a false answer."""
        with self._changed:
            self._streams += 1
        try:
            sent_version = 0  # version 0 is "no list yet": nothing to send before the first update
            last_sent = 0.0
            while True:
                with self._changed:
                    while not self._closed and self._version == sent_version and (
                            sent_version == 0 or time.monotonic() - last_sent < self.resend_s):
                        # Short waits so a cancelled stream notices; changes notify at once.
                        due = 1.0 if sent_version == 0 else self.resend_s - (time.monotonic() - last_sent)
                        self._changed.wait(min(1.0, max(0.0, due)))
                        if not is_active():
                            return
                    if self._closed or not is_active():
                        return
                    devices, sent_version = self._devices, self._version
                last_sent = time.monotonic()
                yield devices
        finally:
            with self._changed:
                self._streams -= 1


def _message(status: DeviceHealthStatus) -> str:
    text = status.message
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS - 3] + "..."


class _Servicer:
    """NodeWatchResources for one API version: v1 and v1alpha1 have the same messages in their own modules."""

    def __init__(self, board: HealthBoard, pb: Any):
        self._board = board
        self._pb = pb

    def NodeWatchResources(self, request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        pb = self._pb
        for devices in self._board.stream(context.is_active):
            yield pb.NodeWatchResourcesResponse(devices=[pb.DeviceHealth(
                device=pb.DeviceIdentifier(pool_name=d.pool, device_name=d.device),
                health=pb.HealthStatus.Value(d.health.name), last_updated_time=int(d.updated_at),
                health_check_timeout_seconds=self._board.timeout_s, message=_message(d)) for d in devices])


def add_health_services(server: grpc.Server, board: HealthBoard) -> None:
    """Serve both health APIs on ``server``; advertise :data:`HEALTH_SERVICE_VERSIONS` in GetInfo."""
    drahealth_v1_pb2_grpc.add_DRAResourceHealthServicer_to_server(_Servicer(board, drahealth_v1_pb2), server)
    drahealth_v1alpha1_pb2_grpc.add_DRAResourceHealthServicer_to_server(
        _Servicer(board, drahealth_v1alpha1_pb2), server)
