"""Inventory → ResourceSlice devices, and the device naming scheme users depend on.

Pure logic, no I/O. Names:

* whole GPU: ``gpu-<minor>``;
* MIG device: ``gpu-<minor>-mig-<profile fragment>-<placement start>`` (``gpu-0-mig-1g10gb-3``);
* shares: ``gpu-<minor>-mps-<k>`` / ``gpu-<minor>-ts-<k>``, k = 0 .. count-1.

The minor (``/dev/nvidia<minor>``) is used rather than the NVML index because the index changes
when a GPU drops off the bus.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict

from driver.gpu.discovery.inventory import GpuInfo, MigInstance, NodeInventory
from driver.gpu.discovery.migprofiles import device_name_fragment
from driver.gpu.mps.model import multi_user_capable
from driver.gpu.sharing import GpuShares, SharingLayout
from driver.kubeletplugin.slicelimits import (
    MAX_ATTRIBUTES_AND_CAPACITIES,
    MAX_DEVICE_NAME_LENGTH,
    MAX_STRING_ATTRIBUTE_BYTES,
)
from driver.kubeletplugin.slicemodel import (
    Device,
    DeviceAttribute,
    DeviceCapacity,
    bool_attr,
    int_attr,
    string_attr,
    version_attr,
)

DeviceKind = Literal["gpu", "mig", "mps", "timeslice"]
ShareStrategy = Literal["MPS", "TimeSlicing"]

PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
PCIE_ROOT_ATTRIBUTE = "resource.kubernetes.io/pcieRoot"


_SHARE_INFIX: dict[ShareStrategy, str] = {"MPS": "mps", "TimeSlicing": "ts"}
_KIND_BY_SHARE_INFIX: dict[str, DeviceKind] = {"mps": "mps", "ts": "timeslice"}


# --- names -------------------------------------------------------------------------------------


def _checked_name(name: str) -> str:
    if len(name) > MAX_DEVICE_NAME_LENGTH:
        raise ValueError(f"device name {name!r} is longer than {MAX_DEVICE_NAME_LENGTH} characters (a DNS label)")
    return name


def gpu_device_name(minor: int) -> str:
    if minor < 0:
        raise ValueError(f"GPU minor must be >= 0, got {minor}")
    return f"gpu-{minor}"


def mig_device_name(minor: int, profile: str, placement_start: int) -> str:
    if placement_start < 0:
        raise ValueError(f"MIG placement start must be >= 0, got {placement_start}")
    return _checked_name(f"{gpu_device_name(minor)}-mig-{device_name_fragment(profile)}-{placement_start}")


def share_device_name(minor: int, strategy: ShareStrategy, k: int) -> str:
    if strategy not in _SHARE_INFIX:
        raise ValueError(f"share strategy must be one of {sorted(_SHARE_INFIX)}, got {strategy!r}")
    if k < 0:
        raise ValueError(f"share index must be >= 0, got {k}")
    return f"{gpu_device_name(minor)}-{_SHARE_INFIX[strategy]}-{k}"


class ParsedDeviceName(BaseModel):
    """What a device name says. ``mig_profile`` is the name fragment (``1g10gb``), not the profile."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: DeviceKind
    minor: int
    mig_profile: str | None = None
    placement_start: int | None = None
    share_index: int | None = None


_NUMBER = r"(0|[1-9][0-9]*)"
_GPU_NAME = re.compile(rf"^gpu-{_NUMBER}$")
_MIG_NAME = re.compile(rf"^gpu-{_NUMBER}-mig-([a-z0-9]+(?:-[a-z0-9]+)*)-{_NUMBER}$")
_SHARE_NAME = re.compile(rf"^gpu-{_NUMBER}-(mps|ts)-{_NUMBER}$")


def parse_device_name(name: str) -> ParsedDeviceName:
    """Parse a name this driver publishes; ValueError for anything else."""
    if match := _GPU_NAME.match(name):
        return ParsedDeviceName(kind="gpu", minor=int(match[1]))
    if match := _SHARE_NAME.match(name):
        return ParsedDeviceName(kind=_KIND_BY_SHARE_INFIX[match[2]], minor=int(match[1]), share_index=int(match[3]))
    if match := _MIG_NAME.match(name):
        return ParsedDeviceName(kind="mig", minor=int(match[1]), mig_profile=match[2], placement_start=int(match[3]))
    raise ValueError(
        f"device name {name!r} is not one of this driver's: expected gpu-<minor>, "
        "gpu-<minor>-mig-<profile>-<start>, gpu-<minor>-mps-<k> or gpu-<minor>-ts-<k>"
    )


