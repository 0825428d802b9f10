"""check-node's health-watch lines: for each GPU, what the running driver's health source could not read there.

One poll of the driver's own NVML health source (``driver/gpu/health/nvmlsource.py``), or on the simulated
node the rule its simulated source applies: remapped rows on a GPU in MIG mode with instances (nvml.h:
NOT_SUPPORTED), the recovery action (field 230) on a driver or GPU without it. Never a failure: the
GPU is served, some faults are only seen through their XIDs there (docs/operations.md, "Device health").
"""

from __future__ import annotations

from driver.commands.checknode.result import CheckResult, ok
from driver.config import Settings
from driver.gpu.discovery.inventory import NodeInventory
from driver.gpu.health.conditions import REMAP_ON_MIG, ROW_REMAPPING, remap_unreadable_on

WATCHED = "XIDs, ECC errors, a lost GPU, the recovery action and row remapping are watched"


def not_watched(settings: Settings, inventory: NodeInventory) -> dict[str, dict[str, str]]:
    """GPU UUID -> what cannot be read on it -> why."""
    if settings.simulate:
        return {g.uuid: {ROW_REMAPPING: REMAP_ON_MIG} for g in inventory.gpus if remap_unreadable_on(g)}
    import pynvml

    from driver.gpu.discovery.nvml import load_nvml_from_driver_root
    from driver.gpu.health.nvmlsource import NvmlHealthSource

    load_nvml_from_driver_root(settings.driver_root)
    pynvml.nvmlInit()
    try:
        source = NvmlHealthSource(pynvml, lambda: inventory)
        source.poll_once(lambda _event: None)  # events are the running driver's business; only the gaps here
        return source.not_watched()
    finally:
        pynvml.nvmlShutdown()


def health_watch_checks(settings: Settings, inventory: NodeInventory | None) -> list[CheckResult]:
    if inventory is None:
        return []
    gaps = not_watched(settings, inventory)
    lines = []
    for gpu in inventory.gpus:
        missing = gaps.get(gpu.uuid, {})
        detail = "; ".join(f"{what} is not watched: {why}" for what, why in sorted(missing.items()))
        lines.append(ok(f"health watch GPU {gpu.minor}", detail or WATCHED))
    return lines
