"""How one physical GPU is published: whole, or as N MPS or time-sliced share devices.

This is the resolved, per-GPU form of the node sharing plan (``sharingplan.py`` parses the
YAML and resolves it against the inventory); ``devices.py`` turns it into share devices and
``state.py`` honours it at prepare.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

TimeSliceInterval = Literal["Default", "Short", "Medium", "Long"]

# nvidia-smi compute-policy --set-timeslice values.
TIMESLICE_VALUES: dict[str, int] = {"Default": 0, "Short": 1, "Medium": 2, "Long": 3}


class Enforcement(StrEnum):
    """How a share's limit is enforced; published so users can select on it with CEL."""

    NONE = "none"  # an entitlement only: nothing stops a workload from exceeding it
    MPS_PER_PROCESS = "mps-per-process"  # MPS enforces it on each client process


class GpuShares(BaseModel):
    """A GPU split into ``count`` equal shares of one strategy."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    strategy: Literal["MPS", "TimeSlicing"]
    count: int = Field(ge=2, le=48)
    # MPS: SM share each client gets, and its pinned device memory limit in bytes.
    active_thread_percentage: int | None = Field(default=None, ge=1, le=100)
    memory_bytes_per_share: int = Field(gt=0)
    # TimeSlicing: the compute time-slice applied to the GPU while the plan is in force.
    interval: TimeSliceInterval | None = None
    # Two shares of one GPU in one claim buy nothing unless the operator says otherwise.
    allow_multiple_shares_per_claim: bool = False

    @property
    def device_type(self) -> str:
        return "mps" if self.strategy == "MPS" else "timeslice"

    @property
    def memory_enforcement(self) -> Enforcement:
        return Enforcement.MPS_PER_PROCESS if self.strategy == "MPS" else Enforcement.NONE

    @property
    def compute_enforcement(self) -> Enforcement:
        return Enforcement.MPS_PER_PROCESS if self.strategy == "MPS" else Enforcement.NONE


# Resolved plan: GPU UUID -> shares. GPUs absent from the mapping are published whole.
SharingLayout = dict[str, GpuShares]
