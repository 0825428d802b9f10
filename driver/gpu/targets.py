"""The node's current view: which published device name stands for which GPU, MIG instance or share.

Prepare resolves every allocation result through :func:`index_devices`, so a device is only
ever prepared in the form this driver publishes. Pure functions; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from driver.gpu.devices import gpu_device_name, mig_device_name, share_device_name
from driver.gpu.discovery.inventory import GpuInfo, MigInstance, NodeInventory
from driver.gpu.sharing import GpuShares, SharingLayout


@dataclass(frozen=True)
class DeviceTarget:
    name: str
    kind: str  # gpu | mig | mps | timeslice
    gpu: GpuInfo
    mig: MigInstance | None = None
    shares: GpuShares | None = None
    share_index: int | None = None

    @property
    def cuda_uuid(self) -> str:
        """The UUID CUDA and MPS address this device by (the MIG UUID for a MIG instance)."""
        return self.mig.uuid if self.mig is not None else self.gpu.uuid

    @property
    def memory_bytes(self) -> int | None:
        return self.mig.memory_bytes if self.mig is not None else self.gpu.memory_bytes


@dataclass(frozen=True)
class NodeView:
    inventory: NodeInventory
    layout: SharingLayout
    targets: dict[str, DeviceTarget]


def index_devices(inventory: NodeInventory, layout: SharingLayout) -> dict[str, DeviceTarget]:
    """Every device name this node publishes for ``inventory`` under ``layout``."""
    targets: dict[str, DeviceTarget] = {}
    for gpu in inventory.gpus:
        shares = layout.get(gpu.uuid)
        if shares is not None:
            for k in range(shares.count):
                name = share_device_name(gpu.minor, shares.strategy, k)
                targets[name] = DeviceTarget(name, shares.device_type, gpu, shares=shares, share_index=k)
        elif gpu.mig_enabled:
            # Same rule as build_devices: of several compute instances in one GPU instance, the lowest CI id.
            for mig in sorted(gpu.mig_instances, key=lambda m: (m.placement_start, m.ci_id)):
                name = mig_device_name(gpu.minor, mig.profile, mig.placement_start)
                targets.setdefault(name, DeviceTarget(name, "mig", gpu, mig=mig))
        else:
            name = gpu_device_name(gpu.minor)
            targets[name] = DeviceTarget(name, "gpu", gpu)
    return targets


def make_view(inventory: NodeInventory, layout: SharingLayout) -> NodeView:
    return NodeView(inventory, dict(layout), index_devices(inventory, layout))


def merge_layout(
    current: SharingLayout, desired: SharingLayout, busy_gpus: set[str]
) -> tuple[SharingLayout, set[str]]:
    """The layout to apply now, and the GPUs whose change must wait.

    A GPU whose publishing form would change while claims are prepared on it keeps its current
    form: re-publishing it under a running workload would hand its capacity out twice.
    """
    effective: SharingLayout = {}
    deferred: set[str] = set()
    for uuid in set(current) | set(desired):
        old, new = current.get(uuid), desired.get(uuid)
        chosen = new
        if old != new and uuid in busy_gpus:
            chosen = old
            deferred.add(uuid)
        if chosen is not None:
            effective[uuid] = chosen
    return effective, deferred
