"""CDI spec versions: the minimum-version table of the reference loader, and declared-version checks."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from cdi import (
    VALID_VERSIONS,
    ContainerEdits,
    Device,
    Spec,
    SpecError,
    is_valid_version,
    minimum_version,
    minimum_version_reason,
    version_at_least,
    with_minimum_version,
)

Wire = dict[str, Any]


def typical_wire() -> Wire:
    """env + a mount without type + a node without hostPath, names starting with a letter: 0.3.0."""
    return {
        "cdiVersion": "1.1.0",
        "kind": "k8s.gpu.tessera.dev/claim",
        "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"], "deviceNodes": [{"path": "/dev/nvidiactl"}]},
        "devices": [
            {
                "name": "gpu-0",
                "containerEdits": {
                    "deviceNodes": [{"path": "/dev/nvidia0"}],
                    "mounts": [{"hostPath": "/a", "containerPath": "/b", "options": ["ro", "rbind"]}],
                },
            }
        ],
    }


def device_edits(wire: Wire) -> Wire:
    result: Wire = wire["devices"][0]["containerEdits"]
    return result


def spec_edits(wire: Wire) -> Wire:
    result: Wire = wire["containerEdits"]
    return result


MINIMUM_CASES: list[tuple[str, Callable[[Wire], object], str]] = [
    ("typical content", lambda w: None, "0.3.0"),
    ("device mount type", lambda w: device_edits(w)["mounts"][0].update(type="bind"), "0.4.0"),
    (
        "spec mount type",
        lambda w: spec_edits(w).update(mounts=[{"hostPath": "/s", "containerPath": "/s", "type": "bind"}]),
        "0.4.0",
    ),
    ("claim-UID device name", lambda w: w["devices"][0].update(name="6f1c2d1e-8d0a-gpu-0"), "0.5.0"),
    ("device node hostPath", lambda w: device_edits(w)["deviceNodes"][0].update(hostPath="/dev/nvidia0"), "0.5.0"),
    ("spec node hostPath", lambda w: spec_edits(w)["deviceNodes"][0].update(hostPath="/dev/nvidiactl"), "0.5.0"),
    ("spec annotations", lambda w: w.update(annotations={"tessera.dev/claim": "x"}), "0.6.0"),
    ("device annotations", lambda w: w["devices"][0].update(annotations={"tessera.dev/claim": "x"}), "0.6.0"),
    ("dot in class", lambda w: w.update(kind="k8s.gpu.nvidia.com/claim.v2"), "0.6.0"),
    ("device additionalGids", lambda w: device_edits(w).update(additionalGids=[44]), "0.7.0"),
    ("spec additionalGids", lambda w: spec_edits(w).update(additionalGids=[44]), "0.7.0"),
    ("empty intelRdt", lambda w: device_edits(w).update(intelRdt={}), "0.7.0"),
    ("intelRdt closID only", lambda w: spec_edits(w).update(intelRdt={"closID": "gold"}), "0.7.0"),
    ("monitoring off", lambda w: spec_edits(w).update(intelRdt={"enableMonitoring": False}), "0.7.0"),
    (
        "device netDevices",
        lambda w: device_edits(w).update(netDevices=[{"hostInterfaceName": "eth1", "name": "net1"}]),
        "1.1.0",
    ),
    (
        "spec netDevices",
        lambda w: spec_edits(w).update(netDevices=[{"hostInterfaceName": "eth1", "name": "net1"}]),
        "1.1.0",
    ),
    ("empty schemata", lambda w: device_edits(w).update(intelRdt={"schemata": []}), "1.1.0"),
    ("monitoring on", lambda w: spec_edits(w).update(intelRdt={"enableMonitoring": True}), "1.1.0"),
]


@pytest.mark.parametrize(
    ("mutate", "expected"), [(m, e) for _, m, e in MINIMUM_CASES], ids=[c[0] for c in MINIMUM_CASES]
)
def test_minimum_version(mutate: Callable[[Wire], object], expected: str) -> None:
    wire = typical_wire()
    mutate(wire)

    assert minimum_version(Spec.from_wire(wire)) == expected


def test_empty_device_lists_force_nothing() -> None:
    wire = typical_wire()
    spec_edits(wire).update(netDevices=[], additionalGids=[])
    wire["annotations"] = {}

    assert minimum_version(Spec.from_wire(wire)) == "0.3.0"


def test_newest_requirement_wins() -> None:
    wire = typical_wire()
    device_edits(wire)["mounts"][0]["type"] = "bind"
    wire["devices"][0]["name"] = "0-gpu"
    spec_edits(wire)["additionalGids"] = [44]

    assert minimum_version_reason(Spec.from_wire(wire)) == ("0.7.0", "containerEdits.additionalGids is set")


def test_reason_names_what_forces_the_version() -> None:
    wire = typical_wire()
    wire["devices"][0]["name"] = "6f1c-gpu-0"

    assert minimum_version_reason(Spec.from_wire(wire)) == ("0.5.0", 'devices[0].name "6f1c-gpu-0" starts with a digit')


def test_declared_version_older_than_minimum_is_rejected() -> None:
    wire = typical_wire()
    wire["devices"][0]["name"] = "6f1c-gpu-0"
    wire["cdiVersion"] = "0.4.0"

    with pytest.raises(SpecError) as caught:
        Spec.from_wire(wire)

    assert caught.value.problems == (
        'cdiVersion: "0.4.0" is older than 0.5.0, required because devices[0].name "6f1c-gpu-0" starts with a digit',
    )


@pytest.mark.parametrize("declared", ["0.5.0", "v0.5.0", "0.8.0", "1.0.0", "1.1.0"])
def test_declared_version_at_or_above_minimum_is_accepted(declared: str) -> None:
    wire = typical_wire()
    wire["devices"][0]["name"] = "6f1c-gpu-0"
    wire["cdiVersion"] = declared

    assert Spec.from_wire(wire).cdi_version == declared


@pytest.mark.parametrize("declared", ["0.1.0", "0.2.0"])
def test_versions_below_the_floor_always_fail(declared: str) -> None:
    wire = typical_wire()
    wire["cdiVersion"] = declared

    with pytest.raises(SpecError, match=f'cdiVersion: "{declared}" is older than 0.3.0'):
        Spec.from_wire(wire)


@pytest.mark.parametrize("declared", ["1.0.1", "0.5.4", "vv0.3.0", "", "0.3", "1.2.0", "V0.3.0"])
def test_unknown_versions_are_rejected(declared: str) -> None:
    wire = typical_wire()
    wire["cdiVersion"] = declared

    with pytest.raises(SpecError, match="is not a CDI spec version"):
        Spec.from_wire(wire)


def test_valid_versions() -> None:
    assert VALID_VERSIONS == ("0.1.0", "0.2.0", "0.3.0", "0.4.0", "0.5.0", "0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
    assert is_valid_version("v1.1.0")
    assert not is_valid_version("1.0.1")


def test_version_at_least() -> None:
    assert version_at_least("v0.5.0", "0.5.0")
    assert version_at_least("1.0.0", "0.7.0")
    assert not version_at_least("0.4.0", "0.5.0")
    with pytest.raises(ValueError, match="not a CDI spec version"):
        version_at_least("0.5.4", "0.3.0")


def test_with_minimum_version_declares_exactly_the_minimum() -> None:
    wire = typical_wire()
    device_edits(wire)["mounts"][0]["type"] = "bind"
    spec = Spec.from_wire(wire)

    lowered = with_minimum_version(spec)

    assert spec.cdi_version == "1.1.0"
    assert lowered.cdi_version == "0.4.0"
    assert lowered.model_copy(update={"cdi_version": "1.1.0"}) == spec
    assert with_minimum_version(lowered) == lowered
    assert Spec.from_text(lowered.to_json()) == lowered


def test_build_writes_the_minimum() -> None:
    device = Device(name="6f1c-gpu-0", container_edits=ContainerEdits(env=["A=1"]))

    spec = Spec.build("k8s.gpu.tessera.dev/claim", [device], container_edits=ContainerEdits(additional_gids=[44]))

    assert spec.cdi_version == "0.7.0"
