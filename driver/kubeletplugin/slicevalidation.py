"""Client-side checks of ResourceSlice content, before anything is sent.

The API server rejects a slice that breaks its per-field rules, and it does not check rules
that span slices (unique device names across a pool). The scheduler silently ignores a broken
pool. So a publisher checks everything here first and reports every problem at once, naming
the device and field. The rules are those of ``k8s.io/api`` resource/v1 for Kubernetes 1.34
to 1.37 (see the resource-api reference, section 2); the limits live in :mod:`.slicelimits`.

Pure functions only: no I/O, no logging.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from decimal import Decimal
from typing import Any

from driver.kubeletplugin.slicelimits import (
    MAX_ATTRIBUTE_ID_LENGTH,
    MAX_DEVICE_NAME_LENGTH,
    MAX_DRIVER_NAME_LENGTH,
    MAX_POOL_NAME_LENGTH,
    MAX_STRING_ATTRIBUTE_BYTES,
    MAX_VERSION_ATTRIBUTE_LENGTH,
    SliceLimits,
)
from driver.kubeletplugin.slicemodel import Device, DeviceAttribute

# Every pattern is used with fullmatch (``$`` would also match before a trailing newline) and
# spells digits [0-9] (``\d`` also matches non-ASCII digits such as "٣").
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
_DNS_SUBDOMAIN_MAX = 253
_C_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Semantic Versioning 2.0.0, the official grammar: no leading zeros, no "v" prefix.
_SEMVER = re.compile(
    r"(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)"
    r"(?:-((?:0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*)(?:\.(?:0|[1-9][0-9]*|[0-9]*[a-zA-Z-][0-9a-zA-Z-]*))*))?"
    r"(?:\+([0-9a-zA-Z-]+(?:\.[0-9a-zA-Z-]+)*))?"
)
# resource.Quantity: a signed decimal number, then a binary-SI, decimal-SI or exponent suffix.
_QUANTITY = re.compile(
    r"([+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E|[eE][+-]?[0-9]+)?")
_QUANTITY_SUFFIX_FACTORS: dict[str, Decimal] = {
    "": Decimal(1),
    "Ki": Decimal(2) ** 10, "Mi": Decimal(2) ** 20, "Gi": Decimal(2) ** 30,
    "Ti": Decimal(2) ** 40, "Pi": Decimal(2) ** 50, "Ei": Decimal(2) ** 60,
    "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
    "k": Decimal("1e3"), "M": Decimal("1e6"), "G": Decimal("1e9"),
    "T": Decimal("1e12"), "P": Decimal("1e15"), "E": Decimal("1e18"),
}
# Label names (taint keys): an optional DNS-subdomain prefix and "/", then a name part.
_LABEL_NAME_PART = re.compile(r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]")
_LABEL_NAME_PART_MAX = 63
_LABEL_VALUE_MAX = 63


def is_dns_label(value: str) -> bool:
    return len(value) <= MAX_DEVICE_NAME_LENGTH and _DNS_LABEL.fullmatch(value) is not None


def is_dns_subdomain(value: str) -> bool:
    return len(value) <= _DNS_SUBDOMAIN_MAX and _DNS_SUBDOMAIN.fullmatch(value) is not None


def quantity_value(text: str) -> Decimal | None:
    """The numeric value of a Kubernetes quantity string, or None if it is not one."""
    match = _QUANTITY.fullmatch(text)
    if match is None:
        return None
    number, suffix = match.group(1), match.group(2) or ""
    try:
        if suffix[:1] in ("e", "E"):
            return Decimal(number) * (Decimal(10) ** int(suffix[1:]))
        return Decimal(number) * _QUANTITY_SUFFIX_FACTORS[suffix]
    except (ArithmeticError, ValueError):
        # decimal.Overflow for "1E9999999"; ValueError for an exponent too long for int().
        return None


def validate_driver_and_pool(driver_name: str, pool_name: str) -> list[str]:
    """Problems with ``spec.driver`` and ``spec.pool.name``; empty when both are valid."""
    problems: list[str] = []
    if not driver_name:
        problems.append("driver name is required")
    elif len(driver_name) > MAX_DRIVER_NAME_LENGTH:
        problems.append(
            f'driver name "{driver_name}" is {len(driver_name)} characters, the limit is {MAX_DRIVER_NAME_LENGTH}')
    elif not is_dns_subdomain(driver_name.lower()):
        problems.append(f'driver name "{driver_name}" must be a DNS subdomain (e.g. "gpu.example.com")')
    if not pool_name:
        problems.append("pool name is required")
    elif len(pool_name) > MAX_POOL_NAME_LENGTH:
        problems.append(f'pool name "{pool_name}" is {len(pool_name)} characters, the limit is {MAX_POOL_NAME_LENGTH}')
    else:
        for part in pool_name.split("/"):
            if not is_dns_subdomain(part):
                problems.append(
                    f'pool name "{pool_name}": part "{part}" must be a DNS subdomain '
                    "(lower-case alphanumerics, '-' and '.')")
    return problems


def validate_devices(devices: Sequence[Device], driver_name: str, limits: SliceLimits) -> list[str]:
    """Every problem that would make the API server reject, or the scheduler ignore, the pool."""
    problems: list[str] = []
    first_index_of: dict[str, int] = {}
    for index, device in enumerate(devices):
        if not device.name:
            problems.append(f"device at index {index}: name is required")
            continue
        label = f'device "{device.name}"'
        if not is_dns_label(device.name):
            problems.append(
                f"{label}: name must be a DNS label (at most 63 lower-case alphanumerics or '-', "
                "starting and ending with an alphanumeric)")
        if device.name in first_index_of:
            problems.append(
                f"{label}: name is used more than once in the pool (indexes {first_index_of[device.name]} and {index})")
        else:
            first_index_of[device.name] = index
        problems.extend(f"{label}: {p}" for p in _device_problems(device, driver_name, limits))
    return problems


def _device_problems(device: Device, driver_name: str, limits: SliceLimits) -> list[str]:
    problems: list[str] = []
    count = len(device.attributes) + len(device.capacity)
    if count > limits.max_attributes_and_capacities:
        problems.append(
            f"has {count} attributes and capacities, the limit is {limits.max_attributes_and_capacities}")
    problems.extend(_duplicate_qualified_names("attribute", device.attributes, driver_name))
    problems.extend(_duplicate_qualified_names("capacity", device.capacity, driver_name))
    for key, attribute in device.attributes.items():
        problems.extend(f'attribute "{key}": {p}' for p in _qualified_name_problems(key))
        problems.extend(f'attribute "{key}": {p}' for p in _attribute_value_problems(attribute))
    for key, capacity in device.capacity.items():
        problems.extend(f'capacity "{key}": {p}' for p in _qualified_name_problems(key))
        if quantity_value(capacity.value) is None:
            problems.append(
                f'capacity "{key}": value "{capacity.value}" is not a Kubernetes quantity '
                '(expected e.g. "80Gi", "132", "1.5", "500m")')
    if len(device.taints) > limits.max_taints_per_device:
        problems.append(
            f"has {len(device.taints)} taints, the limit is {limits.max_taints_per_device} "
            f"on Kubernetes 1.{limits.minor_version}")
    for position, taint in enumerate(device.taints):
        where = f"taint {position}"
        problems.extend(f"{where}: key {p}" for p in _label_name_problems(taint.key))
        if taint.value is not None and not _is_label_value(taint.value):
            problems.append(
                f'{where}: value "{taint.value}" must be a label value (at most 63 alphanumerics, '
                "'-', '_' or '.', starting and ending with an alphanumeric)")
        if taint.effect not in limits.taint_effects:
            problems.append(
                f'{where}: effect "{taint.effect}" is not one of {", ".join(limits.taint_effects)} '
                f"(Kubernetes 1.{limits.minor_version})")
    return problems


def _qualified_name_problems(key: str) -> list[str]:
    """A ``QualifiedName``: ``<id>`` or ``<domain>/<id>``."""
    parts = key.split("/")
    if len(parts) > 2:
        return ["name must be <id> or <domain>/<id>; it contains more than one '/'"]
    problems: list[str] = []
    if len(parts) == 2:
        domain, identifier = parts
        if not domain:
            problems.append("domain before '/' is empty")
        elif len(domain) > MAX_DRIVER_NAME_LENGTH:
            problems.append(f"domain is {len(domain)} characters, the limit is {MAX_DRIVER_NAME_LENGTH}")
        elif not is_dns_subdomain(domain.lower()):
            problems.append(f'domain "{domain}" must be a DNS subdomain')
    else:
        identifier = parts[0]
    if not identifier:
        problems.append("name is empty")
    elif len(identifier) > MAX_ATTRIBUTE_ID_LENGTH:
        problems.append(
            f'identifier "{identifier}" is {len(identifier)} characters, the limit is {MAX_ATTRIBUTE_ID_LENGTH}')
    elif not _C_IDENTIFIER.fullmatch(identifier):
        problems.append(
            f'identifier "{identifier}" must be a C identifier (letters, digits and \'_\', not starting with a digit)')
    return problems


def _duplicate_qualified_names(kind: str, keys: dict[str, Any], driver_name: str) -> list[str]:
    # An unqualified name lives in the driver's domain, so "memory" and "<driver>/memory" are
    # the same name to CEL; publishing both makes selectors ambiguous.
    prefix = driver_name + "/"
    return [
        f'{kind} "{key}" duplicates "{key[len(prefix):]}" (an unqualified name is in the driver\'s domain)'
        for key in keys
        if key.startswith(prefix) and key[len(prefix):] in keys
    ]


def _attribute_value_problems(attribute: DeviceAttribute) -> list[str]:
    if attribute.string is not None:
        size = len(attribute.string.encode("utf-8"))
        if size > MAX_STRING_ATTRIBUTE_BYTES:
            return [f"string value is {size} bytes, the limit is {MAX_STRING_ATTRIBUTE_BYTES}"]
    if attribute.version is not None:
        if len(attribute.version) > MAX_VERSION_ATTRIBUTE_LENGTH:
            return [f"version value is {len(attribute.version)} characters, "
                    f"the limit is {MAX_VERSION_ATTRIBUTE_LENGTH}"]
        if not _SEMVER.fullmatch(attribute.version):
            return [
                f'version value "{attribute.version}" is not strict semantic versioning 2.0.0 '
                '(MAJOR.MINOR.PATCH, no leading zeros, no "v"; e.g. "580.95.5")']
    return []


def _label_name_problems(key: str) -> list[str]:
    if not key:
        return ["is required"]
    prefix, _, name = key.rpartition("/")
    problems: list[str] = []
    if "/" in key and not is_dns_subdomain(prefix):
        problems.append(f'"{key}": prefix "{prefix}" must be a DNS subdomain')
    if len(name) > _LABEL_NAME_PART_MAX or not _LABEL_NAME_PART.fullmatch(name):
        problems.append(
            f'"{key}": name part must be at most 63 alphanumerics, \'-\', \'_\' or \'.\', '
            "starting and ending with an alphanumeric")
    return problems


def _is_label_value(value: str) -> bool:
    return value == "" or (len(value) <= _LABEL_VALUE_MAX and _LABEL_NAME_PART.fullmatch(value) is not None)
