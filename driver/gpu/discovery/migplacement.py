"""Dynamic MIG: where each profile can be placed on a GPU, and the counters that stop the scheduler
from handing out placements that overlap or together need more than the GPU has.

A GPU in MIG mode with no instances is published as one counter set (its engines, its memory and
one counter per memory slice) and one device per placement of each allowed profile, each consuming
its profile's amounts and the memory slices it covers (KEP-4815 partitionable devices; resource-api
reference, section 3). The instance is created only when a claim for the placement is prepared.
Pure functions, no I/O; ``published/devices.py`` turns the results into published devices.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

from pydantic import BaseModel, ConfigDict, Field

from driver.gpu.discovery.inventory import GpuInfo, MigInstance, MigProfileInfo

# Instances Tessera created for claims, by (GPU UUID, GPU instance id): a GPU whose only instances
# are these stays dynamic, and they are not published as static MIG devices.
OwnInstances = Collection[tuple[str, int]]

MULTIPROCESSORS = "multiprocessors"
MEMORY = "memory"
_ENGINES = (MULTIPROCESSORS, "copy-engines", "decoders", "encoders", "jpeg-engines", "ofa-engines")


def memory_slice_counter(index: int) -> str:
    return f"memory-slice-{index}"


class MigPlacement(BaseModel):
    """One place a GPU instance of ``profile`` can be created: memory slices ``start`` to ``start + size - 1``.

    What a dynamic MIG device name stands for until prepare creates the instance there (and what
    the whole GPU of a dynamic MIG GPU stands for: its full-size profile at 0).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    profile: MigProfileInfo
    start: int = Field(ge=0)

    @property
    def size(self) -> int:
        return self.profile.memory_slices

    @property
    def memory_slices(self) -> range:
        return range(self.start, self.start + self.size)

    def overlaps(self, other: MigPlacement) -> bool:
        return self.start < other.start + other.size and other.start < self.start + self.size


def partitionable_supported(minor_version: int, gate_enabled: bool) -> bool:
    """Whether an API server of Kubernetes 1.<minor_version> keeps counter sets and consumption: beta
    and on from 1.36, alpha (off unless the gate is set on the API server and scheduler) in 1.34 and
    1.35 (resource-api reference, section 9). Elsewhere it silently drops them."""
    return minor_version >= 36 or (minor_version >= 34 and gate_enabled)


def full_profile(gpu: GpuInfo) -> MigProfileInfo | None:
    """The profile that spans every memory slice (7g.80gb on an H100), whose amounts are the GPU's
    counters; None if the GPU lists none. Where several do, the one with the most SMs."""
    spanning = [p for p in gpu.mig_profiles if gpu.mig_memory_slices and p.memory_slices == gpu.mig_memory_slices]
    return max(spanning, key=lambda p: p.multiprocessors, default=None)


def foreign_mig_instances(gpu: GpuInfo, own: OwnInstances) -> list[MigInstance]:
    """The GPU's MIG instances Tessera did not create."""
    return [m for m in gpu.mig_instances if (gpu.uuid, m.gi_id) not in own]


def foreign_instances(gpu: GpuInfo, own: OwnInstances) -> list[str]:
    """The GPU's MIG instances Tessera did not create, as ``profile@start``."""
    return [f"{m.profile}@{m.placement_start}" for m in foreign_mig_instances(gpu, own)]


def covers(placement: MigPlacement, instance: MigInstance) -> bool:
    """Whether ``placement`` shares a memory slice with an existing ``instance``."""
    return (placement.start < instance.placement_start + instance.placement_size
            and instance.placement_start < placement.start + placement.size)


def placements(gpu: GpuInfo, allowed: Iterable[str]) -> list[MigPlacement]:
    """Every placement of the allowed profiles, in the order the GPU lists its profiles, then by start."""
    names = set(allowed)
    # NVML never lists a placement past the last slice; a bad table must not make a device either.
    return [MigPlacement(profile=profile, start=start)
            for profile in gpu.mig_profiles if profile.name in names
            for start in sorted(profile.placement_starts) if start + profile.memory_slices <= gpu.mig_memory_slices]


def _engine_amounts(profile: MigProfileInfo) -> dict[str, int | None]:
    return dict(zip(_ENGINES, (profile.multiprocessors, profile.copy_engines, profile.decoders, profile.encoders,
                               profile.jpeg_engines, profile.ofa_engines), strict=True))


def counter_values(gpu: GpuInfo) -> dict[str, int]:
    """The GPU's counter set: the full-size profile's engines (those NVML reports), the GPU's memory
    in bytes, and 1 per memory slice. Empty if there is no full-size profile or the memory is unknown."""
    full = full_profile(gpu)
    if full is None or gpu.memory_bytes is None:
        return {}
    values = {name: amount for name, amount in _engine_amounts(full).items() if amount is not None}
    values[MEMORY] = gpu.memory_bytes
    values.update((memory_slice_counter(i), 1) for i in range(gpu.mig_memory_slices))
    return values


def placement_consumption(placement: MigPlacement, offered: dict[str, int]) -> dict[str, int]:
    """What a placement takes from its GPU's counter set ``offered``: its profile's engines and memory,
    and each memory slice it covers. A counter the set lacks is not consumed."""
    amounts = {name: amount for name, amount in _engine_amounts(placement.profile).items()
               if amount is not None and name in offered}
    amounts[MEMORY] = placement.profile.memory_bytes
    amounts.update((memory_slice_counter(i), 1) for i in placement.memory_slices)
    return amounts
