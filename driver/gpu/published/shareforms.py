"""The ``mps`` and ``timeSlicing`` forms of a sharing-plan entry, and how they split what the entry
matched (a whole GPU, or one MIG instance: ``migshareplan.py``) into equal shares.

Pure: plan objects in, :class:`~driver.gpu.published.sharelayout.GpuForm` out; a ValueError says which field to fix.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict

from driver.gpu.claimconfig.api import ByteQuantity, ShmSize
from driver.gpu.claimconfig.choices import MpsClients, TimeSliceInterval
from driver.gpu.published.sharelayout import GpuForm
from driver.units import MIB

# MPS serves at most 48 clients per GPU on Volta and newer (NVIDIA MPS documentation); a plan never
# promises more shares than one daemon can serve.
MAX_SHARES = 48


def between(low: int, high: int, value: int | None) -> int | None:
    if value is not None and not low <= value <= high:
        raise ValueError(f"must be between {low} and {high}, got {value}")
    return value


ShareCount = Annotated[int, AfterValidator(partial(between, 2, MAX_SHARES))]
Percentage = Annotated[int, AfterValidator(partial(between, 1, 100))]


class PlanObject(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class MpsShares(PlanObject):
    """Split a GPU into ``shares`` MPS shares, each with an enforced thread and memory limit."""

    shares: ShareCount
    activeThreadPercentage: Percentage | None = None  # default floor(100 / shares)
    pinnedMemoryLimit: ByteQuantity | None = None  # per share; default GPU memory / shares
    # Who may hold a share: nonRoot refuses, at prepare, claims whose pods could run as host root (and so
    # control the daemon all shares of the GPU go through); any admits them, and the limits are advisory.
    clients: MpsClients = "nonRoot"
    # The GPU's daemon's own /dev/shm tmpfs, which every share's containers use with it: size it for
    # all the shares. Default: the node's --mps-shm-size.
    shmSize: ShmSize | None = None


class TimeSlicingShares(PlanObject):
    """Publish a GPU ``shares`` times; the shares take turns, and memory is an entitlement only."""

    shares: ShareCount
    interval: TimeSliceInterval = "Default"
    memoryPerShare: ByteQuantity | None = None  # not enforced; default GPU memory / shares


@dataclass(frozen=True)
class ShareUnit:
    """What an entry splits: a whole GPU (``mig_profile`` None) or one MIG instance of that profile."""

    what: str  # "GPU" or "MIG instance", for messages
    memory_bytes: int | None
    mig_profile: str | None = None


def mps_shares(mps: MpsShares, unit: ShareUnit, allow_multiple: bool) -> GpuForm:
    # MPS enforces whole MiB, so check and publish what will be enforced.
    explicit = None if mps.pinnedMemoryLimit is None else mps.pinnedMemoryLimit // MIB * MIB
    if explicit == 0:
        raise ValueError("mps.pinnedMemoryLimit is less than 1 MiB; MPS limits are set in whole MiB")
    per_share = memory_per_share(unit, mps.shares, explicit, "mps.pinnedMemoryLimit")
    return GpuForm(
        strategy="MPS",
        count=mps.shares,
        active_thread_percentage=(
            mps.activeThreadPercentage if mps.activeThreadPercentage is not None else 100 // mps.shares
        ),
        memory_bytes_per_share=per_share,
        allow_multiple_shares_per_claim=allow_multiple,
        mps_clients=mps.clients,
        shm_size_bytes=mps.shmSize,
        mig_profile=unit.mig_profile,
    )


def time_slicing_shares(ts: TimeSlicingShares, unit: ShareUnit, allow_multiple: bool) -> GpuForm:
    per_share = memory_per_share(unit, ts.shares, ts.memoryPerShare, "timeSlicing.memoryPerShare")
    if per_share == 0:
        raise ValueError("timeSlicing.memoryPerShare must be more than 0 bytes")
    return GpuForm(
        strategy="TimeSlicing",
        count=ts.shares,
        memory_bytes_per_share=per_share,
        interval=ts.interval,
        allow_multiple_shares_per_claim=allow_multiple,
        mig_profile=unit.mig_profile,
    )


def memory_per_share(unit: ShareUnit, shares: int, explicit: int | None, field: str) -> int:
    if explicit is None:
        if unit.memory_bytes is None:
            raise ValueError(f"the {unit.what}'s memory size is unknown; set {field} explicitly")
        per_share = unit.memory_bytes // shares // MIB * MIB
        if per_share == 0:
            raise ValueError(
                f"the {unit.what}'s {unit.memory_bytes} bytes of memory give less than 1 MiB to each of "
                f"{shares} shares"
            )
        return per_share
    if unit.memory_bytes is not None and explicit * shares > unit.memory_bytes:
        raise ValueError(
            f"{shares} shares x {field} {explicit // MIB} MiB is more than the {unit.what}'s "
            f"{unit.memory_bytes // MIB} MiB; lower {field} or the number of shares"
        )
    return explicit
