"""Choose the discovery backend: NVML on real nodes, the simulated node when asked for explicitly."""

from __future__ import annotations

import logging

from driver.gpu.inventory import Discovery

log = logging.getLogger(__name__)


def open_discovery(simulate: str | None, node_name: str) -> Discovery:
    if simulate:
        from driver.simulation.discovery import SimulatedDiscovery

        log.warning("SIMULATION: publishing simulated GPUs, not this node's hardware", extra={"layout": simulate})
        return SimulatedDiscovery(simulate, node_name)
    from driver.gpu.nvml import NvmlDiscovery

    return NvmlDiscovery()
