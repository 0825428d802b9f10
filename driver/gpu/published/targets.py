"""The node's current view: its published devices (and the counter sets dynamic MIG devices consume),
which GPU, MIG instance, MIG placement or share each name stands for, and the rule that keeps a busy
GPU in its published form.

Prepare resolves every allocation result through :attr:`NodeView.targets`, so a device is only
ever prepared in the form this driver publishes. ``devices.make_view`` builds a view; pure
functions, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from driver.gpu.claimconfig.choices import DeviceKind
from driver.gpu.discovery.inventory import GpuInfo, MigInstance, NodeInventory
from driver.gpu.discovery.migplacement import MigPlacement
from driver.gpu.published.sharelayout import GpuForm, SharingLayout
from driver.kubeletplugin.slicemodel import CounterSet, Device


@dataclass(frozen=True)
class DeviceTarget:
    """What a published device name stands for.

    A dynamic MIG device (a GPU published under a ``DynamicMig`` layout entry, which is ``form``)
    has ``placement`` and no ``mig``: the GPU instance does not exist until prepare creates it there.
    The whole device of such a GPU (kind ``gpu``) has the full-size profile at 0 as its placement,
    since a GPU in MIG mode runs CUDA work only inside instances.
    """

    name: str
    kind: DeviceKind
    gpu: GpuInfo
    mig: MigInstance | None = None  # a MIG device, or (kind mps / timeslice) the instance a share splits
    form: GpuForm | None = None
    share_index: int | None = None
    placement: MigPlacement | None = None  # dynamic MIG: the profile and where its instance is to be created

    @property
    def creates_mig_instance(self) -> bool:
        """Whether prepare has to create a MIG instance for this device (at ``placement``)."""
        return self.placement is not None

    @property
    def cuda_uuid(self) -> str:
        """The UUID CUDA and MPS address this device by (the MIG UUID for a MIG instance).

        A dynamic MIG device has no MIG UUID before its instance exists: this is then its GPU's UUID,
        which only the code that created the instance may replace with the instance's.
        """
        return self.mig.uuid if self.mig is not None else self.gpu.uuid

    @property
    def memory_bytes(self) -> int | None:
        if self.mig is not None:
            return self.mig.memory_bytes
        if self.placement is not None:
            return self.placement.profile.memory_bytes
        return self.gpu.memory_bytes


@dataclass(frozen=True)
class NodeView:
    """What this node publishes for ``inventory`` under ``layout``: ``devices`` in publishing order,
    ``targets``, the same devices by name, and ``counter_sets``, those dynamic MIG devices consume."""

    inventory: NodeInventory
    layout: SharingLayout
    targets: dict[str, DeviceTarget]
    devices: tuple[Device, ...]
    counter_sets: tuple[CounterSet, ...] = ()


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


def form_fits(shares: GpuForm, gpu: GpuInfo, instance: bool = False) -> bool:
    """Whether ``gpu`` (``instance``: one of its MIG instances) can be published as ``shares``: dynamic MIG and
    shares of a MIG instance need MIG mode on; MPS, time-slice and consumable shares of a whole GPU need it off."""
    if instance:
        return gpu.mig_enabled and shares.mig_profile is not None
    return gpu.mig_enabled == (shares.dynamic_mig is not None)


def drop_unfit(layout: SharingLayout, desired: SharingLayout,
               inventory: NodeInventory) -> tuple[SharingLayout, set[str]]:
    """``layout`` less the forms its GPUs can no longer take, and the GPUs that lost one.

    A form kept for prepared claims can stop fitting when an operator switches the GPU's MIG mode (a GPU
    reset: what the claims had on it is gone anyway). Such a GPU takes its desired form if that fits, else
    none (published as the hardware is); keeping the impossible form would fail every rescan of the node.
    """
    gpus = {g.uuid: (g, False) for g in inventory.gpus}
    gpus.update({m.uuid: (g, True) for g in inventory.gpus for m in g.mig_instances})
    fitting: SharingLayout = {}
    dropped: set[str] = set()
    for uuid, shares in layout.items():
        gpu, instance = gpus.get(uuid, (None, False))
        if gpu is None or form_fits(shares, gpu, instance):
            fitting[uuid] = shares
            continue
        dropped.add(uuid)
        wanted = desired.get(uuid)
        if wanted is not None and form_fits(wanted, gpu, instance):
            fitting[uuid] = wanted
    return fitting, dropped
