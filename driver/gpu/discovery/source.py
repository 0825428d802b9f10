"""Choose the discovery backend: NVML on real nodes, the simulated node when asked for explicitly."""

from __future__ import annotations

import logging
from pathlib import Path

from driver.gpu.discovery.inventory import Discovery

log = logging.getLogger(__name__)


def open_discovery(simulate: str | None, node_name: str, driver_root: Path = Path("/")) -> Discovery:
    """``driver_root`` is where the NVIDIA driver is mounted; NVML's library is loaded from there."""
    if simulate:
        from driver.simulation.discovery import SimulatedDiscovery

        log.warning("SIMULATION: publishing simulated GPUs, not this node's hardware", extra={"layout": simulate})
        return SimulatedDiscovery(simulate, node_name)
    from driver.gpu.discovery.nvml import NvmlDiscovery

    return NvmlDiscovery(driver_root=driver_root)
