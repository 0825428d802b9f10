"""How one physical GPU is published: whole, as N MPS or time-sliced share devices, as one
consumable device that many claims share by capacity (``driver/gpu/published/consumable.py``), or as the
placements of its MIG profiles, created at prepare (dynamic MIG, ``driver/gpu/discovery/migplacement.py``);
and how one MIG instance is: as its MIG device, or as N MPS or time-sliced shares of it
(``driver/gpu/published/migshareplan.py``).

This is the resolved, per-GPU form of the node sharing plan (``sharingplan.py`` parses the
YAML and resolves it against the inventory); ``devices.py`` turns it into share devices and
``state.py`` honours it at prepare.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from driver.gpu.claimconfig.choices import DeviceKind, MpsClients, TimeSliceInterval


class Enforcement(StrEnum):
    """How a share's limit is enforced; published so users can select on it with CEL."""

    NONE = "none"  # an entitlement only: nothing stops a workload from exceeding it
    MPS_PER_PROCESS = "mps-per-process"  # MPS enforces it on each client process
    # MPS caps each client process, but the GPU stays in compute mode DEFAULT (several daemons serve
    # it, and EXCLUSIVE_PROCESS admits one MPS server), so a process that does not reach its daemon
    # runs without MPS and outside the limit (nvidia-cuda-mps-control(1)): it holds for cooperating
    # workloads, not against a tenant who bypasses MPS on purpose.
    MPS_ADVISORY = "mps-advisory"
    # The kernel enforces it for every process of the container's cgroup (MPS v3 memory partitioning,
    # dmem controller). Published only where detection found it; see driver/gpu/claimcdi/kernelmemory.py.
    KERNEL = "kernel"
    # Published for an MPS share while its daemon's limits could not be read back for longer than the
    # watch interval (a client holds the control socket): they may have been changed (claim/limitstatement.py).
    MPS_UNCONFIRMED = "mps-unconfirmed"


# The first driver branch whose MPS control daemon refuses settings from UIDs other than root and
# the user who started it. Measured with NVIDIA's binaries (docs/sharing.md "NVIDIA's daemon, as
# measured"; nvidia-gpu reference 6.6): 550.163 refuses ("Insufficient privileges for UID 65534"),
# 535.261 took set_default_active_thread_percentage from UID 65534. Branches in between were not
# measured and count as accepting.
FIRST_BRANCH_GUARDING_MPS_CONTROL = 550


def mps_control_guarded(driver_version: str | None) -> bool:
    """Whether the node's MPS control daemon refuses control commands from non-root UIDs (False if unknown)."""
    major = (driver_version or "").strip().split(".", 1)[0]
    return major.isdigit() and int(major) >= FIRST_BRANCH_GUARDING_MPS_CONTROL


def mps_enforcement(clients: MpsClients, driver_version: str | None, exclusive: bool = True) -> Enforcement:
    """How an MPS daemon's limits hold for the clients it admits.

    Per process only where no client can change or stop the daemon (non-root clients, and a daemon
    that refuses non-root control) and none can run beside it (``exclusive``: its GPU is in
    EXCLUSIVE_PROCESS); advisory otherwise.
    """
    if exclusive and clients == "nonRoot" and mps_control_guarded(driver_version):
        return Enforcement.MPS_PER_PROCESS
    return Enforcement.MPS_ADVISORY


class ConsumablePolicy(BaseModel):
    """The request policies of a consumable GPU (one device, ``allowMultipleAllocations: true``).

    Memory: whole GiB from ``memory_min_bytes`` to ``memory_max_bytes`` (MPS pinned limits are set in
    whole MiB and read back rounded down to whole G once they reach 1 GiB, so whole GiB is what the
    daemon shows as set). Multiprocessors: a multiple of ``multiprocessors_step`` SMs from
    ``multiprocessors_min`` to the GPU's SM count; a claim's thread percentage is
    floor(100 x its SMs / the GPU's SMs), so the claims of a GPU never add up to more than 100.
    """

    model_config = ConfigDict(extra="ignore", frozen=True)

    memory_bytes: int = Field(gt=0)  # the capacity value: the GPU's memory
    memory_min_bytes: int = Field(gt=0)
    memory_step_bytes: int = Field(gt=0)
    memory_max_bytes: int = Field(gt=0)
    memory_default_bytes: int = Field(gt=0)
    multiprocessors: int = Field(gt=0)  # the capacity value: the GPU's SM count
    multiprocessors_min: int = Field(gt=0)
    multiprocessors_step: int = Field(gt=0)
    multiprocessors_max: int = Field(gt=0)
    multiprocessors_default: int = Field(gt=0)
    memory_enforcement: Enforcement = Enforcement.MPS_ADVISORY
    # With kernel enforcement: the toolkit's nvidia-cdi-hook that sets each claim's limit (claimcdi/kernelmemory.py).
    memory_limit_hook: str | None = None


