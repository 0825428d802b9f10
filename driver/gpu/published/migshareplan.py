"""Sharing-plan entries for MIG instances (``match.migProfile``): which forms they may take and how one
instance is split into MPS or time-sliced shares.

A shared instance is published as its shares instead of as its MIG device (``devices.py``), each share
prepared with the instance's device nodes and capability nodes; its layout key is the instance's MIG
UUID. Pure; ValueErrors say what to fix.

Facts (docs/sharing.md, "Shares of MIG instances"):

* MPS runs on a MIG instance with the daemon's ``CUDA_VISIBLE_DEVICES`` set to the MIG UUID, and "the
  maximum number of clients (48) is lowered proportionally to the Compute Instance size" (NVIDIA MIG
  user guide, "CUDA MPS"). The limits are the instance's: a share's default pinned memory is the
  instance's memory divided by the shares.
* The compute time slice (``nvidia-smi compute-policy --set-timeslice``) is a whole GPU's policy that
  NVIDIA sets on full GPUs only (NVIDIA's DRA driver accepts TimeSlicing on a MIG device as a no-op),
  so time-sliced shares of an instance take turns at the driver's default slice, and an entry that
  asks for another interval is refused rather than silently ignored.
"""

from __future__ import annotations

from driver.gpu.discovery.inventory import GpuInfo, MigInstance
from driver.gpu.published.devicenames import mig_device_name
from driver.gpu.published.shareforms import (
    MAX_SHARES,
    MpsShares,
    ShareUnit,
    TimeSlicingShares,
    mps_shares,
    time_slicing_shares,
)
from driver.gpu.published.sharelayout import GpuForm

_FORM_ADVICE = {
    "whole": "an instance no migProfile entry matches is published whole already; leave the entry out, or put an "
             "entry with a narrower migProfile before a broader one",
    "consumable": "consumable applies to whole GPUs; use mps (one daemon with fixed per-share limits) for the "
                  "instance",
    "dynamicMig": "dynamicMig applies to whole GPUs in MIG mode (match them with minor, uuid, product or all)",
}


def check_instance_entry(form: str, time_slicing: TimeSlicingShares | None) -> None:
    """ValueError unless a ``migProfile`` entry's form (``mps``, ``timeSlicing``, ...) can split a MIG instance."""
    if form not in ("mps", "timeSlicing"):
        raise ValueError(f"match.migProfile selects MIG instances, which a plan splits into mps or timeSlicing "
                         f"shares only, not {form}: {_FORM_ADVICE.get(form, 'use mps or timeSlicing')}")
    if time_slicing is not None and time_slicing.interval != "Default":
        raise ValueError(
            f"timeSlicing.interval {time_slicing.interval} cannot be set for a MIG instance: the time slice is "
            "a whole GPU's compute policy (nvidia-smi compute-policy --set-timeslice), which NVIDIA's drivers "
            "set on full GPUs only; leave interval out (the shares take turns at the default time slice)")


def named_instances(gpu: GpuInfo) -> list[MigInstance]:
    """The instances of ``gpu`` published as MIG devices: several compute instances in one GPU instance would
    share a name, and the lowest CI id wins (as ``devices.py`` publishes them)."""
    named: dict[str, MigInstance] = {}
    for mig in sorted(gpu.mig_instances, key=lambda m: (m.placement_start, m.ci_id)):
        named.setdefault(mig_device_name(gpu.minor, mig.profile, mig.placement_start), mig)
    return list(named.values())


def mps_client_limit(gpu: GpuInfo, instance: MigInstance) -> int:
    """The most MPS clients ``instance`` serves: 48 lowered in proportion to its compute slices (floor, the safe
    side of NVIDIA's "proportionally"); 48 where the GPU's profiles are not known."""
    slices = {p.gi_profile_id: p.compute_slices for p in gpu.mig_profiles}
    own, full = slices.get(instance.gi_profile_id), max(slices.values(), default=0)
    if own is None or full == 0:
        return MAX_SHARES
    return max(1, MAX_SHARES * own // full)


def instance_shares(mps: MpsShares | None, time_slicing: TimeSlicingShares | None, allow_multiple: bool,
                    gpu: GpuInfo, instance: MigInstance) -> GpuForm:
    """``instance`` split as the entry says; limits relative to the instance (its memory, its SMs)."""
    unit = ShareUnit("MIG instance", instance.memory_bytes, mig_profile=instance.profile)
    if mps is not None:
        limit = mps_client_limit(gpu, instance)
        if mps.shares > limit:
            raise ValueError(f"mps.shares {mps.shares} is more than the {limit} MPS clients a {instance.profile} "
                             f"instance serves (48 lowered in proportion to its compute slices, NVIDIA MIG user "
                             f"guide); lower mps.shares")
        return mps_shares(mps, unit, allow_multiple)
    assert time_slicing is not None  # check_instance_entry: mps or timeSlicing
    return time_slicing_shares(time_slicing, unit, allow_multiple)
