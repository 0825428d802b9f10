"""The node as the settings describe it: where its GPUs are discovered (NVML, or the simulated node
of ``--simulate``), how compute modes are read and set (NVML, or the simulated node's NVML double),
where it keeps the NVIDIA driver (device root, toolkit spec).

Shared by ``run`` (discovery, state paths, toolkit edits, readiness), ``inspect`` and the node
self-check, so all three see the node the same way. This is the one place that picks the
simulation: nothing under ``driver/gpu`` imports it.
"""

from __future__ import annotations

import logging
import os
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

from driver.config import Settings
from driver.gpu.claimcdi.toolkit import ToolkitEdits, load_toolkit_edits, toolkit_spec_candidates
from driver.gpu.discovery.inventory import Discovery, NodeInventory
from driver.gpu.host.hostfs import DeviceRoot, driver_root_host_path, find_device_root
from driver.gpu.runtime.computemode import NvmlComputeModes
from driver.gpu.runtime.mig import MigPartitioner

log = logging.getLogger(__name__)

# The node name a simulated node gets where none is given. It seeds the simulated GPUs' UUIDs, so the
# demo, check-node, inspect and check-plan all show one layout with the same UUIDs.
SIMULATED_NODE_NAME = "demo-node"


def open_discovery(settings: Settings, node_name: str) -> Discovery:
    """NVML, its library loaded from the driver root; the simulated node only when ``--simulate`` names one.

    ``node_name`` seeds the simulated GPUs' UUIDs (each node of a simulated cluster has its own).
    """
    if settings.simulate:
        from driver.simulation.discovery import SimulatedDiscovery
        from driver.simulation.migstate import state_path

        log.warning("SIMULATION: publishing simulated GPUs, not this node's hardware",
                    extra={"layout": settings.simulate})
        # The simulated partitioner's instances (open_mig_partitioner), as NVML shows what was created.
        return SimulatedDiscovery(settings.simulate, node_name, mig_state=state_path(settings.driver_root, os.environ))
    from driver.gpu.discovery.nvml import NvmlDiscovery

    return NvmlDiscovery(driver_root=settings.driver_root)


def discover_once(settings: Settings) -> NodeInventory:
    """What the node has now, its discovery session closed again (``inspect`` and ``check-node`` look once)."""
    discovery = open_discovery(settings, settings.node_name or SIMULATED_NODE_NAME)
    try:
        return discovery.discover()
    finally:
        discovery.close()


def open_compute_modes(settings: Settings, driver_root: Path | None = None) -> NvmlComputeModes:
    """Compute modes through NVML in this process, its library from the driver root (``driver_root``
    overrides the settings' for check-node's own simulated tree); on the simulated node, the NVML double
    that keeps the stand-ins' state file."""
    root = settings.driver_root if driver_root is None else driver_root
    if settings.simulate:
        from driver.simulation.nvmlcompute import SimulatedNvml

        return NvmlComputeModes(SimulatedNvml.for_driver_root(root, os.environ))
    import pynvml

    from driver.gpu.discovery.nvml import load_nvml_from_driver_root

    return NvmlComputeModes(pynvml, load_library=partial(load_nvml_from_driver_root, root))


def open_mig_partitioner(settings: Settings, driver_root: Path | None = None) -> MigPartitioner:
    """MIG devices created and destroyed through NVML in this process, its library from the driver root; on the
    simulated node, the SIMULATION engine over its state file (TESSERA_SIM_MIG_STATE, else under the driver
    root), the file the simulated discovery reads when given it (``SimulatedDiscovery(..., mig_state=...)``)."""
    root = settings.driver_root if driver_root is None else driver_root
    if settings.simulate:
        from driver.simulation.migengine import SimulatedMigHost, SimulatedMigPartitioner
        from driver.simulation.migstate import state_path

        # It keeps the simulated host tree's MIG capability files, as the NVIDIA driver keeps /proc.
        host = SimulatedMigHost(settings.host_root)
        return SimulatedMigPartitioner.for_layout(settings.simulate, settings.node_name or SIMULATED_NODE_NAME,
                                                  state_path(root, os.environ), host=host)
    import pynvml

    from driver.gpu.discovery.nvml import load_nvml_from_driver_root
    from driver.gpu.runtime.nvmlmig import NvmlMigPartitioner

    return NvmlMigPartitioner(pynvml, load_library=partial(load_nvml_from_driver_root, root))


def toolkit_candidates(settings: Settings) -> tuple[Path, ...]:
    return toolkit_spec_candidates(settings.cdi_root)


def load_toolkit(settings: Settings) -> ToolkitEdits:
    return load_toolkit_edits(settings.nvidia_cdi_spec, toolkit_candidates(settings),
                              settings.driver_libraries_required)


def driver_root_on_host(settings: Settings) -> PurePosixPath:
    explicit = PurePosixPath(settings.driver_root_on_host) if settings.driver_root_on_host else None
    return driver_root_host_path(settings.host_root, settings.driver_root, explicit)


def own_dev_root(settings: Settings) -> Path:
    """The root whose dev/ this process opens devices through: its own / unless told; on a simulated node the
    simulated host tree (never the machine's real /dev, where MIG capability nodes would be made)."""
    if settings.own_dev_root is not None:
        return settings.own_dev_root
    return settings.host_root if settings.simulate else Path("/")


def device_root(settings: Settings) -> DeviceRoot:
    return find_device_root(settings.host_root, settings.driver_root, driver_root_on_host(settings))


def describe(settings: Settings) -> tuple[dict[str, Any], list[str]]:
    """(report section, problems) for ``inspect``: where device nodes and driver libraries come from."""
    toolkit = load_toolkit(settings)
    root = device_root(settings)
    section = {"driver_root": str(settings.driver_root), "driver_root_on_host": str(driver_root_on_host(settings)),
               "device_root": root.describe(), "device_root_has_nvidiactl": root.local("/dev/nvidiactl").exists(),
               "toolkit_spec": str(toolkit.source) if toolkit.source else None,
               "toolkit_specs_not_used": [str(p) for p in toolkit.also_found],
               "driver_libraries": toolkit.status, "driver_libraries_required": toolkit.required}
    problems = [] if toolkit.readiness_problem is None else [f"node not ready: {toolkit.readiness_problem}"]
    if not section["device_root_has_nvidiactl"]:
        problems.append(f"no /dev/nvidiactl in {root.describe()}: the NVIDIA driver is not loaded (or the GPU "
                        "Operator's driver container is not running); claims fail until it is")
    return section, problems
