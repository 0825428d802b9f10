"""One allocator per GPU: which of this node's GPUs Tessera may publish, beside other GPU allocators.

Another allocator on the node (NVIDIA's device plugin, NVIDIA's DRA driver) hands out the same GPUs
from its own books: a GPU both publish can go to two pods that never learn of each other. They are
found where the kubelet finds them:

* a device plugin's socket in the kubelet's device plugin directory: NVIDIA's is
  ``nvidia-<resource>.sock`` (``nvidia-gpu.sock``, ``nvidia-mig-1g.10gb.sock``; NVIDIA/k8s-device-plugin
  ``internal/plugin/server.go``: ``"nvidia-" + name`` under ``DevicePluginPath``, ``+ ".sock"``);
* a DRA driver's registration socket in the kubelet's plugin registry, ``<driver>-reg.sock`` or
  ``<driver>-<pod UID>-reg.sock`` (the kubelet plugin helper's names), for a driver that hands out
  NVIDIA GPUs (``gpu.nvidia.com``). NVIDIA's ``compute-domain.nvidia.com`` hands out IMEX channels, not
  GPUs, and does not count.

Only sockets count, as for the kubelet. A socket left by a plugin that is gone counts too: whether
its plugin comes back cannot be told from here, and the kubelet removes such sockets when it starts.
Without ``--owned-gpus`` Tessera publishes every GPU, or none while another allocator is found; with
it, exactly the GPUs listed, whatever else runs (the operator keeps the other allocator off them).
"""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from driver.gpu.discovery.inventory import GpuInfo, NodeInventory
from driver.gpu.published.targets import NodeView
from driver.kubeletplugin.claimmodel import ResourceClaim

log = logging.getLogger(__name__)

# DRA drivers that hand out NVIDIA GPUs, by driver name.
GPU_DRA_DRIVERS = ("gpu.nvidia.com",)
_DEVICE_PLUGIN_PREFIX = "nvidia"
_SOCKET_SUFFIX = ".sock"
_REGISTRATION_SUFFIX = "-reg.sock"


@dataclass(frozen=True)
class OtherAllocator:
    what: str  # e.g. "NVIDIA device plugin (nvidia.com/gpu)"
    path: Path

    def describe(self) -> str:
        return f"{self.what} at {self.path}"