class DynamicMigPolicy(BaseModel):
    """A GPU in MIG mode published as every placement of ``profiles`` (each a counter-consuming device)
    and, with ``also_whole_gpu``, as its whole device consuming every counter."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profiles: tuple[str, ...] = Field(min_length=1)  # the GPU's profiles the plan allows, in the GPU's order
    also_whole_gpu: bool = True


class GpuForm(BaseModel):
    """A GPU split into ``count`` equal shares of one strategy, or (``Consumable``) published once for
    claims that each consume part of its capacity (``count`` 1, ``memory_bytes_per_share`` the whole
    GPU's memory, ``consumable`` the request policies), or (``DynamicMig``) as its MIG placements
    (``count`` 1, ``memory_bytes_per_share`` the GPU's memory, ``dynamic_mig`` the profiles)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Literal["MPS", "TimeSlicing", "Consumable", "DynamicMig"]
    count: int = Field(ge=1, le=48)
    # MPS: SM share each client gets, and its pinned device memory limit in bytes.
    active_thread_percentage: int | None = Field(default=None, ge=1, le=100)
    memory_bytes_per_share: int = Field(gt=0)
    # TimeSlicing: the compute time-slice applied to the GPU while the plan is in force.
    interval: TimeSliceInterval | None = None
    # Two shares of one GPU in one claim buy nothing unless the operator says otherwise.
    allow_multiple_shares_per_claim: bool = False
    consumable: ConsumablePolicy | None = None
    # MPS: who may share the GPU's daemon (the plan entry's mps.clients; its default too).
    mps_clients: MpsClients = "nonRoot"
    # MPS and Consumable: bytes of each daemon's own /dev/shm tmpfs (the plan daemon's, or each claim's
    # share daemon's); None: the node's --mps-shm-size.
    shm_size_bytes: int | None = None
    dynamic_mig: DynamicMigPolicy | None = None
    # MPS and TimeSlicing: the profile of the MIG instance these shares split (its layout key is then the
    # instance's MIG UUID); None: a whole GPU's shares.
    mig_profile: str | None = None

    @model_validator(mode="after")
    def _form(self) -> GpuForm:
        if (self.strategy == "Consumable") != (self.consumable is not None):
            raise ValueError("consumable policies go with strategy Consumable, and only with it")
        if (self.strategy == "DynamicMig") != (self.dynamic_mig is not None):
            raise ValueError("a dynamic MIG policy goes with strategy DynamicMig, and only with it")
        if self.strategy in ("MPS", "TimeSlicing") and self.count < 2:
            raise ValueError(f"{self.strategy} needs at least 2 shares, got {self.count}")
        if self.strategy in ("Consumable", "DynamicMig") and self.count != 1:
            raise ValueError(f"a {self.strategy} GPU has no share count, got count {self.count}")
        if self.mig_profile is not None and self.strategy not in ("MPS", "TimeSlicing"):
            raise ValueError(f"a MIG instance can be split into MPS or TimeSlicing shares only, not {self.strategy}")
        return self

    @property
    def device_type(self) -> DeviceKind:
        return {"MPS": DeviceKind.MPS, "TimeSlicing": DeviceKind.TIMESLICE, "Consumable": DeviceKind.CONSUMABLE,
                "DynamicMig": DeviceKind.MIG}[self.strategy]

    def memory_enforcement(self, driver_version: str | None) -> Enforcement:
        """How the memory limit holds on a node with NVIDIA driver ``driver_version`` (None: unknown)."""
        if self.consumable is not None:
            return self.consumable.memory_enforcement
        if self.strategy == "MPS":
            return self._mps_enforcement(driver_version)
        return Enforcement.NONE

    def _mps_enforcement(self, driver_version: str | None) -> Enforcement:
        # A MIG instance's GPU stays in compute mode DEFAULT (the only mode MIG allows), so a client that
        # leaves MPS runs on the instance beside the daemon: its limits are advisory.
        return mps_enforcement(self.mps_clients, driver_version, exclusive=self.mig_profile is None)

    def compute_enforcement(self, driver_version: str | None) -> Enforcement:
        if self.consumable is not None:
            return Enforcement.MPS_ADVISORY
        if self.strategy == "MPS":
            return self._mps_enforcement(driver_version)
        return Enforcement.NONE


# Resolved plan: GPU UUID -> shares, and MIG UUID -> shares of that MIG instance (``mig_profile`` set).
# GPUs absent from the mapping are published whole (a GPU in MIG mode: as its MIG devices), instances
# absent from it as MIG devices.
SharingLayout = dict[str, GpuForm]


def plan_timeslices(layout: SharingLayout) -> dict[str, TimeSliceInterval]:
    """GPU UUID -> the time slice the plan sets on it: its time-sliced whole GPUs. A MIG instance has no time
    slice of its own (``migshareplan.py``), so its time-sliced shares set none."""
    return {uuid: s.interval or "Default" for uuid, s in layout.items()
            if s.strategy == "TimeSlicing" and s.mig_profile is None}
