"""Which slice each device and counter set goes into: pure functions, no I/O.

Three shapes (resource-api reference, section 3):

* no counters: devices in order, each slice filled up to the cap that applies to it;
* **split** (Kubernetes 1.35+, where a slice holds devices or counter sets, never both): slices of
  counter sets only (at most 8 each) first, then the devices as above;
* **combined** (1.34, whose counter model needs a device's counter set in the device's own slice):
  devices that consume nothing as above, then one slice per counter set holding the set and every
  device that consumes from it (sets that devices tie together share a slice).

All slices of the pool carry one generation and one slice count (:mod:`.sliceplanner`).
"""

from __future__ import annotations

from collections.abc import Sequence

from driver.kubeletplugin.slicelimits import SliceLimits
from driver.kubeletplugin.slicemodel import CounterSet, Device, PlannedSlice

_LIST_ATTRIBUTE_FIELDS = ("ints", "bools", "strings", "versions")


def layout_slices(devices: Sequence[Device], counter_sets: Sequence[CounterSet],
                  limits: SliceLimits) -> list[PlannedSlice]:
    """The pool's slices, in publishing order; at least one (possibly empty)."""
    if not counter_sets and not any(d.consumes_counters for d in devices):
        return [PlannedSlice(devices=tuple(s)) for s in split_into_slices(devices, limits)]
    if limits.counter_layout == "split":
        return _split(devices, counter_sets, limits)
    return _combined(devices, counter_sets, limits)


def split_into_slices(devices: Sequence[Device], limits: SliceLimits) -> list[list[Device]]:
    """Devices in order, each slice filled up to its cap; at least one (possibly empty) slice.

    Slice order matters: the allocator tries slices in name order, so earlier devices stay in
    earlier slices.
    """
    slices: list[list[Device]] = [[]]
    restricted = False
    for device in devices:
        device_restricts = restricts_slice(device, limits)
        would_restrict = restricted or device_restricts
        cap = limits.max_devices_per_slice_restricted if would_restrict else limits.max_devices_per_slice
        if len(slices[-1]) + 1 > cap:
            slices.append([])
            would_restrict = device_restricts
        slices[-1].append(device)
        restricted = would_restrict
    return slices


def device_cap(devices: Sequence[Device], limits: SliceLimits) -> int:
    """How many devices a slice holding ``devices`` may hold."""
    restricted = any(restricts_slice(d, limits) for d in devices)
    return limits.max_devices_per_slice_restricted if restricted else limits.max_devices_per_slice


def restricts_slice(device: Device, limits: SliceLimits) -> bool:
    """Whether this device lowers its slice's device cap (taints, counters, list attributes)."""
    if device.consumes_counters and limits.minor_version >= 35:
        return True
    if device.taints and limits.taints_restrict_slice:
        return True
    if limits.list_attributes_restrict_slice:
        wire = device.to_wire()
        return any(
            name in value for value in wire.get("attributes", {}).values() for name in _LIST_ATTRIBUTE_FIELDS)
    return False


def _split(devices: Sequence[Device], counter_sets: Sequence[CounterSet], limits: SliceLimits) -> list[PlannedSlice]:
    per_slice = limits.max_counter_sets_per_slice or max(len(counter_sets), 1)
    slices = [PlannedSlice(shared_counters=tuple(counter_sets[i:i + per_slice]))
              for i in range(0, len(counter_sets), per_slice)]
    if devices or not slices:
        slices += [PlannedSlice(devices=tuple(s)) for s in split_into_slices(devices, limits)]
    return slices


def _combined(devices: Sequence[Device], counter_sets: Sequence[CounterSet],
              limits: SliceLimits) -> list[PlannedSlice]:
    group_of = _set_groups(devices, counter_sets)
    plain = [d for d in devices if not d.consumes_counters]
    grouped: dict[int, list[Device]] = {}
    for device in devices:
        if device.consumes_counters:
            # Validation has refused consumption of a set the pool lacks, so the lookup holds.
            grouped.setdefault(group_of[device.consumes_counters[0].counter_set], []).append(device)
    slices = [PlannedSlice(devices=tuple(s)) for s in split_into_slices(plain, limits)] if plain else []
    for group in sorted(set(group_of.values())):
        sets = tuple(s for s in counter_sets if group_of[s.name] == group)
        slices.append(PlannedSlice(devices=tuple(grouped.get(group, [])), shared_counters=sets))
    return slices or [PlannedSlice()]


def _set_groups(devices: Sequence[Device], counter_sets: Sequence[CounterSet]) -> dict[str, int]:
    """Counter set name -> its group: sets one device consumes from together end up in one group,
    numbered by the first set's position."""
    parent = {s.name: s.name for s in counter_sets}

    def root(name: str) -> str:
        while parent[name] != name:
            parent[name] = parent[parent[name]]
            name = parent[name]
        return name

    for device in devices:
        names = [e.counter_set for e in device.consumes_counters if e.counter_set in parent]
        for other in names[1:]:
            parent[root(other)] = root(names[0])
    position = {s.name: i for i, s in enumerate(counter_sets)}
    first: dict[str, int] = {}
    for s in counter_sets:
        first.setdefault(root(s.name), position[s.name])
    return {s.name: first[root(s.name)] for s in counter_sets}
