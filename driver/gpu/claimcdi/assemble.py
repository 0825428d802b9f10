"""Assemble the per-claim CDI spec (pure: no file or device access).

One spec file per claim, kind ``k8s.gpu.tessera.dev/claim``, one CDI device per allocated
device named ``<claimUID>-<device>``. Spec-level edits (applied once per container however many
of the claim's devices it gets) hold what every GPU container needs: the NVIDIA Container
Toolkit's common edits (driver libraries, binaries, hooks) and the control device nodes.
Device-level edits hold what is specific to one device: its ``/dev/nvidiaN`` node, MIG
capability nodes, and MPS client settings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import cdi

# Stops a legacy nvidia-container-runtime hook from adding every GPU to the container (CUDA
# images set NVIDIA_VISIBLE_DEVICES=all); which GPUs a container sees is CDI's job.
VISIBLE_DEVICES_VOID = "NVIDIA_VISIBLE_DEVICES=void"


@dataclass(frozen=True)
class ClaimIdentity:
    uid: str
    namespace: str
    name: str


@dataclass(frozen=True)
class DeviceEdits:
    """What one allocated device adds to a container, in CDI wire form."""

    device_name: str  # e.g. "gpu-0", "gpu-1-mig-1g10gb-0"
    device_nodes: list[dict[str, Any]] = field(default_factory=list)
    env: list[str] = field(default_factory=list)
    mounts: list[dict[str, Any]] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)
    hooks: list[dict[str, Any]] = field(default_factory=list)


def cdi_device_name(claim_uid: str, device_name: str) -> str:
    return f"{claim_uid}-{device_name}"


@dataclass(frozen=True)
class ClaimSpecFile:
    """A claim's spec, checked, and the exact JSON text to write for it."""

    spec: cdi.Spec
    text: str


def build_claim_spec_file(
    *,
    kind: str,
    claim: ClaimIdentity,
    devices: list[DeviceEdits],
    common_edits: dict[str, Any] | None,
    control_nodes: list[dict[str, Any]],
    annotation_prefix: str,
    annotations: dict[str, str] | None = None,
) -> ClaimSpecFile:
    """The claim's spec with ``cdiVersion`` set to the minimum its content needs, and its file text.

    The wire form is validated once by the strict models (exactly the data that is then written,
    only ``cdiVersion`` lowered to the minimum the validated content needs) and written as it is:
    no model dump and no second parse on the prepare path. It loads as the same spec as the
    model's own ``to_json`` (tests/unit/gpu/claimcdi/test_claimcdi_assemble.py checks both).

    ``common_edits`` is the toolkit spec's spec-level ``containerEdits`` in wire form, or None
    when the node has no toolkit spec; ``control_nodes`` are CDI device nodes (``path``, and
    ``hostPath`` where the node is elsewhere on the host) of control devices that exist. A node the
    toolkit's edits already list is kept as the toolkit wrote it.
    """
    spec_edits: dict[str, Any] = dict(common_edits or {})
    env = [e for e in spec_edits.get("env", []) if not e.startswith("NVIDIA_VISIBLE_DEVICES=")]
    spec_edits["env"] = [VISIBLE_DEVICES_VOID, *env]
    nodes = list(spec_edits.get("deviceNodes", []))
    present = {n["path"] for n in nodes}
    nodes.extend(dict(n) for n in control_nodes if n["path"] not in present)
    if nodes:
        spec_edits["deviceNodes"] = nodes

    spec_annotations = {
        f"{annotation_prefix}/claim": f"{claim.namespace}/{claim.name}",
        f"{annotation_prefix}/claim-uid": claim.uid,
        **(annotations or {}),
    }
    wire: dict[str, Any] = {
        "cdiVersion": cdi.VALID_VERSIONS[-1],
        "kind": kind,
        "annotations": dict(sorted(spec_annotations.items())),
        "containerEdits": spec_edits,
        "devices": [_device_wire(claim.uid, d) for d in devices],
    }
    spec = cdi.with_minimum_version(cdi.Spec.from_wire(wire, f"claim {claim.uid}"))
    wire["cdiVersion"] = spec.cdi_version
    # Compact: json's C encoder serves only text without indentation, and the indenting Python encoder
    # cost several times more per prepare than the rest of the spec (docs/benchmarks.md); `jq .` reads it.
    return ClaimSpecFile(spec, json.dumps(wire, ensure_ascii=False) + "\n")


def _device_wire(claim_uid: str, device: DeviceEdits) -> dict[str, Any]:
    edits: dict[str, Any] = {}
    if device.env:
        edits["env"] = list(device.env)
    if device.device_nodes:
        edits["deviceNodes"] = list(device.device_nodes)
    if device.mounts:
        edits["mounts"] = list(device.mounts)
    if device.hooks:
        edits["hooks"] = list(device.hooks)
    wire: dict[str, Any] = {"name": cdi_device_name(claim_uid, device.device_name), "containerEdits": edits}
    if device.annotations:
        wire["annotations"] = dict(sorted(device.annotations.items()))
    return wire
