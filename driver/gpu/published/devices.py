"""Inventory + sharing layout → the node's published devices and its device index, in one walk.

Pure logic, no I/O. :func:`make_view` is the only way to get either, so what prepare resolves a
device name to is always the device this node publishes under that name. Names come from
``devicenames.py``; every attribute and capacity of a published device comes from here (one
function per device kind).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from driver.gpu.claimconfig.choices import DeviceKind
from driver.gpu.discovery.inventory import GpuInfo, MigInstance, NodeInventory, multi_user_capable
from driver.gpu.discovery.migplacement import (
    MEMORY,
    MigPlacement,
    OwnInstances,
    counter_values,
    covers,
    foreign_mig_instances,
    full_profile,
    placement_consumption,
    placements,
)
from driver.gpu.published.devicenames import (
    ShareStrategy,
    consumable_device_name,
    counter_set_name,
    dynamic_mig_device_name,
    gpu_device_name,
    mig_device_name,
    mig_share_device_name,
    share_device_name,
)
from driver.gpu.published.sharelayout import ConsumablePolicy, DynamicMigPolicy, GpuForm, SharingLayout
from driver.gpu.published.targets import DeviceTarget, NodeView
from driver.kubeletplugin.slicelimits import MAX_ATTRIBUTES_AND_CAPACITIES, MAX_STRING_ATTRIBUTE_BYTES
from driver.kubeletplugin.slicemodel import (
    CapacityRequestPolicy,
    CapacityRequestRange,
    CounterSet,
    Device,
    DeviceAttribute,
    DeviceCapacity,
    DeviceCounterConsumption,
    bool_attr,
    counters,
    int_attr,
    string_attr,
    version_attr,
)
from driver.units import GIB, KIB, MIB, TIB

PCI_BUS_ID_ATTRIBUTE = "resource.kubernetes.io/pciBusID"
PCIE_ROOT_ATTRIBUTE = "resource.kubernetes.io/pcieRoot"

# One published device and the GPU, MIG instance or share its name stands for.
Entry = tuple[Device, DeviceTarget]


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


_BINARY_SUFFIXES = (("Ti", TIB), ("Gi", GIB), ("Mi", MIB), ("Ki", KIB))


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


def _whole_gpu(inventory: NodeInventory, gpu: GpuInfo) -> Entry:
    attributes = {"type": string_attr(DeviceKind.GPU), "uuid": _string(gpu.uuid), **_parent_attributes(inventory, gpu)}
    if gpu.addressing_mode is not None:
        attributes["addressingMode"] = _string(gpu.addressing_mode)
    capacity = _counts({"multiprocessors": gpu.multiprocessors})
    if gpu.memory_bytes is not None:
        capacity["memory"] = DeviceCapacity(value=quantity_from_bytes(gpu.memory_bytes))
    name = gpu_device_name(gpu.minor)
    device = Device(name=name, attributes=attributes, capacity=capacity)
    return _checked(device), DeviceTarget(name, DeviceKind.GPU, gpu)


def _mig_attributes(inventory: NodeInventory, gpu: GpuInfo, profile: str) -> dict[str, DeviceAttribute]:
    return {"type": string_attr(DeviceKind.MIG), "parentUUID": _string(gpu.uuid), "profile": _string(profile),
            **_parent_attributes(inventory, gpu)}


def _mig_capacity(amounts: dict[str, int | None], memory_bytes: int | None, slices: range) -> dict[str, DeviceCapacity]:
    capacity = _counts(amounts)
    if memory_bytes is not None:
        capacity["memory"] = DeviceCapacity(value=quantity_from_bytes(memory_bytes))
    for memory_slice in slices:
        capacity[f"memorySlice{memory_slice}"] = DeviceCapacity(value="1")
    return capacity


def _mig_device(inventory: NodeInventory, gpu: GpuInfo, mig: MigInstance) -> Entry:
    attributes = {**_mig_attributes(inventory, gpu, mig.profile), "uuid": _string(mig.uuid)}
    capacity = _mig_capacity(
        {"multiprocessors": mig.multiprocessors, "copyEngines": mig.copy_engines, "decoders": mig.decoders,
         "encoders": mig.encoders, "jpegEngines": mig.jpeg_engines, "ofaEngines": mig.ofa_engines},
        mig.memory_bytes, range(mig.placement_start, mig.placement_start + mig.placement_size))
    name = mig_device_name(gpu.minor, mig.profile, mig.placement_start)
    device = Device(name=name, attributes=attributes, capacity=capacity)
    return _checked(device), DeviceTarget(name, DeviceKind.MIG, gpu, mig=mig)


def _counter_quantities(amounts: dict[str, int]) -> dict[str, str]:
    return {k: quantity_from_bytes(v) if k == MEMORY else str(v) for k, v in amounts.items()}


def _dynamic_mig(inventory: NodeInventory, gpu: GpuInfo, shares: GpuForm, policy: DynamicMigPolicy,
                 own: OwnInstances | None) -> tuple[list[Entry], CounterSet | None]:
    """Every placement of the allowed profiles (and the whole GPU) as devices consuming the GPU's
    counter set; the same attributes as a static MIG device of the profile, less the MIG UUID (no
    instance exists yet), plus ``placement``. Nothing while the counters cannot be derived (NVML
    stopped listing the profiles of a GPU kept dynamic for its claims): no device then is safer
    than devices the scheduler cannot count. With ``own`` known, nothing that covers an instance
    Tessera did not create: a GPU kept dynamic for its prepared claims can get one, which no counter
    accounts for, so the scheduler would hand out a placement over it (or the whole GPU) that no
    prepare can create."""
    offered = counter_values(gpu)
    if not offered:
        return [], None
    foreign = foreign_mig_instances(gpu, own) if own is not None else []
    set_name = counter_set_name(gpu.minor)
    entries: list[Entry] = []
    if policy.also_whole_gpu and not foreign:
        whole, target = _whole_gpu(inventory, gpu)
        consumes = DeviceCounterConsumption(counter_set=set_name, counters=counters(_counter_quantities(offered)))
        full = full_profile(gpu)
        entries.append((whole.model_copy(update={"consumes_counters": (consumes,)}),
                        DeviceTarget(target.name, DeviceKind.GPU, gpu, form=shares,
                                     placement=MigPlacement(profile=full, start=0) if full is not None else None)))
    for placement in placements(gpu, policy.profiles):
        if any(covers(placement, instance) for instance in foreign):
            continue
        profile = placement.profile
        attributes = {**_mig_attributes(inventory, gpu, profile.name), "placement": int_attr(placement.start)}
        capacity = _mig_capacity(
            {"multiprocessors": profile.multiprocessors, "copyEngines": profile.copy_engines,
             "decoders": profile.decoders, "encoders": profile.encoders, "jpegEngines": profile.jpeg_engines,
             "ofaEngines": profile.ofa_engines}, profile.memory_bytes, placement.memory_slices)
        consumes = DeviceCounterConsumption(
            counter_set=set_name, counters=counters(_counter_quantities(placement_consumption(placement, offered))))
        name = dynamic_mig_device_name(gpu.minor, profile.name, placement.start)
        device = Device(name=name, attributes=attributes, capacity=capacity, consumes_counters=(consumes,))
        entries.append((_checked(device), DeviceTarget(name, DeviceKind.MIG, gpu, form=shares, placement=placement)))
    return entries, CounterSet(name=set_name, counters=counters(_counter_quantities(offered)))


def _shares(inventory: NodeInventory, gpu: GpuInfo, shares: GpuForm, mps_multi_user: bool,
            instance: MigInstance | None = None) -> list[Entry]:
    """The shares of ``gpu``, or of its MIG ``instance`` (which then say its profile and MIG UUID)."""
    common = {
        "type": string_attr(shares.device_type),
        "parentUUID": _string(gpu.uuid),
        **_parent_attributes(inventory, gpu),
        "sharingStrategy": string_attr(shares.strategy),
        "shareCount": int_attr(shares.count),
        "memoryLimitEnforcement": string_attr(shares.memory_enforcement(inventory.driver_version).value),
        "computeLimitEnforcement": string_attr(shares.compute_enforcement(inventory.driver_version).value),
    }
    if instance is not None:
        common["profile"] = _string(instance.profile)
        common["migUUID"] = _string(instance.uuid)
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
    entries: list[Entry] = []
    strategy: ShareStrategy = "MPS" if shares.strategy == "MPS" else "TimeSlicing"  # Consumable: _consumable
    for k in range(shares.count):
        name = (share_device_name(gpu.minor, strategy, k) if instance is None
                else mig_share_device_name(gpu.minor, instance.profile, instance.placement_start, strategy, k))
        device = Device(name=name, attributes={**common, "shareIndex": int_attr(k)}, capacity=capacity)
        entries.append((_checked(device), DeviceTarget(name, shares.device_type, gpu, mig=instance, form=shares,
                                                       share_index=k)))
    return entries


def _consumable(inventory: NodeInventory, gpu: GpuInfo, shares: GpuForm, policy: ConsumablePolicy) -> Entry:
    """One device many claims share, each consuming memory and SMs within the request policies."""
    attributes = {
        "type": string_attr(DeviceKind.CONSUMABLE),
        "parentUUID": _string(gpu.uuid),
        **_parent_attributes(inventory, gpu),
        "sharingStrategy": string_attr(shares.strategy),
        # Each claim gets its own MPS daemon whose defaults are its consumed amounts (docs/sharing.md).
        "memoryLimitEnforcement": string_attr(shares.memory_enforcement(inventory.driver_version).value),
        "computeLimitEnforcement": string_attr(shares.compute_enforcement(inventory.driver_version).value),
    }
    capacity = {
        "memory": DeviceCapacity(value=quantity_from_bytes(policy.memory_bytes), request_policy=CapacityRequestPolicy(
            default=quantity_from_bytes(policy.memory_default_bytes),
            valid_range=CapacityRequestRange(min=quantity_from_bytes(policy.memory_min_bytes),
                                             max=quantity_from_bytes(policy.memory_max_bytes),
                                             step=quantity_from_bytes(policy.memory_step_bytes)))),
        "multiprocessors": DeviceCapacity(value=str(policy.multiprocessors), request_policy=CapacityRequestPolicy(
            default=str(policy.multiprocessors_default),
            valid_range=CapacityRequestRange(min=str(policy.multiprocessors_min), max=str(policy.multiprocessors_max),
                                             step=str(policy.multiprocessors_step)))),
    }
    name = consumable_device_name(gpu.minor)
    device = Device(name=name, attributes=attributes, capacity=capacity, allow_multiple_allocations=True)
    return _checked(device), DeviceTarget(name, DeviceKind.CONSUMABLE, gpu, form=shares)


def _mig_devices(inventory: NodeInventory, gpu: GpuInfo, layout: Mapping[str, GpuForm], mps_multi_user: bool,
                 own: OwnInstances) -> list[Entry]:
    """Each instance as its MIG device, or (a layout entry under its MIG UUID) as the shares of it."""
    instances: dict[str, MigInstance] = {}
    # Several compute instances in one GPU instance would share a name; the lowest CI id wins.
    for mig in sorted(gpu.mig_instances, key=lambda m: (m.placement_start, m.ci_id)):
        if (gpu.uuid, mig.gi_id) in own:
            continue  # created for a claim: its device is the dynamic placement, not a static one
        instances.setdefault(mig_device_name(gpu.minor, mig.profile, mig.placement_start), mig)
    entries: list[Entry] = []
    for mig in instances.values():
        shares = layout.get(mig.uuid)
        if shares is not None and shares.mig_profile is not None:
            entries.extend(_shares(inventory, gpu, shares, mps_multi_user, instance=mig))
        else:
            entries.append(_mig_device(inventory, gpu, mig))
    return entries


def _gpu_entries(inventory: NodeInventory, gpu: GpuInfo, layout: Mapping[str, GpuForm], mps_multi_user: bool,
                 own: OwnInstances) -> list[Entry]:
    shares = layout.get(gpu.uuid)
    if shares is not None:
        if gpu.mig_enabled:
            raise ValueError(
                f"GPU {gpu.uuid} (minor {gpu.minor}) has MIG enabled and cannot also be shared with "
                f"{shares.strategy}; remove it from the sharing plan or disable MIG"
            )
        if shares.consumable is not None:
            return [_consumable(inventory, gpu, shares, shares.consumable)]
        return _shares(inventory, gpu, shares, mps_multi_user)
    if gpu.mig_enabled:
        return _mig_devices(inventory, gpu, layout, mps_multi_user, own)
    return [_whole_gpu(inventory, gpu)]


def make_view(inventory: NodeInventory, layout: Mapping[str, GpuForm], mps_multi_user: bool = False,
              own_instances: OwnInstances | None = None) -> NodeView:
    """The node as published under ``layout``: every device, and what each device name stands for.

    Devices are ordered by GPU minor then placement start / share index (a dynamic MIG GPU: its
    whole device, then its placements profile by profile). A GPU in ``layout`` is published only as
    its shares or (``DynamicMig``) its placements with its counter set; a MIG-enabled GPU only as its
    MIG instances (none at all if it has none: the caller decides how to report that), less
    ``own_instances`` (those Tessera created for claims), each instance in ``layout`` (by MIG UUID) as
    its shares instead of its MIG device; any other GPU whole. A dynamic GPU leaves
    out what covers an instance not in ``own_instances``; None (not known yet: recovery's first view)
    takes every instance of a dynamic GPU for its claims'. Layout entries for
    GPUs not in the inventory are ignored. Attributes whose source is unknown (None) are left out.
    ``mps_multi_user``: the node's MPS daemons for plan shares run in multi-user mode (on GPUs
    that support it). ValueError for a layout that shares a MIG-enabled GPU, or that makes a GPU
    without MIG mode dynamic.
    """
    devices: list[Device] = []
    counter_sets: list[CounterSet] = []
    targets: dict[str, DeviceTarget] = {}
    for gpu in sorted(inventory.gpus, key=lambda g: g.minor):
        shares = layout.get(gpu.uuid)
        if shares is not None and shares.dynamic_mig is not None:
            if not gpu.mig_enabled:
                raise ValueError(f"GPU {gpu.uuid} (minor {gpu.minor}) is not in MIG mode and cannot be dynamic MIG")
            entries, counter_set = _dynamic_mig(inventory, gpu, shares, shares.dynamic_mig, own_instances)
            counter_sets.extend([counter_set] if counter_set is not None else [])
        else:
            entries = _gpu_entries(inventory, gpu, layout, mps_multi_user, own_instances or ())
        for device, target in entries:
            devices.append(device)
            targets[target.name] = target
    resolved: SharingLayout = dict(layout)
    return NodeView(inventory, resolved, targets, tuple(devices), tuple(counter_sets))
