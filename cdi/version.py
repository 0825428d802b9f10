"""CDI spec versions and the minimum-version rule of the reference Go loader.

Runtimes ignore a whole spec file whose declared ``cdiVersion`` is unknown to them or older than
the minimum its content needs, and a runtime vendoring an older CDI library rejects versions newer
than it knows. So a producer should declare exactly the computed minimum: ``cdi.spec.with_minimum_version``.
The rule reads a spec's parts (:mod:`cdi.edits`), so the spec model (:mod:`cdi.spec`) can apply it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from cdi.edits import ContainerEdits, Device

# Oldest first. Library release tags (v0.5.4, v1.0.1, ...) are not spec versions.
VALID_VERSIONS: tuple[str, ...] = (
    "0.1.0",
    "0.2.0",
    "0.3.0",
    "0.4.0",
    "0.5.0",
    "0.6.0",
    "0.7.0",
    "0.8.0",
    "1.0.0",
    "1.1.0",
)
LATEST_VERSION = VALID_VERSIONS[-1]
# The loader never computes a minimum below this, so declaring 0.1.0 or 0.2.0 always fails.
FLOOR_VERSION = "0.3.0"


def normalize_version(version: str) -> str | None:
    """The version without its optional single leading 'v', or None when it is not a spec version."""
    bare = version[1:] if version.startswith("v") else version
    return bare if bare in VALID_VERSIONS else None


def is_valid_version(version: str) -> bool:
    return normalize_version(version) is not None


def version_at_least(version: str, minimum: str) -> bool:
    """Whether ``version`` is the same as or newer than ``minimum``; both must be valid spec versions."""
    bare, bare_minimum = normalize_version(version), normalize_version(minimum)
    if bare is None or bare_minimum is None:
        raise ValueError(f"not a CDI spec version: {version!r} / {minimum!r} (expected one of {VALID_VERSIONS})")
    return VALID_VERSIONS.index(bare) >= VALID_VERSIONS.index(bare_minimum)


@dataclass(frozen=True)
class _Content:
    """What a spec holds, apart from its declared version."""

    kind: str
    annotations: Mapping[str, str]
    devices: Sequence[Device]
    container_edits: ContainerEdits


def content_minimum(*, kind: str, annotations: Mapping[str, str], devices: Sequence[Device],
                    container_edits: ContainerEdits) -> tuple[str, str]:
    """The oldest ``cdiVersion`` the loader accepts for this content (section 1.1 of the CDI reference), and
    which part of it forces that version, for error messages."""
    content = _Content(kind, annotations, devices, container_edits)
    for version, needs in _RULES:
        reason = needs(content)
        if reason is not None:
            return version, reason
    return FLOOR_VERSION, f"{FLOOR_VERSION} is the oldest version the loader accepts"


def _edits_with_paths(content: _Content) -> list[tuple[str, ContainerEdits]]:
    spec_level = [("containerEdits", content.container_edits)]
    return spec_level + [(f"devices[{i}].containerEdits", d.container_edits) for i, d in enumerate(content.devices)]


def _needs_1_1_0(content: _Content) -> str | None:
    for where, edits in _edits_with_paths(content):
        if edits.net_devices:
            return f"{where}.netDevices is set"
        rdt = edits.intel_rdt
        # Go tests the slice against nil, so an empty 'schemata: []' counts as present.
        if rdt is not None and rdt.schemata is not None:
            return f"{where}.intelRdt.schemata is present"
        if rdt is not None and rdt.enable_monitoring:
            return f"{where}.intelRdt.enableMonitoring is true"
    return None


def _needs_0_7_0(content: _Content) -> str | None:
    for where, edits in _edits_with_paths(content):
        if edits.intel_rdt is not None:
            return f"{where}.intelRdt is present"
        if edits.additional_gids:
            return f"{where}.additionalGids is set"
    return None


def _needs_0_6_0(content: _Content) -> str | None:
    if content.annotations:
        return "annotations is set"
    for i, device in enumerate(content.devices):
        if device.annotations:
            return f"devices[{i}].annotations is set"
    if "." in content.kind.partition("/")[2]:
        return f'the class part of kind "{content.kind}" contains "."'
    return None


def _needs_0_5_0(content: _Content) -> str | None:
    for i, device in enumerate(content.devices):
        # ASCII digits only, exactly as the Go byte comparison.
        if device.name[:1] in tuple("0123456789"):
            return f'devices[{i}].name "{device.name}" starts with a digit'
    for where, edits in _edits_with_paths(content):
        for j, node in enumerate(edits.device_nodes):
            if node.host_path:
                return f"{where}.deviceNodes[{j}].hostPath is set"
    return None


def _needs_0_4_0(content: _Content) -> str | None:
    for where, edits in _edits_with_paths(content):
        for j, mount in enumerate(edits.mounts):
            if mount.type:
                return f"{where}.mounts[{j}].type is set"
    return None


# Newest first: the first version whose predicate holds is the minimum. 0.8.0 and 1.0.0 changed
# only the Go API, so nothing in a file forces them.
_RULES: tuple[tuple[str, Callable[[_Content], str | None]], ...] = (
    ("1.1.0", _needs_1_1_0),
    ("0.7.0", _needs_0_7_0),
    ("0.6.0", _needs_0_6_0),
    ("0.5.0", _needs_0_5_0),
    ("0.4.0", _needs_0_4_0),
)
