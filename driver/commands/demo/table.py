"""The demo's table of published devices (SIMULATION): one row per device, in one memory unit.

Memory is shown in MiB for every row (whole GPUs, MIG devices and shares alike), so rows compare at
a glance; the published quantities themselves are unchanged (``examples/resourceclaims/README.md``
explains the units a claim's selector should use).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from driver.gpu.claimconfig.choices import DeviceKind
from driver.gpu.claimconfig.quantity import parse_quantity
from driver.units import MIB


def attr(device: dict[str, Any], key: str) -> str:
    value = device.get("attributes", {}).get(key)
    return str(next(iter(value.values()))) if value else ""


def mebibytes(quantity: str) -> str:
    """``quantity`` in MiB (``16Gi`` -> ``16384Mi``); as given when it is not a whole number of MiB."""
    if not quantity:
        return ""
    try:
        size = parse_quantity(quantity, "memory")
    except ValueError:
        return quantity
    return f"{size // MIB}Mi" if size % MIB == 0 else quantity


def _range(capacity: dict[str, Any], unit: Callable[[str], str]) -> str:
    policy = capacity.get("requestPolicy") or {}
    valid = policy.get("validRange") or {}
    if not valid:
        return unit(capacity.get("value", ""))
    return f"{unit(valid.get('min', '?'))}-{unit(valid.get('max', capacity.get('value', '?')))} " \
           f"step {unit(valid.get('step', '?'))}"


def details(device: dict[str, Any]) -> str:
    kind = attr(device, "type")
    if kind in (DeviceKind.MPS, DeviceKind.TIMESLICE):
        threads = attr(device, "activeThreadPercentage")
        # Time-sliced shares have no SM limit: no threads column rather than "threads=-%".
        return " ".join(part for part in (
            f"share {attr(device, 'shareIndex')}/{attr(device, 'shareCount')}",
            f"threads={threads}%" if threads else "",
            f"memory-enforcement={attr(device, 'memoryLimitEnforcement')}") if part)
    if kind == DeviceKind.CONSUMABLE:
        capacity = device.get("capacity", {})
        return (f"each claim takes memory {_range(capacity.get('memory', {}), mebibytes)}, SMs "
                f"{_range(capacity.get('multiprocessors', {}), str)}; "
                f"memory-enforcement={attr(device, 'memoryLimitEnforcement')}")
    if kind == DeviceKind.GPU:
        return f"uuid={attr(device, 'uuid')}"
    if kind == DeviceKind.MIG:
        return f"parent={attr(device, 'parentUUID')}"
    return ""


def print_slices(slices: list[dict[str, Any]], say: Callable[[str], None]) -> None:
    for s in slices:
        spec = s["spec"]
        say(f"ResourceSlice {s['metadata']['name']}  driver={spec['driver']}  pool={spec['pool']['name']} "
            f"generation={spec['pool']['generation']}  devices={len(spec.get('devices', []))}")
        if not spec.get("devices") and spec.get("sharedCounters"):
            # Kubernetes 1.35+ wants counter sets in a slice of their own, without devices.
            for counter_set in spec["sharedCounters"]:
                say(f"  counter set {counter_set['name']}: {len(counter_set.get('counters', {}))} counters that the "
                    "dynamic MIG devices of the other slices consume")
            continue
        say(f"  {'DEVICE':<24} {'TYPE':<10} {'PRODUCT / PROFILE':<28} {'MEMORY':<10} DETAILS")
        for d in spec.get("devices", []):
            kind = attr(d, "type")
            what = attr(d, "profile") if kind == DeviceKind.MIG else attr(d, "productName")
            memory = mebibytes(d.get("capacity", {}).get("memory", {}).get("value", ""))
            say(f"  {d['name']:<24} {kind:<10} {what:<28} {memory:<10} {details(d)}")
