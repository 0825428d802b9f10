"""Client-side checks of counter sets and the devices that consume them (partitionable devices).

The API server checks a slice's own counters against the release's limits; it does not check that
a consumed counter set exists somewhere in the pool, that set names are unique across the pool, or
that a device could ever fit its set. The scheduler ignores such a pool, so these are checked here
before anything is sent, every problem at once, naming the set, device and counter. Limits come
from :mod:`.slicelimits`. Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from decimal import Decimal

from driver.kubeletplugin.slicelimits import SliceLimits
from driver.kubeletplugin.slicemodel import CounterSet, Device, PlannedSlice
from driver.kubeletplugin.slicevalidation import is_dns_label, quantity_value

_DNS_LABEL_RULE = "must be a DNS label (at most 63 lower-case alphanumerics or '-', starting and ending with one)"


def validate_counter_sets(counter_sets: Sequence[CounterSet], limits: SliceLimits) -> list[str]:
    """Problems with the pool's counter sets: names, counters, values, and the per-set limit."""
    problems: list[str] = []
    seen: set[str] = set()
    for counter_set in counter_sets:
        label = f'counter set "{counter_set.name}"'
        if not is_dns_label(counter_set.name):
            problems.append(f"{label}: name {_DNS_LABEL_RULE}")
        if counter_set.name in seen:
            # 1.34 wants them unique in the slice, 1.35+ in the pool; unique in the pool satisfies both.
            problems.append(f"{label}: name is used more than once in the pool")
        seen.add(counter_set.name)
        if not counter_set.counters:
            problems.append(f"{label}: has no counters")
        if len(counter_set.counters) > limits.max_counters_per_set:
            problems.append(f"{label}: has {len(counter_set.counters)} counters, the limit is "
                            f"{limits.max_counters_per_set} on Kubernetes 1.{limits.minor_version}")
        for name, counter in counter_set.counters.items():
            if not is_dns_label(name):
                problems.append(f'{label}: counter "{name}": name {_DNS_LABEL_RULE}')
            value = quantity_value(counter.value)
            if value is None or value < 0:
                problems.append(f'{label}: counter "{name}": value "{counter.value}" is not a quantity of 0 or more')
    return problems


def validate_consumption(devices: Sequence[Device], counter_sets: Sequence[CounterSet],
                         limits: SliceLimits) -> list[str]:
    """Problems with what devices consume: the release's per-device limits, and that every consumed
    set and counter exists in the pool and holds at least what one device takes."""
    available = {s.name: {k: quantity_value(c.value) for k, c in s.counters.items()} for s in counter_sets}
    problems: list[str] = []
    for device in devices:
        if not device.consumes_counters:
            continue
        label = f'device "{device.name}"'
        entries = device.consumes_counters
        if limits.max_consumptions_per_device is not None and len(entries) > limits.max_consumptions_per_device:
            problems.append(f"{label}: consumes from {len(entries)} counter sets, the limit is "
                            f"{limits.max_consumptions_per_device} on Kubernetes 1.{limits.minor_version}")
        names = [e.counter_set for e in entries]
        for name in sorted({n for n in names if names.count(n) > 1}):
            problems.append(f'{label}: consumes from counter set "{name}" in more than one entry')
        if limits.counter_layout == "combined":
            total = sum(len(e.counters) for e in entries)
            if total > limits.max_counters_per_consumption:
                problems.append(f"{label}: consumes {total} counters, the limit is "
                                f"{limits.max_counters_per_consumption} per device on Kubernetes 1.34")
        for entry in entries:
            where = f'{label}: counter set "{entry.counter_set}"'
            if limits.counter_layout == "split" and len(entry.counters) > limits.max_counters_per_consumption:
                problems.append(f"{where}: consumes {len(entry.counters)} counters, the limit is "
                                f"{limits.max_counters_per_consumption} per entry")
            offered = available.get(entry.counter_set)
            if offered is None:
                problems.append(f"{where}: no such counter set in the pool")
                continue
            for name, counter in entry.counters.items():
                problems.extend(f'{where}: counter "{name}": {p}'
                                for p in _amount_problems(counter.value, offered, name))
    return problems


def _amount_problems(value: str, offered: dict[str, Decimal | None], name: str) -> list[str]:
    amount = quantity_value(value)
    if amount is None or amount < 0:
        return [f'value "{value}" is not a quantity of 0 or more']
    if name not in offered:
        return ["the counter set has no such counter"]
    total = offered[name]
    if total is not None and amount > total:
        # Never allocatable: a bug in how the amounts were derived, worth stopping for.
        return [f"consumes {value}, more than the set's {total.normalize():f}"]
    return []


def validate_slice_counters(index: int, planned: PlannedSlice, limits: SliceLimits) -> list[str]:
    """Problems of one planned slice with the release's per-slice counter rules."""
    label = f"slice {index}"
    sets, devices = planned.shared_counters, planned.devices
    problems: list[str] = []
    if limits.counter_layout == "split":
        if sets and devices:
            problems.append(f"{label}: holds devices and counter sets; Kubernetes 1.{limits.minor_version} "
                            "allows only one of them per slice")
        if limits.max_counter_sets_per_slice is not None and len(sets) > limits.max_counter_sets_per_slice:
            problems.append(f"{label}: holds {len(sets)} counter sets, the limit is "
                            f"{limits.max_counter_sets_per_slice}")
        return problems
    total = sum(len(s.counters) for s in sets)
    if limits.max_counters_per_slice is not None and total > limits.max_counters_per_slice:
        problems.append(f"{label}: its counter sets hold {total} counters, the limit is "
                        f"{limits.max_counters_per_slice} per slice on Kubernetes 1.34")
    consumed = sum(len(e.counters) for d in devices for e in d.consumes_counters)
    if limits.max_consumed_counters_per_slice is not None and consumed > limits.max_consumed_counters_per_slice:
        problems.append(f"{label}: its devices consume {consumed} counters in all, the limit is "
                        f"{limits.max_consumed_counters_per_slice} per slice on Kubernetes 1.34")
    here = {s.name for s in sets}
    for device in devices:
        for entry in device.consumes_counters:
            if entry.counter_set not in here:
                problems.append(f'{label}: device "{device.name}" consumes from counter set "{entry.counter_set}", '
                                "which Kubernetes 1.34 needs in the same slice")
    return problems
