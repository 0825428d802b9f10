"""Where the node's sharing plan comes from: the plans file and this node's label (from the Node watch)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from driver import nodelayout
from driver.config import Settings
from driver.gpu.claimcdi import kernelmemory
from driver.gpu.discovery.inventory import NodeInventory
from driver.gpu.discovery.migplacement import OwnInstances, partitionable_supported
from driver.gpu.published.consumable import KernelMemoryLimits, consumable_supported
from driver.gpu.published.planuse import PLAN_USE_FILE, PlanUse, chosen_how, gpu_lines, plan_use, write_plan_use
from driver.gpu.published.sharelayout import SharingLayout
from driver.gpu.published.sharingplan import SharingPlan, load_plans, resolve_plan, select_plan
from driver.kubeletplugin.kubeclient import KubeApiError, KubeClient, server_minor_version

log = logging.getLogger(__name__)

# The API server's feature gates whose fields the sharing plan's devices need (1.34/1.35 alpha, on from 1.36).
PARTITIONABLE_GATE = "DRAPartitionableDevices"
CONSUMABLE_GATE = "DRAConsumableCapacity"


def _unknown_labels() -> Mapping[str, str]:
    raise KubeApiError(0, "NotSynced", "the Node's labels are not known: no Node watch was given")


@dataclass
class PlanSource:
    """Where the node's sharing plan comes from: the plans file and this node's label."""

    settings: Settings
    api: KubeClient
    minor_version: int | None = None  # the API server's, read once when a plan first needs it
    kernel: KernelMemoryLimits | None = None  # kernel memory limits, detected at start and every rescan
    use: PlanUse | None = None  # the plan in use and each GPU's entry, as last logged
    # Feature gates the API server showed to be off (it dropped our fields that need them), whatever its release
    # or the plans file says: what needs them is not published again.
    gates_off: frozenset[str] = frozenset()
    # The Node's labels as its watch knows them (driver/kubeletplugin/nodewatch.py); raises KubeApiError while
    # the Node cannot be read.
    node_labels: Callable[[], Mapping[str, str]] = _unknown_labels

    def desired_layout(self, inventory: NodeInventory, own: OwnInstances = ()) -> SharingLayout:
        """``own``: MIG instances Tessera created for claims, which keep their GPU dynamic MIG."""
        path = self.settings.sharing_plans
        if path is None:
            self._record(plan_use(SharingPlan(), None, None, "no --sharing-plans", inventory, {}))
            return {}
        plans = load_plans(path)
        labels = dict(self.node_labels())
        key = self.settings.sharing_plan_label
        name, plan = select_plan(plans, labels, key)
        if self.minor_version is None and any(e.consumable is not None or e.dynamicMig is not None for e in plan.gpus):
            self.minor_version = server_minor_version(self.api)
        supported = (consumable_supported(self.minor_version or 0, plans.consumableCapacityGate)
                     and CONSUMABLE_GATE not in self.gates_off)
        partitionable = (partitionable_supported(self.minor_version or 0, plans.partitionableDevicesGate)
                         and PARTITIONABLE_GATE not in self.gates_off)
        resolved = resolve_plan(plan, inventory, name, consumable_supported=supported,
                                kernel=self.detect_kernel_memory(inventory), partitionable_supported=partitionable,
                                own_instances=own)
        self._record(plan_use(plan, name, path, chosen_how(key, labels.get(key), name), inventory, resolved.layout,
                              resolved.notes))
        return resolved.layout

    def _record(self, use: PlanUse) -> None:
        """Log the plan in use when it (or what it makes of a GPU) changes: at start, and after an edit."""
        if use == self.use:
            return
        self.use = use
        log.info("sharing plan in use: %s", use.summary(), extra={"gpus": gpu_lines(use)})
        for line in use.note_lines():  # e.g. a dynamicMig entry on a GPU without MIG: published as before
            log.warning(line)
        if use.plan is not None and all(g.entry is None for g in use.gpus):
            # Plans are shared by nodes, so one entry matching nothing is normal; a whole plan is a mistake.
            log.warning("sharing plan %r matches no GPU of this node: every GPU is published whole (or as its MIG "
                        "devices); check its match selectors with `python -m driver check-plan`", use.plan,
                        extra={"entries": use.unmatched_entries})

    def save(self, state_dir: Path) -> None:
        """Leave the plan in use where ``inspect`` reads it."""
        if self.use is None:
            return
        try:
            write_plan_use(state_dir / PLAN_USE_FILE, self.use)
        except OSError as exc:  # only inspect's view is missing; serving claims does not depend on it
            log.warning("cannot write %s for inspect: %s", state_dir / PLAN_USE_FILE, exc)

    def detect_kernel_memory(self, inventory: NodeInventory) -> KernelMemoryLimits:
        """Re-read at every call (a driver upgrade or a new toolkit can add it); logged when it changes."""
        s = self.settings
        candidates = (s.nvidia_cdi_spec,) if s.nvidia_cdi_spec else nodelayout.toolkit_candidates(s)
        spec = next((p for p in candidates if p.is_file()), None)
        kernel = kernelmemory.detect(s.host_root, inventory.driver_version, spec)
        if kernel != self.kernel:
            log.info("kernel-enforced GPU memory limits for consumable shares: %s",
                     "available" if kernel.available else "not available", extra={"reason": kernel.reason})
        self.kernel = kernel
        return kernel