def device_kind(name: str) -> DeviceKind:
    """The ``type`` attribute of a device, from its name alone (the prepare path has only the name)."""
    return parse_device_name(name).kind


# --- value normalisation -----------------------------------------------------------------------

_NVIDIA_VERSION = re.compile(r"^[0-9]+(\.[0-9]+){0,2}$")


def semver_from_nvidia(v: str) -> str | None:
    """NVIDIA version string → strict semver: ``580.95.05`` → ``580.95.5``, ``9.0`` → ``9.0.0``.

    Leading zeros are dropped (semver forbids them) and missing parts padded with 0; anything
    that is not one to three dot-separated numbers gives None.
    """
    text = v.strip()
    if not _NVIDIA_VERSION.match(text):
        return None
    parts = [str(int(p)) for p in text.split(".")]
    parts += ["0"] * (3 - len(parts))
    return ".".join(parts)


_BINARY_SUFFIXES = (("Ti", 1 << 40), ("Gi", 1 << 30), ("Mi", 1 << 20), ("Ki", 1 << 10))


def quantity_from_bytes(n: int) -> str:
    """A Kubernetes quantity that is exactly ``n`` bytes, in the largest binary unit that divides it."""
    if n < 0:
        raise ValueError(f"a byte count must be >= 0, got {n}")
    if n == 0:
        return "0"
    for suffix, unit in _BINARY_SUFFIXES:
        if n % unit == 0:
            return f"{n // unit}{suffix}"
    return str(n)


def _string(value: str) -> DeviceAttribute:
    # The apiserver rejects the whole slice for one string over 64 bytes; cut on a character boundary.
    encoded = value.encode()
    if len(encoded) > MAX_STRING_ATTRIBUTE_BYTES:
        value = encoded[:MAX_STRING_ATTRIBUTE_BYTES].decode(errors="ignore")
    return string_attr(value)


# --- devices -----------------------------------------------------------------------------------


def _parent_attributes(inventory: NodeInventory, gpu: GpuInfo) -> dict[str, DeviceAttribute]:
    """What every device carved from ``gpu`` (and the whole GPU) says about the physical GPU."""
    attributes: dict[str, DeviceAttribute] = {"productName": _string(gpu.product_name)}
    if gpu.brand is not None:
        attributes["brand"] = _string(gpu.brand)
    if gpu.architecture is not None:
        attributes["architecture"] = _string(gpu.architecture)
    versions = {
        "cudaComputeCapability": gpu.cuda_compute_capability,
        "driverVersion": inventory.driver_version,
        "cudaDriverVersion": inventory.cuda_driver_version,
    }
    for key, raw in versions.items():
        semver = semver_from_nvidia(raw) if raw is not None else None
        if semver is not None:
            attributes[key] = version_attr(semver)
    if gpu.pci_bus_id is not None:
        attributes[PCI_BUS_ID_ATTRIBUTE] = _string(gpu.pci_bus_id)
    if gpu.pcie_root is not None:
        attributes[PCIE_ROOT_ATTRIBUTE] = _string(gpu.pcie_root)
    return attributes


def _counts(values: dict[str, int | None]) -> dict[str, DeviceCapacity]:
    return {key: DeviceCapacity(value=str(value)) for key, value in values.items() if value is not None}


def _checked(device: Device) -> Device:
    total = len(device.attributes) + len(device.capacity)
    if total > MAX_ATTRIBUTES_AND_CAPACITIES:
        raise ValueError(
            f"device {device.name} has {total} attributes and capacities; "
            f"resource.k8s.io allows at most {MAX_ATTRIBUTES_AND_CAPACITIES}"
        )
    return device


def _whole_gpu_device(inventory: NodeInventory, gpu: GpuInfo) -> Device:
    attributes = {"type": string_attr("gpu"), "uuid": _string(gpu.uuid), **_parent_attributes(inventory, gpu)}
    if gpu.addressing_mode is not None:
        attributes["addressingMode"] = _string(gpu.addressing_mode)
    capacity = _counts({"multiprocessors": gpu.multiprocessors})
    if gpu.memory_bytes is not None:
        capacity["memory"] = DeviceCapacity(value=quantity_from_bytes(gpu.memory_bytes))
    return _checked(Device(name=gpu_device_name(gpu.minor), attributes=attributes, capacity=capacity))


