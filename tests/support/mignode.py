"""Dynamic MIG around a running simulated node (``tests/support/node.py``): the test's handle on the simulated
NVML the driver process uses (the same state file, ``driver/simulation/migstate.py``), read and changed as a
test on a real node would use ``nvidia-smi mig``, and the node's boot ID, which a reboot changes."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from driver.simulation.migengine import SimulatedMigHost, SimulatedMigPartitioner
from driver.simulation.migstate import DEFAULT_STATE
from tests.support.node import DRIVER, NODE, SimulatedNode

BOOT_ID_FILE = "proc/sys/kernel/random/boot_id"  # under the host root, where the driver reads it first


def state_file(sim_node: SimulatedNode) -> Path:
    """Where the driver's simulated partitioner keeps its instances (``<driver root>/var/lib/...``)."""
    return sim_node.sim_host.driver_root / DEFAULT_STATE


def engine(sim_node: SimulatedNode) -> SimulatedMigPartitioner:
    """The simulated NVML over the driver's state file, keeping the host tree as the driver's does."""
    return SimulatedMigPartitioner.for_layout(sim_node.layout, NODE, state_file(sim_node),
                                              host=SimulatedMigHost(sim_node.host))


def instances(sim_node: SimulatedNode, minor: int = 0) -> list[dict[str, Any]]:
    """The GPU instances of GPU ``minor`` as the state file holds them (empty until the engine first changed it)."""
    path = state_file(sim_node)
    if not path.exists():
        return []
    gpu = sim_node.inventory.gpu_by_minor(minor)
    assert gpu is not None
    entries: list[dict[str, Any]] = json.loads(path.read_text())["gpus"].get(gpu.uuid, {}).get("gis", [])
    return entries


def placements(sim_node: SimulatedNode, minor: int = 0) -> list[tuple[int, int, int | None]]:
    """(placement start, size, CI id or None for a bare GPU instance) of each GPU instance, by start."""
    return sorted((g["placement_start"], g["placement_size"], g.get("ci_id")) for g in instances(sim_node, minor))


def set_boot_id(sim_node: SimulatedNode, boot_id: str) -> None:
    path = sim_node.host / BOOT_ID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(boot_id + "\n")


def proc_caps(sim_node: SimulatedNode, minor: int = 0) -> list[str]:
    """The MIG capability access files under the host tree's /proc for GPU ``minor``."""
    base = sim_node.host / "proc/driver/nvidia/capabilities" / f"gpu{minor}" / "mig"
    return sorted(str(p.relative_to(base)) for p in base.rglob("access")) if base.exists() else []


@contextlib.contextmanager
def dynamic_mig_node(plans: dict[str, Any]) -> Iterator[SimulatedNode]:
    """The simulated ``dynamic-mig`` node with ``plans`` and a boot ID (not started), closed afterwards."""
    sim_node = SimulatedNode("dynamic-mig", plans=plans)
    set_boot_id(sim_node, "boot-1")
    try:
        yield sim_node
    finally:
        sim_node.close()


def mig_mps_config(**mps: Any) -> dict[str, Any]:
    """A claim's MigDeviceConfig asking for MPS, with ``mps`` as its mpsConfig if any."""
    return {"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS", **({"mpsConfig": mps} if mps else {})}}}}
