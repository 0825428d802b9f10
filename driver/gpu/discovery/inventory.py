"""What discovery reports about a node's GPUs, independent of how it was found.

Both discovery backends (pynvml on hardware, the simulated node) return a
:class:`NodeInventory`; everything downstream (devices, CDI, sharing) reads only this.
Optional fields are None when the GPU or driver does not support the query, so a missing
NVML feature becomes a missing attribute rather than a crash.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict

# MPS multi-user mode needs Volta or newer (dra-driver-nvidia-gpu PR #1153, ensureCapability "7.0").
MULTI_USER_MIN_COMPUTE_CAPABILITY = (7, 0)


class ComputeMode(StrEnum):
    """The modes the driver reads and sets, by the names nvidia-smi and the checkpoint use."""

    DEFAULT = "DEFAULT"
    EXCLUSIVE_PROCESS = "EXCLUSIVE_PROCESS"
    PROHIBITED = "PROHIBITED"


def multi_user_capable(cuda_compute_capability: str | None) -> bool:
    """Whether a GPU of this compute capability ("9.0") can run an MPS daemon in multi-user mode."""
    if cuda_compute_capability is None:
        return False
    major, _, minor = cuda_compute_capability.partition(".")
    try:
        return (int(major), int(minor or 0)) >= MULTI_USER_MIN_COMPUTE_CAPABILITY
    except ValueError:
        return False


class MigEngines(BaseModel):
    """The engines of a MIG profile, as NVML's GPU-instance profile info counts them (None: not reported)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    copy_engines: int | None = None
    decoders: int | None = None
    encoders: int | None = None
    jpeg_engines: int | None = None
    ofa_engines: int | None = None

    def engines(self) -> MigEngines:
        """Just the engine counts (of a MIG device or profile), to build another model with them."""
        return MigEngines(copy_engines=self.copy_engines, decoders=self.decoders, encoders=self.encoders,
                          jpeg_engines=self.jpeg_engines, ofa_engines=self.ofa_engines)


class MigInstance(MigEngines):
    """An existing MIG device (GPU instance + compute instance) on a MIG-enabled GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    uuid: str  # "MIG-..."
    profile: str  # canonical profile name, e.g. "1g.10gb", "1g.10gb+me"
    gi_profile_id: int  # NVML GpuInstanceProfileInfo.id
    placement_start: int
    placement_size: int  # memory slices occupied
    gi_id: int
    ci_id: int
    memory_bytes: int | None = None
    multiprocessors: int | None = None


class MigProfileInfo(MigEngines):
    """One GPU-instance profile a MIG-capable GPU can create, and where (for dynamic MIG).

    On hardware: NVML's GPU-instance profile info and its possible placements; in the simulation:
    the profile tables. The compute instance created inside is always the one spanning the whole GI.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str  # canonical profile name, e.g. "1g.10gb" (migprofiles.profile_name)
    gi_profile_id: int  # NVML GpuInstanceProfileInfo.id: what create/placement calls take (device specific)
    ci_profile_id: int  # NVML_COMPUTE_INSTANCE_PROFILE_* enum of the CI spanning the whole GI
    compute_slices: int
    memory_slices: int  # placement size
    memory_bytes: int
    multiprocessors: int
    placement_starts: tuple[int, ...] = ()  # NVML's possible placements' starts; each covers memory_slices


def mig_memory_slices(profiles: tuple[MigProfileInfo, ...]) -> int:
    """The memory slices a MIG GPU has: where its furthest placement ends (0 without profiles)."""
    return max((start + p.memory_slices for p in profiles for start in p.placement_starts), default=0)


class GpuInfo(BaseModel):
    """One physical GPU."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    minor: int  # /dev/nvidia<minor>; the stable identity used in device names
    index: int  # NVML enumeration index; not stable, never used as identity
    uuid: str  # "GPU-..."
    product_name: str
    brand: str | None = None  # NVIDIA's strings: "Tesla", "Nvidia", "NvidiaRTX", ...
    architecture: str | None = None  # "Ampere", "Hopper", ...
    cuda_compute_capability: str | None = None  # "9.0"
    memory_bytes: int | None = None
    multiprocessors: int | None = None
    multiprocessors_missing: str | None = None  # why multiprocessors is None, for logs, inspect and check-node
    pci_bus_id: str | None = None  # normalised "0000:3b:00.0"
    pcie_root: str | None = None  # "pci0000:3a"
    addressing_mode: str | None = None  # "None", "HMM", "ATS"
    mig_capable: bool = False
    mig_enabled: bool = False
    # nvmlDeviceGetMigMode's pending mode where it differs from the current one: set (nvidia-smi -mig) but not
    # in effect until a GPU reset (Ampere) or until no process holds the GPU (Hopper and later).
    mig_mode_pending: Literal["enable", "disable"] | None = None
    mig_instances: tuple[MigInstance, ...] = ()
    # For dynamic MIG: the memory slices a MIG GPU has, and the profiles it can create (empty when
    # MIG is off or not supported, or NVML could not list them).
    mig_memory_slices: int = 0
    mig_profiles: tuple[MigProfileInfo, ...] = ()


class NodeInventory(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    driver_version: str | None = None  # raw NVML string, e.g. "580.95.05"
    cuda_driver_version: str | None = None  # "13.0"
    gpus: tuple[GpuInfo, ...] = ()

    def gpu_by_minor(self, minor: int) -> GpuInfo | None:
        return next((g for g in self.gpus if g.minor == minor), None)


class Discovery(Protocol):
    """A source of GPU inventory.

    Implementations: ``driver.gpu.discovery.nvml.NvmlDiscovery`` and ``driver.simulation.discovery.SimulatedDiscovery``.
    """

    def discover(self) -> NodeInventory: ...

    def close(self) -> None: ...