def parse_owned_gpus(text: str) -> frozenset[str] | None:
    """``--owned-gpus``: GPU minors and UUIDs, comma-separated; None when empty. Raises ValueError naming the entry."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    for item in items:
        if not (item.isdigit() or (item.startswith("GPU-") and len(item) > len("GPU-"))):
            raise ValueError(f"{item!r} is neither a GPU minor (the N of /dev/nvidiaN) nor a GPU UUID (GPU-...)")
    return frozenset(items) or None


def find_other_allocators(device_plugins_dir: Path, registrar_dir: Path,
                          own_driver: str) -> tuple[OtherAllocator, ...]:
    """Other GPU allocators' sockets in the kubelet's directories; a directory that cannot be read is one too
    (nothing could then be ruled out), a missing one is not (no kubelet plugin ever ran there)."""
    found: list[OtherAllocator] = []
    for name, path in _sockets(device_plugins_dir, found):
        if name.startswith(_DEVICE_PLUGIN_PREFIX):
            resource = name.removeprefix(f"{_DEVICE_PLUGIN_PREFIX}-").removesuffix(_SOCKET_SUFFIX)
            found.append(OtherAllocator(f"NVIDIA device plugin (nvidia.com/{resource})", path))
    drivers = [d for d in GPU_DRA_DRIVERS if d != own_driver]
    for name, path in _sockets(registrar_dir, found):
        driver = next((d for d in drivers if name == f"{d}{_REGISTRATION_SUFFIX}"
                       or (name.startswith(f"{d}-") and name.endswith(_REGISTRATION_SUFFIX))), None)
        if driver is not None:
            found.append(OtherAllocator(f"DRA driver {driver}", path))
    return tuple(found)


def _sockets(directory: Path, found: list[OtherAllocator]) -> list[tuple[str, Path]]:
    try:
        names = sorted(os.listdir(directory))
    except FileNotFoundError:
        return []
    except OSError as exc:
        found.append(OtherAllocator(f"unknown (cannot list the directory: {exc.strerror or exc})", directory))
        return []
    sockets = []
    for name in names:
        path = directory / name
        try:
            is_socket = stat.S_ISSOCK(os.lstat(path).st_mode)
        except OSError:  # gone between the listing and the look
            continue
        if is_socket and not name.startswith(".") and name.endswith(_SOCKET_SUFFIX):
            sockets.append((name, path))
    return sockets


@dataclass(frozen=True)
class GpuOwnership:
    """Which GPUs this driver publishes: ``owned`` (minors and UUIDs) when the operator listed them, else
    every GPU unless ``others`` were found."""

    owned: frozenset[str] | None = None
    others: tuple[OtherAllocator, ...] = ()

    def publishes(self, gpu: GpuInfo) -> bool:
        if self.owned is not None:
            return str(gpu.minor) in self.owned or gpu.uuid in self.owned
        return not self.others

    def refusal(self) -> str | None:
        """The one line saying what was found and how to proceed, while no GPU is published because of it."""
        if self.owned is not None or not self.others:
            return None
        found = "; ".join(o.describe() for o in self.others)
        return (f"another GPU allocator is on this node: {found}. Publishing no GPUs, so that no GPU is handed out "
                "twice. Move the node off it (GPU Operator: label the node nvidia.com/gpu.deploy.device-plugin=false "
                "and drain it first; docs/migration.md), or list the GPUs Tessera owns in ownedGpus (--owned-gpus "
                "minors or UUIDs) and keep the other allocator off them")

    def summary(self, inventory: NodeInventory) -> str:
        """What is published and why, for the log and ``check-node``."""
        if self.owned is None:
            return self.refusal() or "no other GPU allocator on this node: every GPU is published"
        kept = [str(g.minor) for g in inventory.gpus if self.publishes(g)]
        missing = sorted(self.owned - {str(g.minor) for g in inventory.gpus} - {g.uuid for g in inventory.gpus})
        others = f" beside {'; '.join(o.describe() for o in self.others)}" if self.others else ""
        return (f"ownedGpus lists the GPUs Tessera owns{others}: publishing GPU minor(s) {', '.join(kept) or 'none'}"
                + (f"; not on this node: {', '.join(missing)}" if missing else ""))


def owned_view(view: NodeView, ownership: GpuOwnership) -> NodeView:
    """``view`` with only the devices (and the counter sets they consume) of GPUs ``ownership`` publishes."""
    devices = tuple(d for d in view.devices if ownership.publishes(view.targets[d.name].gpu))
    if len(devices) == len(view.devices):
        return view
    consumed = {c.counter_set for d in devices for c in d.consumes_counters}
    return replace(view, devices=devices, counter_sets=tuple(s for s in view.counter_sets if s.name in consumed))


class OwnershipWatch:
    """The node's :class:`GpuOwnership`, looked at again at every rescan (an allocator may come or go) and
    logged when it changes: an error line while it keeps every GPU back."""

    def __init__(self, device_plugins_dir: Path, registrar_dir: Path, own_driver: str, owned_gpus: str,
                 on_refusal: Callable[[str], None] | None = None) -> None:
        """``on_refusal``: told the refusal line each time it changes (e.g. to post it as a Node event)."""
        self._where = (device_plugins_dir, registrar_dir, own_driver)
        self._owned = parse_owned_gpus(owned_gpus)
        self._on_refusal = on_refusal
        self.ownership = GpuOwnership(self._owned)
        self._logged: str | None = None

    def admit(self, claim: ResourceClaim, driver_name: str, view: NodeView, prepared: bool) -> str | None:
        """Why ``claim`` must not be prepared: it names devices of GPUs no longer published (allocated from a
        slice published before another allocator appeared). A claim already ``prepared`` keeps what it has."""
        if prepared:
            return None
        withheld = [r.device for r in claim.results_for(driver_name)
                    if r.device in view.targets and not self.ownership.publishes(view.targets[r.device].gpu)]
        if not withheld:
            return None
        why = self.ownership.refusal() or "they are not among the GPUs ownedGpus lists"
        return f"devices {', '.join(withheld)} are no longer published on this node, so they may be another " \
               f"allocator's: {why}"

    def refresh(self, inventory: NodeInventory) -> GpuOwnership:
        self.ownership = GpuOwnership(self._owned, find_other_allocators(*self._where))
        line = self.ownership.summary(inventory)
        if line != self._logged:
            self._logged = line
            refusal = self.ownership.refusal()
            (log.error if refusal else log.info)(line)
            if refusal is not None and self._on_refusal is not None:
                self._on_refusal(refusal)
        return self.ownership
