"""SIMULATION: the API server's rules for consumable capacity (KEP-5075), for the API server double.

A server without ``DRAConsumableCapacity`` (1.34/1.35 unless the gate is set) drops
``allowMultipleAllocations`` and capacity ``requestPolicy`` silently, as a real one drops any
field of a disabled gate (resource-api reference 5.6). One with it validates the policies:
``requestPolicy`` only on ``allowMultipleAllocations`` devices; ``validValues`` or ``validRange``,
not both, with ``default``; ``min <= value``, ``min <= default <= max <= value``, ``step > 0``,
``min + step <= value``, ``default`` and ``max`` on the step grid (resource-api reference 2.2,
whole units, as before 1.37's fractional ranges).
"""

from __future__ import annotations

from typing import Any

from driver.gpu.claimconfig.quantity import parse_quantity

Obj = dict[str, Any]
Problem = tuple[str, str]


def consumable_enabled(minor_version: int, gate: bool) -> bool:
    return minor_version >= 36 or gate


def strip_consumable(device: Obj) -> None:
    """What a server with the gate off stores of ``device``."""
    device.pop("allowMultipleAllocations", None)
    for capacity in (device.get("capacity") or {}).values():
        if isinstance(capacity, dict):
            capacity.pop("requestPolicy", None)


def request_policy_errors(device: Obj, field: str) -> list[Problem]:
    errors: list[Problem] = []
    multiple = device.get("allowMultipleAllocations") is True
    for key, capacity in (device.get("capacity") or {}).items():
        policy = capacity.get("requestPolicy") if isinstance(capacity, dict) else None
        if policy is None:
            continue
        where = f"{field}.capacity[{key}].requestPolicy"
        if not multiple:
            errors.append((where, "Forbidden: only allowed when allowMultipleAllocations is true"))
            continue
        try:
            errors.extend(_policy_errors(policy, parse_quantity(str(capacity.get("value", "")), "value"), where))
        except ValueError as exc:
            errors.append((where, f"Invalid value: {exc}"))
    return errors


def _policy_errors(policy: Obj, value: int, where: str) -> list[Problem]:
    valid_range, valid_values = policy.get("validRange"), policy.get("validValues")
    if valid_range is not None and valid_values is not None:
        return [(where, "Invalid value: validValues and validRange are mutually exclusive")]
    if "default" not in policy:
        return [(where + ".default", "Required value")] if valid_range or valid_values else []
    default = parse_quantity(str(policy["default"]), "default")
    if valid_values is not None:
        values = [parse_quantity(str(v), "validValues") for v in valid_values]
        errors = []
        if len(values) > 10 or values != sorted(set(values)) or (values and values[-1] > value):
            errors.append((where + ".validValues", "Invalid value: at most 10, ascending, each <= the capacity"))
        if default not in values:
            errors.append((where + ".default", "Invalid value: must be one of validValues"))
        return errors
    if valid_range is None:
        return []
    if "min" not in valid_range:
        return [(where + ".validRange.min", "Required value")]
    low = parse_quantity(str(valid_range["min"]), "min")
    high = parse_quantity(str(valid_range["max"]), "max") if "max" in valid_range else value
    step = parse_quantity(str(valid_range["step"]), "step") if "step" in valid_range else None
    errors = []
    if low > value:
        errors.append((where + ".validRange.min", "Invalid value: must be less than or equal to the capacity"))
    if high > value or high < low:
        errors.append((where + ".validRange.max", "Invalid value: must be between min and the capacity"))
    if not low <= default <= high:
        errors.append((where + ".default", "Invalid value: must be between min and max"))
    if step is not None:
        if step <= 0 or low + step > value:
            errors.append((where + ".validRange.step", "Invalid value: must be > 0 and min + step <= the capacity"))
        else:
            if (default - low) % step:
                errors.append((where + ".default", "Invalid value: must be min plus a multiple of step"))
            if "max" in valid_range and (high - low) % step:
                errors.append((where + ".validRange.max", "Invalid value: must be min plus a multiple of step"))
    return errors
