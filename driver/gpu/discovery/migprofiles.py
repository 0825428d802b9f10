"""MIG profile naming: NVIDIA's canonical profile names and the fragment used in device names.

Pure functions. The naming rule is go-nvlib's (``<G>g.<GB>gb`` or ``<C>c.<G>g.<GB>gb`` plus a
suffix chosen by the GPU-instance profile enum) with its rounding reproduced exactly: Go's
``math.Round`` rounds half away from zero, Python's ``round()`` does not, and the difference
shows on real GPUs (H200 3g is ``3g.71gb``, B200 1g is ``1g.23gb``).
"""

from __future__ import annotations

import re

from driver.units import GIB, MIB

# NVML_GPU_INSTANCE_PROFILE_* enum values (nvml.h); the suffix of a profile name depends on them.
GI_PROFILE_1_SLICE_REV1 = 0x7
GI_PROFILE_2_SLICE_REV1 = 0x8
GI_PROFILE_1_SLICE_REV2 = 0x9
GI_PROFILE_1_SLICE_GFX = 0xA
GI_PROFILE_2_SLICE_GFX = 0xB
GI_PROFILE_4_SLICE_GFX = 0xC
GI_PROFILE_1_SLICE_NO_ME = 0xD
GI_PROFILE_2_SLICE_NO_ME = 0xE
GI_PROFILE_1_SLICE_ALL_ME = 0xF
GI_PROFILE_2_SLICE_ALL_ME = 0x10
GI_PROFILE_3_SLICE_GFX = 0x11

_SUFFIX_BY_GI_ENUM: dict[int, str] = {
    GI_PROFILE_1_SLICE_REV1: "+me",
    GI_PROFILE_2_SLICE_REV1: "+me",
    GI_PROFILE_1_SLICE_ALL_ME: "+me.all",
    GI_PROFILE_2_SLICE_ALL_ME: "+me.all",
    GI_PROFILE_1_SLICE_GFX: "+gfx",
    GI_PROFILE_2_SLICE_GFX: "+gfx",
    GI_PROFILE_3_SLICE_GFX: "+gfx",
    GI_PROFILE_4_SLICE_GFX: "+gfx",
    GI_PROFILE_1_SLICE_NO_ME: "-me",
    GI_PROFILE_2_SLICE_NO_ME: "-me",
}



def _ceil_div(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


def memory_gb(memory_mib: int, total_memory_bytes: int) -> int:
    """The ``<GB>`` of a profile name: the profile's share of the GPU, in eighths, times the GPU's GiB.

    All in integers so nothing depends on float rounding:
    eighths = ceil(memory / total * 8); total_gb = ceil(total / GiB);
    GB = floor(eighths / 8 * total_gb + 0.5), i.e. round half away from zero (values are positive).
    """
    if memory_mib <= 0:
        raise ValueError(f"memory_mib must be positive, got {memory_mib}")
    if total_memory_bytes <= 0:
        raise ValueError(f"total_memory_bytes must be positive, got {total_memory_bytes}")
    eighths = _ceil_div(memory_mib * MIB * 8, total_memory_bytes)
    total_gb = _ceil_div(total_memory_bytes, GIB)
    # floor(eighths * total_gb / 8 + 1/2) == floor((2 * eighths * total_gb + 8) / 16)
    return (2 * eighths * total_gb + 8) // 16


def profile_name(
    compute_slices_ci: int,
    gi_slices: int,
    memory_mib: int,
    total_memory_bytes: int,
    gi_enum: int,
) -> str:
    """The canonical MIG profile name, e.g. ``1g.10gb``, ``1c.3g.40gb``, ``1g.10gb+me``.

    ``compute_slices_ci`` / ``gi_slices`` are the compute-instance and GPU-instance slice counts,
    ``memory_mib`` the GI profile's ``memorySizeMB``, ``total_memory_bytes`` the parent GPU's total
    memory and ``gi_enum`` the ``NVML_GPU_INSTANCE_PROFILE_*`` value the profile was found under.
    """
    if gi_slices <= 0:
        raise ValueError(f"gi_slices must be positive, got {gi_slices}")
    if not 0 < compute_slices_ci <= gi_slices:
        raise ValueError(f"compute_slices_ci must be in 1..{gi_slices} (the GI slice count), got {compute_slices_ci}")
    gb = memory_gb(memory_mib, total_memory_bytes)
    base = f"{gi_slices}g.{gb}gb" if compute_slices_ci == gi_slices else f"{compute_slices_ci}c.{gi_slices}g.{gb}gb"
    return base + _SUFFIX_BY_GI_ENUM.get(gi_enum, "")


_NOT_NAME_SAFE = re.compile(r"[^a-z0-9-]")


def device_name_fragment(profile: str) -> str:
    """The profile as it appears inside a device name: ``1g.10gb`` → ``1g10gb``, ``1g.10gb+me`` → ``1g10gbme``.

    '.' and '+' are dropped, the rest lower-cased, and anything else outside ``[a-z0-9-]``
    becomes '-', so the result is always usable inside a DNS label.
    """
    stripped = profile.replace(".", "").replace("+", "").lower()
    fragment = _NOT_NAME_SAFE.sub("-", stripped)
    if not fragment or not fragment[0].isalnum() or not fragment[-1].isalnum():
        raise ValueError(f"MIG profile {profile!r} does not give a usable device-name fragment (got {fragment!r})")
    return fragment
