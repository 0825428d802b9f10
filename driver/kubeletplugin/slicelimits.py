"""The API server's limits on ResourceSlice content, per Kubernetes release: defined here only.

Figures are those of ``k8s.io/api`` resource/v1 for Kubernetes 1.34 to 1.37 (resource-api
reference, sections 2 and 2.3). Validation, the slice planner, the API-version fallback and the
GPU side's device builder all read them from here, so a new release changes one file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# Where counter sets go: "combined", each set in one slice with every device that consumes it (1.34);
# "split", sets in slices of their own that hold no devices (1.35+, where the two are exclusive).
CounterLayout = Literal["combined", "split"]

OLDEST_SUPPORTED_MINOR = 34
# Assumed when the server's version cannot be read: the oldest supported release. Its limits are
# the strictest on taints per device (4) and taint effects, but not on devices per slice: from
# 1.35 a slice with a tainted device holds at most 64 devices, on 1.34 it may hold 128.
FALLBACK_MINOR_VERSION = OLDEST_SUPPORTED_MINOR

MAX_DEVICES_PER_SLICE = 128
# The lower cap of a slice holding a device with a "heavy" feature (taints, counters, list attributes).
MAX_DEVICES_PER_SLICE_RESTRICTED = 64
MAX_ATTRIBUTES_AND_CAPACITIES = 32
MAX_STRING_ATTRIBUTE_BYTES = 64
MAX_VERSION_ATTRIBUTE_LENGTH = 64
MAX_ATTRIBUTE_ID_LENGTH = 32
# A device name is a DNS label.
MAX_DEVICE_NAME_LENGTH = 63
MAX_DRIVER_NAME_LENGTH = 63
MAX_POOL_NAME_LENGTH = 253

# Counters (partitionable devices, KEP-4815). 1.34 has the first model: sets and the devices that
# consume them in one slice, limits counted per slice. 1.35 reshaped it: sets in slices of their own,
# limits per set and per consumption entry.
MAX_COUNTERS_PER_SLICE_1_34 = 32  # all counters of all sets of one slice
MAX_CONSUMED_COUNTERS_PER_DEVICE_1_34 = 32
MAX_CONSUMED_COUNTERS_PER_SLICE_1_34 = 1024  # summed over the slice's devices
MAX_COUNTER_SETS_PER_SLICE = 8  # 1.35+
MAX_COUNTERS_PER_SET = 32  # 1.35+
MAX_CONSUMPTIONS_PER_DEVICE = 2  # 1.35+: consumesCounters entries, one per counter set
MAX_COUNTERS_PER_CONSUMPTION = 32  # 1.35+

_TAINT_EFFECTS_1_34 = ("NoSchedule", "NoExecute")
_TAINT_EFFECTS_1_35 = ("None", "NoSchedule", "NoExecute")


@dataclass(frozen=True)
class SliceLimits:
    """Server-side limits of one Kubernetes minor release that depend on the release."""

    minor_version: int
    max_devices_per_slice: int
    # Lower cap that applies to a slice as soon as one of its devices uses a "heavy" feature.
    max_devices_per_slice_restricted: int
    taints_restrict_slice: bool
    list_attributes_restrict_slice: bool
    max_attributes_and_capacities: int
    max_taints_per_device: int
    taint_effects: tuple[str, ...]
    counter_layout: CounterLayout
    # None where the release has no such limit.
    max_counter_sets_per_slice: int | None
    max_counters_per_set: int
    max_counters_per_slice: int | None
    max_consumptions_per_device: int | None
    max_counters_per_consumption: int  # per entry (1.35+); over all entries of the device (1.34)
    max_consumed_counters_per_slice: int | None


def limits_for(minor_version: int) -> SliceLimits:
    """Limits for Kubernetes ``1.<minor_version>``; releases newer than 1.37 get the 1.37 limits."""
    if minor_version < OLDEST_SUPPORTED_MINOR:
        raise ValueError(
            f"Kubernetes 1.{minor_version} is not supported: resource.k8s.io/v1 ResourceSlices "
            f"need Kubernetes 1.{OLDEST_SUPPORTED_MINOR} or newer")
    return SliceLimits(
        minor_version=minor_version,
        max_devices_per_slice=MAX_DEVICES_PER_SLICE,
        max_devices_per_slice_restricted=MAX_DEVICES_PER_SLICE_RESTRICTED,
        taints_restrict_slice=minor_version >= 35,
        list_attributes_restrict_slice=minor_version >= 36,
        max_attributes_and_capacities=MAX_ATTRIBUTES_AND_CAPACITIES,
        max_taints_per_device=4 if minor_version == 34 else 16,
        taint_effects=_TAINT_EFFECTS_1_34 if minor_version == 34 else _TAINT_EFFECTS_1_35,
        counter_layout="combined" if minor_version == 34 else "split",
        max_counter_sets_per_slice=None if minor_version == 34 else MAX_COUNTER_SETS_PER_SLICE,
        max_counters_per_set=MAX_COUNTERS_PER_SLICE_1_34 if minor_version == 34 else MAX_COUNTERS_PER_SET,
        max_counters_per_slice=MAX_COUNTERS_PER_SLICE_1_34 if minor_version == 34 else None,
        max_consumptions_per_device=None if minor_version == 34 else MAX_CONSUMPTIONS_PER_DEVICE,
        max_counters_per_consumption=(MAX_CONSUMED_COUNTERS_PER_DEVICE_1_34 if minor_version == 34
                                      else MAX_COUNTERS_PER_CONSUMPTION),
        max_consumed_counters_per_slice=MAX_CONSUMED_COUNTERS_PER_SLICE_1_34 if minor_version == 34 else None,
    )
