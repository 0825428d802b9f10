"""The sharing-plan entry ``dynamicMig`` and what it makes of one GPU.

``dynamicMig: {profiles: [1g.10gb, 3g.40gb], alsoWholeGpu: true}`` publishes a GPU that is in MIG
mode with no instances of anyone else's as every placement of the allowed profiles (default: all
the GPU offers) plus, unless ``alsoWholeGpu: false``, its whole device, all consuming the GPU's
counters (``discovery/migplacement.py``). A GPU that cannot be published so (no MIG, MIG mode off, someone
else's instances, no profiles from NVML, an API server without partitionable devices) is published
as it would be without the entry, and the reason is returned for the log. Tessera never changes a
GPU's MIG mode. Pure functions, no I/O.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, ConfigDict, field_validator

from driver.gpu.discovery.inventory import GpuInfo
from driver.gpu.discovery.migplacement import OwnInstances, counter_values, foreign_instances
from driver.gpu.published.sharelayout import DynamicMigPolicy, GpuForm

# NVIDIA's profile names: <G>g.<GB>gb or <C>c.<G>g.<GB>gb, with a +me, +me.all, +gfx or -me suffix.
_PROFILE_NAME = re.compile(r"([1-9][0-9]*c\.)?[1-9][0-9]*g\.[1-9][0-9]*gb([+-][a-z]+(\.[a-z]+)*)?")


def _profile_name(value: str) -> str:
    if not _PROFILE_NAME.fullmatch(value):
        raise ValueError(f'"{value}" is not a MIG profile name (e.g. 1g.10gb, 3g.40gb, 1g.10gb+me)')
    return value


ProfileName = Annotated[str, AfterValidator(_profile_name)]


class DynamicMigEntry(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    profiles: list[ProfileName] | None = None  # the profiles to publish; default every one the GPU offers
    alsoWholeGpu: bool = True  # also publish the whole GPU, consuming every counter

    @field_validator("profiles")
    @classmethod
    def _listed_once(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("an empty list allows no profile; leave profiles out to allow every profile of the GPU")
        repeated = sorted({name for name in value if value.count(name) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} listed more than once")
        return value


def unknown_profiles(entry: DynamicMigEntry, gpu: GpuInfo) -> list[str]:
    """Allowed profiles this GPU does not offer (plans are shared by nodes with different GPUs)."""
    offered = {p.name for p in gpu.mig_profiles}
    return [name for name in entry.profiles or () if offered and name not in offered]


def dynamic_mig_form(entry: DynamicMigEntry, gpu: GpuInfo, *, supported: bool,
                     own: OwnInstances) -> tuple[GpuForm | None, str | None]:
    """(the GPU's dynamic MIG form or None: published as without the entry, a note for the log or None).

    ``supported``: the API server keeps partitionable devices (:func:`migplacement.partitionable_supported`);
    ``own``: instances Tessera created, which do not count as someone else's. ValueError (naming the
    field) when the entry allows no profile this GPU offers.
    """
    reason = unavailable_reason(gpu, own, supported)
    if reason is not None:
        return None, reason
    offered = [p.name for p in gpu.mig_profiles]
    allowed = offered if entry.profiles is None else [name for name in offered if name in entry.profiles]
    if not allowed:
        raise ValueError(f"dynamicMig.profiles: none of {', '.join(entry.profiles or ())} is offered by this GPU; "
                         f"it offers {', '.join(offered)}")
    assert gpu.memory_bytes is not None  # unavailable_reason: the counters need it
    shares = GpuForm(strategy="DynamicMig", count=1, memory_bytes_per_share=gpu.memory_bytes,
                       dynamic_mig=DynamicMigPolicy(profiles=tuple(allowed), also_whole_gpu=entry.alsoWholeGpu))
    unknown = unknown_profiles(entry, gpu)
    notes = []
    if unknown:
        notes.append(f"dynamicMig.profiles {', '.join(unknown)} not offered by this GPU (it offers "
                     f"{', '.join(offered)}); publishing the others")
    if (pending := pending_mig_mode(gpu)) is not None:
        notes.append(f"{pending}; served as dynamic MIG until then")
    return shares, "; ".join(notes) or None


# Where a MIG mode change takes effect without a GPU reset: once no process holds the GPU (NVIDIA's MIG user
# guide; nvidia-smi -mig says so and leaves the mode pending while a process, DCGM or a monitor holds it).
_IDLE_TOGGLE_ARCHITECTURES = ("Hopper", "Blackwell", "Rubin")


def pending_mig_mode(gpu: GpuInfo) -> str | None:
    """What a MIG mode set but not in effect yet needs (for the operator); None when none is pending."""
    if gpu.mig_mode_pending is None:
        return None
    reset = (f"a GPU reset (nvidia-smi -i {gpu.uuid} -r, with no process on the GPU) or a reboot; running "
             f"nvidia-smi -mig {int(gpu.mig_mode_pending == 'enable')} again does not apply it")
    idle = ("no process holding the GPU (workloads, MPS daemons, DCGM or other monitoring agents); it then takes "
            "effect by itself")
    if gpu.architecture == "Ampere":
        needs = reset
    elif gpu.architecture in _IDLE_TOGGLE_ARCHITECTURES:
        needs = idle
    else:
        needs = f"{reset} (Ampere), or {idle} (Hopper and later)"
    return f"MIG mode {gpu.mig_mode_pending} is pending on {gpu.architecture or 'this GPU'}: it needs {needs}"


def unavailable_reason(gpu: GpuInfo, own: OwnInstances, supported: bool) -> str | None:
    """Why ``gpu`` cannot be published as dynamic MIG, ending with what it is published as; None if it can."""
    if not gpu.mig_enabled:
        if gpu.mig_mode_pending == "enable":
            return f"{pending_mig_mode(gpu)}; published as a whole GPU until then"
        if gpu.mig_capable:
            return (f"MIG mode is off (Tessera never changes it; an operator enables it with "
                    f"'nvidia-smi -i {gpu.uuid} -mig 1'), published as a whole GPU")
        return "no MIG support, published as a whole GPU"
    foreign = foreign_instances(gpu, own)
    if foreign:
        return f"has MIG instances Tessera did not create ({', '.join(foreign)}), published as those MIG devices"
    nothing = "no devices for it until MIG instances are created"
    if not gpu.mig_profiles:
        return f"NVML lists no MIG profiles for it; {nothing}"
    if not counter_values(gpu):
        return (f"its memory size or a profile spanning all {gpu.mig_memory_slices} memory slices is unknown, so its "
                f"counters cannot be set; {nothing}")
    if not supported:
        return ("the API server does not keep partitionable devices (Kubernetes 1.36+, or 1.34/1.35 with the "
                f"DRAPartitionableDevices gate on and partitionableDevicesGate: true in the plans file); {nothing}")
    return None
