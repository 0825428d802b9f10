"""Support for the kubelet-plugin layer's tests: devices to publish, the pool they belong to, socket directories."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from driver.kubeletplugin.activity import DraActivity
from driver.kubeletplugin.slicemodel import Device, DeviceCapacity, DeviceTaint, string_attr

DRIVER = "gpu.tessera.dev"
NODE = "node-1"
OWNER = {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": "node-uid", "controller": True}


def gpu(index: int, product: str = "NVIDIA H100 80GB HBM3", taints: list[DeviceTaint] | None = None) -> Device:
    return Device(name=f"gpu-{index}", attributes={"type": string_attr("gpu"), "productName": string_attr(product)},
                  capacity={"memory": DeviceCapacity(value="80Gi")}, taints=taints or [])


def gpus(count: int, product: str = "NVIDIA H100 80GB HBM3") -> list[Device]:
    return [gpu(i, product) for i in range(count)]


def eventually(condition: Callable[[], bool], timeout: float = 10.0) -> bool:
    """Whether ``condition`` holds within ``timeout`` seconds (polled)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@dataclass
class Dirs:
    """Where a plugin's sockets go: the kubelet's plugin-registration directory and the plugin's own."""

    registrar: Path
    plugin: Path


@dataclass(frozen=True)
class ServedElsewhere:
    """A plugin another process serves, as :func:`driver.kubeletplugin.liveness.check_plugin` sees it: no calls
    in flight here, so both sockets are called."""

    driver_name: str
    registration_socket: Path
    dra_socket: Path

    def dra_activity(self) -> DraActivity:
        return DraActivity(in_flight=0, seconds_since_progress=0.0)
