"""From GPU/MIG health to the published devices: which devices are unhealthy, and their taints.

Health applies to every device that uses a GPU: the whole GPU, its MIG devices and its shares.
A MIG device is also unhealthy on its own when an event names its GPU instance; so is a dynamic MIG
device (and the whole device of a dynamic MIG GPU) once the instance created for it is discovered. Pure;
no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from driver.gpu.health.model import Health
from driver.gpu.published.targets import DeviceTarget
from driver.kubeletplugin.slicemodel import Device, DeviceTaint

TaintEffect = Literal["NoSchedule", "NoExecute"]
# Under the driver's domain: <driver name>/unhealthy, value = the reason (xid-79, gpu-lost, ...).
TAINT_NAME = "unhealthy"


@dataclass(frozen=True)
class DeviceCondition:
    reason: str
    message: str
    since: float


def unhealthy_devices(targets: Mapping[str, DeviceTarget], health: Health) -> dict[str, DeviceCondition]:
    """Published device name -> why it is unhealthy; healthy devices are absent."""
    result: dict[str, DeviceCondition] = {}
    for name, target in targets.items():
        found = health.get(target.gpu.uuid)
        instance = instance_uuid(target)
        if found is None and instance is not None:
            found = health.get(instance)
        if found is not None:
            result[name] = DeviceCondition(found.reason, found.message, found.since)
    return result


def instance_uuid(target: DeviceTarget) -> str | None:
    """The MIG UUID of the instance ``target`` stands for: a static MIG device's own, a dynamic MIG device's the
    instance of its profile at exactly its placement (created for the claim holding it: the placement's
    counters let no other instance be allocated there), None while none exists."""
    if target.mig is not None:
        return target.mig.uuid
    placement = target.placement
    if placement is None:
        return None
    return next((m.uuid for m in target.gpu.mig_instances if m.placement_start == placement.start
                 and m.gi_profile_id == placement.profile.gi_profile_id), None)


def taint_key(driver_name: str) -> str:
    return f"{driver_name}/{TAINT_NAME}"


def health_taint(condition: DeviceCondition, driver_name: str, effect: TaintEffect) -> DeviceTaint:
    """The taint an unhealthy device carries (the value is a label value: at most 63 characters)."""
    return DeviceTaint(key=taint_key(driver_name), value=condition.reason[:63], effect=effect)


def with_taints(devices: Sequence[Device], unhealthy: Mapping[str, DeviceCondition], driver_name: str,
                effect: TaintEffect) -> list[Device]:
    """``devices`` with one taint on each unhealthy one; ``timeAdded`` is left to the server (and kept)."""
    key = taint_key(driver_name)
    result = []
    for device in devices:
        condition = unhealthy.get(device.name)
        kept = [t for t in device.taints if t.key != key]
        if condition is not None:
            kept.append(health_taint(condition, driver_name, effect))
        result.append(device if kept == device.taints else device.model_copy(update={"taints": kept}))
    return result


TaintMode = Literal["auto", "always", "never"]


def taints_decision(mode: TaintMode, minor_version: int) -> tuple[bool, str]:
    """Whether to publish health taints to a Kubernetes 1.<minor_version> API server, and why (for the log).

    Device taints (KEP-5055, feature gate DRADeviceTaints) are GA in 1.37 and beta in 1.36; in 1.34
    and 1.35 they are alpha, off unless the cluster enables the gate, and a server with the gate off
    silently drops them. ``always`` is for clusters that enabled the gate on 1.34/1.35.
    """
    if mode == "never":
        return False, "device taints are turned off (--device-taints=never)"
    if mode == "always":
        return True, f"device taints are published (--device-taints=always, Kubernetes 1.{minor_version})"
    if minor_version >= 36:
        return True, f"device taints are published (Kubernetes 1.{minor_version} supports them)"
    return False, (f"device taints are NOT published: Kubernetes 1.{minor_version} has them only behind the alpha "
                   "feature gate DRADeviceTaints (use --device-taints=always if it is on); device health is "
                   "still reported to the kubelet and in metrics")
