"""Choose the device health and process sources: NVML on real nodes, the simulation's files with ``--simulate``."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

from driver.config import Settings
from driver.gpu.discovery.inventory import NodeInventory
from driver.gpu.health.processes import ProcessSource
from driver.gpu.health.sampling import SampledHealthSource


def open_health_source(settings: Settings, inventory: Callable[[], NodeInventory],
                       environ: Mapping[str, str], current: Callable[[], NodeInventory]) -> SampledHealthSource:
    """NVML's library is already loaded from the driver root by discovery, which starts first. ``inventory``: the
    one in force; ``current``: a fresh discovery, which the simulation asks for an instance made since (the NVML
    source asks NVML itself)."""
    if settings.simulate:
        from driver.simulation.healthevents import EVENTS_ENV, SimulatedHealth

        path = environ.get(EVENTS_ENV)
        return SimulatedHealth(Path(path) if path else None, inventory, current)
    import pynvml

    from driver.gpu.health.nvmlsource import NvmlHealthSource

    return NvmlHealthSource(pynvml, inventory)


def open_process_source(settings: Settings, inventory: Callable[[], NodeInventory],
                        environ: Mapping[str, str]) -> ProcessSource:
    """Where each GPU process and its pod come from, for per-claim usage."""
    if settings.simulate:
        from driver.simulation.processes import PROCESSES_ENV, SimulatedProcesses

        path = environ.get(PROCESSES_ENV)
        return SimulatedProcesses(Path(path) if path else None)
    import pynvml

    from driver.gpu.health.processes import NvmlProcesses

    return NvmlProcesses(pynvml, inventory, settings.host_root)
