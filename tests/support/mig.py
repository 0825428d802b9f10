"""Dynamic MIG test inventories built by hand: GPUs in MIG mode with the profile tables of the packaged
``mig-profiles.json`` (the reference's H100-80GB and A100-80GB rows), as discovery reports them."""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from driver.gpu.discovery.inventory import GpuInfo, MigInstance, MigProfileInfo, NodeInventory
from driver.units import MIB

H100_MEMORY = 81559 * MIB


def profiles(table: str = "H100-80GB", engines: dict[str, dict[str, int]] | None = None) -> tuple[MigProfileInfo, ...]:
    """The table's profiles; copy engines = compute slices (as the simulation has them), other engines
    from ``engines`` (profile name -> {field: amount}) or absent."""
    text = resources.files("driver.simulation").joinpath("mig-profiles.json").read_text()
    rows: list[dict[str, Any]] = json.loads(text)["gpus"][table]["profiles"]
    return tuple(
        MigProfileInfo(name=r["name"], gi_profile_id=r["nvml_profile_id"],
                       ci_profile_id=r["full_ci_profile_enum_value"],
                       compute_slices=r["compute_slices"], memory_slices=r["memory_slices"],
                       memory_bytes=r["memory_mib"] * MIB, multiprocessors=r["sm_count"],
                       copy_engines=r["compute_slices"], placement_starts=tuple(r["placement_starts"]),
                       **(engines or {}).get(r["name"], {}))
        for r in rows if r["nvml_profile_id"] is not None and r["memory_mib"] is not None and r["sm_count"] is not None)


def h100(minor: int = 0, *, instances: tuple[MigInstance, ...] = (), mig_enabled: bool = True,
         table: tuple[MigProfileInfo, ...] | None = None, **fields: Any) -> GpuInfo:
    """An H100 80GB in MIG mode with no instances (unless given): what dynamic MIG publishes."""
    offered = profiles() if table is None else table
    values: dict[str, Any] = {
        "minor": minor, "index": minor, "uuid": f"GPU-h100-{minor}", "product_name": "NVIDIA H100 80GB HBM3",
        "brand": "Nvidia", "architecture": "Hopper", "cuda_compute_capability": "9.0", "memory_bytes": H100_MEMORY,
        "multiprocessors": 132, "pci_bus_id": f"0000:{0x18 + minor:02x}:00.0",
        "pcie_root": f"pci0000:{0x17 + minor:02x}",
        "mig_capable": True, "mig_enabled": mig_enabled, "mig_instances": instances,
        "mig_memory_slices": 8 if mig_enabled else 0, "mig_profiles": offered if mig_enabled else ()}
    return GpuInfo(**{**values, **fields})


def l4(minor: int) -> GpuInfo:
    return GpuInfo(minor=minor, index=minor, uuid=f"GPU-l4-{minor}", product_name="NVIDIA L4",
                   memory_bytes=23034 * MIB, multiprocessors=58)


def instance(profile: str, start: int, gi_id: int, size: int = 1) -> MigInstance:
    return MigInstance(uuid=f"MIG-{profile}-{start}", profile=profile, gi_profile_id=19, placement_start=start,
                       placement_size=size, gi_id=gi_id, ci_id=0, memory_bytes=9984 * MIB, multiprocessors=16)


def inventory_of(*gpus: GpuInfo) -> NodeInventory:
    return NodeInventory(driver_version="580.95.05", cuda_driver_version="13.0", gpus=gpus)
