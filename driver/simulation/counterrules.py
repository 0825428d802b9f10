"""SIMULATION: the API server's rules for counter sets and counter consumption (partitionable devices,
KEP-4815), for the API server double, per served release (resource-api reference, 2.3 and 3).

1.34 (the first model): ``sharedCounters`` and the devices that consume them may share a slice; at
most 32 counters over all sets of a slice, set names unique in the slice, at most 32 counters
consumed per device and 1024 over the slice's devices; a consumed set must be one of the slice's.
1.35 on: a slice holds ``devices`` or ``sharedCounters``, never both; at most 8 sets per slice and 32
counters per set; at most 2 ``consumesCounters`` entries per device, one per set, 32 counters each
(the server does not look across slices: the scheduler checks the pool). A server without
``DRAPartitionableDevices`` (1.34/1.35 unless the gate is set) drops the fields silently.
"""

from __future__ import annotations

import re
from typing import Any

Obj = dict[str, Any]
Problem = tuple[str, str]

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_MAX_SETS_PER_SLICE = 8
_MAX_COUNTERS_PER_SET = 32
_MAX_CONSUMPTIONS_PER_DEVICE = 2
_MAX_COUNTERS_PER_CONSUMPTION = 32
_MAX_COUNTERS_PER_SLICE_1_34 = 32
_MAX_CONSUMED_PER_DEVICE_1_34 = 32
_MAX_CONSUMED_PER_SLICE_1_34 = 1024


def partitionable_enabled(minor_version: int, gate: bool) -> bool:
    return minor_version >= 36 or gate


def strip_partitionable(spec: Obj) -> None:
    """What a server with the gate off stores of a slice ``spec``."""
    spec.pop("sharedCounters", None)
    spec.pop("perDeviceNodeSelection", None)
    for device in spec.get("devices") or []:
        if isinstance(device, dict):
            device.pop("consumesCounters", None)


def _label_problem(value: object) -> str | None:
    text = str(value or "")
    if not text:
        return "Required value"
    if len(text) > 63 or not _DNS_LABEL.fullmatch(text):
        return (f'Invalid value: "{text}": a lowercase RFC 1123 label must consist of lower case alphanumeric '
                "characters or '-', and must start and end with an alphanumeric character")
    return None


def counter_errors(spec: Obj, minor_version: int) -> list[Problem]:
    errors: list[Problem] = []
    sets = spec.get("sharedCounters") or []
    devices = spec.get("devices") or []
    errors += _set_errors(sets, minor_version)
    if minor_version >= 35 and sets and devices:
        errors.append(("spec", "Invalid value: only one of `devices` or `sharedCounters` may be set"))
    slice_sets = {str(s.get("name")): s.get("counters") or {} for s in sets}
    consumed_in_slice = 0
    for i, device in enumerate(devices):
        entries = device.get("consumesCounters") or []
        field = f"spec.devices[{i}].consumesCounters"
        if minor_version >= 35 and len(entries) > _MAX_CONSUMPTIONS_PER_DEVICE:
            errors.append((field, f"Too many: {len(entries)}: must have at most {_MAX_CONSUMPTIONS_PER_DEVICE} items"))
        seen: set[str] = set()
        device_total = 0
        for j, entry in enumerate(entries):
            name = str(entry.get("counterSet") or "")
            where = f"{field}[{j}]"
            if (problem := _label_problem(name)) is not None:
                errors.append((where + ".counterSet", problem))
            elif minor_version >= 35 and name in seen:
                errors.append((where + ".counterSet", f'Duplicate value: "{name}"'))
            seen.add(name)
            used = entry.get("counters") or {}
            device_total += len(used)
            errors += _counters_errors(where + ".counters", used, _MAX_COUNTERS_PER_CONSUMPTION, minor_version)
            if minor_version == 34:
                errors += _reference_errors(where, name, used, slice_sets)
        consumed_in_slice += device_total
        if minor_version == 34 and device_total > _MAX_CONSUMED_PER_DEVICE_1_34:
            errors.append((field, f"Too many: {device_total}: must have at most {_MAX_CONSUMED_PER_DEVICE_1_34} "
                                  "counters"))
    if minor_version == 34 and consumed_in_slice > _MAX_CONSUMED_PER_SLICE_1_34:
        errors.append(("spec.devices", f"Too many: {consumed_in_slice}: the total number of consumed counters "
                                       f"must not exceed {_MAX_CONSUMED_PER_SLICE_1_34}"))
    return errors


def _set_errors(sets: list[Obj], minor_version: int) -> list[Problem]:
    errors: list[Problem] = []
    if minor_version >= 35 and len(sets) > _MAX_SETS_PER_SLICE:
        errors.append(("spec.sharedCounters", f"Too many: {len(sets)}: must have at most {_MAX_SETS_PER_SLICE} items"))
    total = 0
    names: set[str] = set()
    for i, counter_set in enumerate(sets):
        field = f"spec.sharedCounters[{i}]"
        name = str(counter_set.get("name") or "")
        if (problem := _label_problem(name)) is not None:
            errors.append((field + ".name", problem))
        elif name in names:
            errors.append((field + ".name", f'Duplicate value: "{name}"'))
        names.add(name)
        counters = counter_set.get("counters") or {}
        total += len(counters)
        errors += _counters_errors(field + ".counters", counters, _MAX_COUNTERS_PER_SET, minor_version)
        for key in counters:
            if (problem := _label_problem(key)) is not None:
                errors.append((f"{field}.counters[{key}]", problem))
    if minor_version == 34 and total > _MAX_COUNTERS_PER_SLICE_1_34:
        errors.append(("spec.sharedCounters", f"Too many: {total}: the total number of counters must not exceed "
                                              f"{_MAX_COUNTERS_PER_SLICE_1_34}"))
    return errors


def _counters_errors(where: str, counters: Obj, limit: int, minor_version: int) -> list[Problem]:
    """A counters map's own errors (a set's or a consumption's): required, and from 1.35 at most ``limit``."""
    errors: list[Problem] = [] if counters else [(where, "Required value")]
    if minor_version >= 35 and len(counters) > limit:
        errors.append((where, f"Too many: {len(counters)}: must have at most {limit} items"))
    return errors


def _reference_errors(where: str, name: str, used: Obj, slice_sets: dict[str, Obj]) -> list[Problem]:
    # The 1.34 model: a device consumes from the counter sets of its own slice.
    if name not in slice_sets:
        return [(where + ".counterSet", f'Invalid value: "{name}": must reference a counterSet defined in the '
                                         "ResourceSlice sharedCounters")]
    return [(f"{where}.counters[{key}]", f'Invalid value: "{key}": must reference a counter defined in the '
                                          f'counterSet "{name}"') for key in used if key not in slice_sets[name]]
