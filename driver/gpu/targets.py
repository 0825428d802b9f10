"""The node's current view: its published devices, which GPU, MIG instance or share each name
stands for, and the rule that keeps a busy GPU in its published form.

Prepare resolves every allocation result through :attr:`NodeView.targets`, so a device is only
ever prepared in the form this driver publishes. ``devices.make_view`` builds a view; pure
functions, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from driver.gpu.discovery.inventory import GpuInfo, MigInstance, NodeInventory
from driver.gpu.sharelayout import GpuShares, SharingLayout
from driver.kubeletplugin.slicemodel import Device


@dataclass(frozen=True)
class DeviceTarget:
    name: str
    kind: str  # the device's type attribute: gpu | mig | mps | timeslice | consumable
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
    """What this node publishes for ``inventory`` under ``layout``: ``devices`` in publishing order,
    and ``targets``, the same devices by name."""

    inventory: NodeInventory
    layout: SharingLayout
    targets: dict[str, DeviceTarget]
    devices: tuple[Device, ...]


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