def _mig_device(inventory: NodeInventory, gpu: GpuInfo, mig: MigInstance) -> Device:
    attributes = {
        "type": string_attr("mig"),
        "uuid": _string(mig.uuid),
        "parentUUID": _string(gpu.uuid),
        "profile": _string(mig.profile),
        **_parent_attributes(inventory, gpu),
    }
    capacity = _counts(
        {
            "multiprocessors": mig.multiprocessors,
            "copyEngines": mig.copy_engines,
            "decoders": mig.decoders,
            "encoders": mig.encoders,
            "jpegEngines": mig.jpeg_engines,
            "ofaEngines": mig.ofa_engines,
        }
    )
    if mig.memory_bytes is not None:
        capacity["memory"] = DeviceCapacity(value=quantity_from_bytes(mig.memory_bytes))
    for memory_slice in range(mig.placement_start, mig.placement_start + mig.placement_size):
        capacity[f"memorySlice{memory_slice}"] = DeviceCapacity(value="1")
    name = mig_device_name(gpu.minor, mig.profile, mig.placement_start)
    return _checked(Device(name=name, attributes=attributes, capacity=capacity))


def _share_devices(inventory: NodeInventory, gpu: GpuInfo, shares: GpuShares, mps_multi_user: bool) -> list[Device]:
    common = {
        "type": string_attr(shares.device_type),
        "parentUUID": _string(gpu.uuid),
        **_parent_attributes(inventory, gpu),
        "sharingStrategy": string_attr(shares.strategy),
        "shareCount": int_attr(shares.count),
        "memoryLimitEnforcement": string_attr(shares.memory_enforcement.value),
        "computeLimitEnforcement": string_attr(shares.compute_enforcement.value),
    }
    if shares.strategy == "MPS" and shares.active_thread_percentage is not None:
        common["activeThreadPercentage"] = int_attr(shares.active_thread_percentage)
    if shares.strategy == "MPS":
        # Whether pods of different UIDs can run on this GPU's MPS server at once. Without NVIDIA's
        # multi-user mode the daemon runs one UID's server at a time and queues the others
        # (nvidia-cuda-mps-control(1)); users who run as several UIDs select on this.
        common["mpsMultiUser"] = bool_attr(mps_multi_user and multi_user_capable(gpu.cuda_compute_capability))
    if shares.strategy == "TimeSlicing":
        common["timeSliceInterval"] = string_attr(shares.interval or "Default")
    capacity = {"memory": DeviceCapacity(value=quantity_from_bytes(shares.memory_bytes_per_share))}
    return [
        _checked(
            Device(
                name=share_device_name(gpu.minor, shares.strategy, k),
                attributes={**common, "shareIndex": int_attr(k)},
                capacity=capacity,
            )
        )
        for k in range(shares.count)
    ]


def _mig_devices(inventory: NodeInventory, gpu: GpuInfo) -> list[Device]:
    devices: list[Device] = []
    seen: set[str] = set()
    # Several compute instances in one GPU instance would share a name; the lowest CI id wins.
    for mig in sorted(gpu.mig_instances, key=lambda m: (m.placement_start, m.ci_id)):
        device = _mig_device(inventory, gpu, mig)
        if device.name not in seen:
            seen.add(device.name)
            devices.append(device)
    return devices


def build_devices(
    inventory: NodeInventory, layout: SharingLayout | None = None, mps_multi_user: bool = False
) -> list[Device]:
    """Every device this node publishes, ordered by GPU minor then placement start / share index.

    A GPU in ``layout`` is published only as its shares; a MIG-enabled GPU only as its MIG
    instances (none at all if it has none: the caller decides how to report that); any other GPU
    whole. Attributes whose source is unknown (None) are left out. ``mps_multi_user``: the node's
    MPS daemons for plan shares run in multi-user mode (on GPUs that support it).
    """
    shares_by_uuid = layout or {}
    devices: list[Device] = []
    for gpu in sorted(inventory.gpus, key=lambda g: g.minor):
        shares = shares_by_uuid.get(gpu.uuid)
        if shares is not None:
            if gpu.mig_enabled:
                raise ValueError(
                    f"GPU {gpu.uuid} (minor {gpu.minor}) has MIG enabled and cannot also be shared with "
                    f"{shares.strategy}; remove it from the sharing plan or disable MIG"
                )
            devices.extend(_share_devices(inventory, gpu, shares, mps_multi_user))
        elif gpu.mig_enabled:
            devices.extend(_mig_devices(inventory, gpu))
        else:
            devices.append(_whole_gpu_device(inventory, gpu))
    return devices
