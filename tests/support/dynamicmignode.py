"""A simulated node for DeviceState tests of dynamic MIG: the ``dynamic-mig`` layout (gpu-0 an H100 80GB in MIG
mode with no instances, published dynamically; gpu-1 a whole H100; gpu-2 an L4), its host tree, and the
simulated MIG partitioner over a state file, keeping the tree's MIG capability files as the NVIDIA driver does.
MPS daemons, time slices and compute modes are the recording fakes of ``statenode.py``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from driver.gpu.discovery.inventory import GpuInfo, NodeInventory
from driver.gpu.published.devices import make_view
from driver.gpu.published.dynamicmigplan import DynamicMigEntry, dynamic_mig_form
from driver.gpu.published.sharelayout import SharingLayout
from driver.gpu.record.checkpoint import Checkpoint, CheckpointStore
from driver.gpu.recovery import recover
from driver.gpu.state import DeviceState
from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.hostroot import build_host_root
from driver.simulation.migengine import SimulatedMigHost, SimulatedMigPartitioner
from tests.support.statenode import POOL, state_parts

LAYOUT = "dynamic-mig"
BOOT_ID_FILE = "proc/sys/kernel/random/boot_id"


class DynamicMigNode:
    """One simulated node; ``state()`` is a driver process on it (a fresh one after a "restart")."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.mig_state = root / "mig.json"
        self.host = root / "host"
        inventory = SimulatedDiscovery(LAYOUT, POOL).discover()
        build_host_root(self.host, inventory)
        self.set_boot_id("boot-1")
        self.paths, self.toolkit, self.mps, self.timeslicer, self.modes = state_parts(root, self.host)
        # The test's own handle on the simulated NVML (the driver's opens the same file): inject, reboot, look.
        self.engine = self.partitioner()

    def partitioner(self) -> SimulatedMigPartitioner:
        return SimulatedMigPartitioner.for_layout(LAYOUT, POOL, self.mig_state, host=SimulatedMigHost(self.host))

    def inventory(self) -> NodeInventory:
        """What discovery sees now (the partitioner's instances included)."""
        return SimulatedDiscovery(LAYOUT, POOL, mig_state=self.mig_state).discover()

    def gpu(self, minor: int = 0) -> GpuInfo:
        found = self.inventory().gpu_by_minor(minor)
        assert found is not None
        return found

    def layout(self) -> SharingLayout:
        """gpu-0 dynamic, every profile and its whole device (as its layout, without instances, makes it)."""
        gpu = SimulatedDiscovery(LAYOUT, POOL).discover().gpus[0]
        shares, _ = dynamic_mig_form(DynamicMigEntry(), gpu, supported=True, own=())
        assert shares is not None
        return {gpu.uuid: shares}

    def state(self, with_partitioner: bool = True) -> DeviceState:
        state = DeviceState(driver_name="gpu.tessera.dev", pool_name=POOL, paths=self.paths, toolkit=self.toolkit,
                            mps=self.mps, timeslicer=self.timeslicer, compute_modes=self.modes,
                            view=make_view(self.inventory(), {}), lock_timeout=5,
                            mig=self.partitioner if with_partitioner else None)
        recover(state)
        state.apply_layout(make_view(self.inventory(), {}), self.layout())
        return state

    def set_boot_id(self, boot_id: str) -> None:
        path = self.host / BOOT_ID_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(boot_id + "\n")

    @property
    def store(self) -> CheckpointStore:
        return CheckpointStore(self.paths.state_dir / "checkpoint.json")

    def checkpoint(self) -> Checkpoint:
        cp = self.store.peek()
        assert cp is not None
        return cp

    def instances(self, minor: int = 0) -> list[tuple[int, int, int | None]]:
        """(placement start, size, CI id or None for a bare GPU instance) of every GPU instance, by start."""
        uuid = self.gpu(minor).uuid
        found: list[tuple[int, int, int | None]] = [(m.placement_start, m.placement_size, m.ci_id)
                                                    for m in self.engine.instances(uuid)]
        found += [(g.placement_start, g.placement_size, None) for g in self.engine.bare_gpu_instances(uuid)]
        return sorted(found)

    def spec_path(self, uid: str) -> Path:
        return self.paths.cdi_root / f"k8s.gpu.tessera.dev-claim_{uid}.json"

    def spec_json(self, uid: str) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.spec_path(uid).read_text())
        return data

    def cdi_files(self) -> list[str]:
        return sorted(p.name for p in self.paths.cdi_root.iterdir()) if self.paths.cdi_root.exists() else []

    def proc_caps(self, minor: int = 0) -> list[str]:
        """The MIG capability files /proc has for the GPU (relative to its mig/ directory)."""
        base = self.host / "proc/driver/nvidia/capabilities" / f"gpu{minor}" / "mig"
        return sorted(str(p.relative_to(base)) for p in base.rglob("access")) if base.exists() else []
