"""Dynamic MIG published by the real driver process to the API server double, at Kubernetes 1.34, 1.35
and 1.36: the layout each release needs (combined, split), valid against each release's strict schema
and the double's rules, the GPUs that cannot be dynamic published as before with the reason logged,
and the simulated allocator placing claims by the published counters.

The simulated node is a layout file written here (an H100 in MIG mode with no instances, an H100 with
someone else's 1g.10gb, an L4, an H100 with MIG off); its MIG profiles come from the simulated
discovery's profile tables.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from driver.simulation.allocator import AllocationError, allocate
from driver.simulation.counterrules import partitionable_enabled
from tests.support.node import DRIVER, NODE, SimulatedNode, wait_until

LAYOUT = """\
description: dynamic MIG publishing
gpus:
  - {model: H100-80GB, mig: []}
  - model: H100-80GB
    mig: [{profile: 1g.10gb, start: 0}]
  - {model: L4}
  - {model: H100-80GB}
"""
PROFILES = ["1g.10gb", "3g.40gb", "4g.40gb", "7g.80gb"]
# gpu-0's devices in publishing order: its whole device, then its placements profile by profile in the
# order the GPU lists its profiles (the simulation lists them by GI profile id: 7g, 4g, 3g, 1g).
DYNAMIC = ["gpu-0", "gpu-0-dynmig-7g80gb-0", "gpu-0-dynmig-4g40gb-0", "gpu-0-dynmig-3g40gb-0", "gpu-0-dynmig-3g40gb-4",
           *(f"gpu-0-dynmig-1g10gb-{s}" for s in range(7))]
OTHERS = ["gpu-1-mig-1g10gb-0", "gpu-2", "gpu-3"]
REASONS = [
    "gpu-1 (NVIDIA H100 80GB HBM3): has MIG instances Tessera did not create (1g.10gb@0), published as those MIG "
    "devices",
    "gpu-2 (NVIDIA L4): no MIG support, published as a whole GPU",
    "gpu-3 (NVIDIA H100 80GB HBM3): MIG mode is off",
]


@pytest.fixture
def layout() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="tdm-", dir="/tmp")) / "node.yaml"
    path.write_text(LAYOUT)
    yield path
    path.unlink()
    path.parent.rmdir()


def started(layout: Path, minor: int, gate: bool) -> SimulatedNode:
    plans = {"defaultPlan": "p", "partitionableDevicesGate": gate,
             "plans": {"p": {"gpus": [{"match": {"all": True}, "dynamicMig": {"profiles": PROFILES}}]}}}
    sim_node = SimulatedNode(str(layout), plans=plans, minor_version=minor)
    # SIMULATION: the API server's (and scheduler's) DRAPartitionableDevices gate, as the plan says.
    sim_node.api.partitionable_devices = partitionable_enabled(minor, gate)
    sim_node.start()
    return sim_node


def warnings(sim_node: SimulatedNode) -> list[str]:
    return [str(e.get("msg")) for e in sim_node.log() if e.get("level") in ("WARNING", "warning")]


def shape(slices: list[dict[str, Any]]) -> list[tuple[list[str], list[str]]]:
    """(device names, counter set names) of each slice, in slice-name order (the publishing order)."""
    return [([d["name"] for d in s["spec"].get("devices", [])],
             [c["name"] for c in s["spec"].get("sharedCounters", [])]) for s in slices]


@pytest.mark.parametrize("minor", [34, 35, 36])
def test_published_in_the_layout_of_the_release(layout: Path, minor: int) -> None:
    sim_node = started(layout, minor, gate=minor < 36)
    try:
        sim_node.wait_for_devices(DYNAMIC + OTHERS)
        slices = sim_node.api.slices(DRIVER, NODE)
        for s in slices:
            kubernetes_validate.validate(s, f"1.{minor}", strict=True)
        pools = {(s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"]) for s in slices}
        assert len(pools) == 1 and next(iter(pools))[1] == len(slices)
        if minor == 34:  # combined: devices that consume nothing, then the GPU's counter set with its devices
            assert shape(slices) == [(OTHERS, []), (DYNAMIC, ["gpu-0-counter-set"])]
        else:  # split: the counter set alone, then every device in minor order
            assert shape(slices) == [([], ["gpu-0-counter-set"]), (DYNAMIC + OTHERS, [])]
        devices = {d["name"]: d for d in sim_node.devices()}
        [counter_set] = [c for s in slices for c in s["spec"].get("sharedCounters", [])]
        assert counter_set["counters"]["memory-slice-7"] == {"value": "1"}
        assert devices["gpu-0"]["consumesCounters"][0]["counters"] == counter_set["counters"]
        three = devices["gpu-0-dynmig-3g40gb-4"]
        assert three["attributes"]["placement"] == {"int": 4} and "uuid" not in three["attributes"]
        assert sorted(three["consumesCounters"][0]["counters"]) == sorted(
            ["multiprocessors", "copy-engines", "decoders", "encoders", "jpeg-engines", "ofa-engines", "memory",
             *(f"memory-slice-{i}" for i in range(4, 8))])
        assert "consumesCounters" not in devices["gpu-1-mig-1g10gb-0"] and "uuid" in devices["gpu-1-mig-1g10gb-0"][
            "attributes"]
        wait_until(lambda: all(any(w.startswith(r) for w in warnings(sim_node)) for r in REASONS),
                   what="reasons logged")
        assert not any("dropped" in w for w in warnings(sim_node))
    finally:
        sim_node.close()



def test_1_35_without_the_gate_publishes_no_placements_and_says_why(layout: Path) -> None:
    sim_node = started(layout, 35, gate=False)
    try:
        sim_node.wait_for_devices(OTHERS)
        assert not any(s["spec"].get("sharedCounters") for s in sim_node.api.slices(DRIVER, NODE))
        wait_until(lambda: any(w.startswith("gpu-0 (NVIDIA H100 80GB HBM3): the API server does not keep "
                                            "partitionable devices") for w in warnings(sim_node)), what="the reason")
    finally:
        sim_node.close()


@pytest.mark.parametrize("minor", [35, 36])
def test_placements_are_withdrawn_when_the_server_drops_their_counters(layout: Path, minor: int) -> None:
    # The plans file says the gate is on (1.35) or the release has it on by default (1.36), but the API server
    # runs with DRAPartitionableDevices off: it stores the placements without their counters, silently, and the
    # scheduler could then hand out overlapping placements. Seen in what the server stored, the placements go.
    plans = {"defaultPlan": "p", "partitionableDevicesGate": True,
             "plans": {"p": {"gpus": [{"match": {"all": True}, "dynamicMig": {"profiles": PROFILES}}]}}}
    sim_node = SimulatedNode(str(layout), plans=plans, minor_version=minor)
    sim_node.api.partitionable_devices = False  # SIMULATION: the server's gate, off whatever the plans file says
    sim_node.start()
    try:
        sim_node.wait_for_devices(OTHERS, timeout=30)
        assert not any(s["spec"].get("sharedCounters") for s in sim_node.api.slices(DRIVER, NODE))
        errors = [str(e.get("msg")) for e in sim_node.log() if e.get("level") in ("ERROR", "error")]
        assert any("DRAPartitionableDevices" in e and "withdrawn" in e for e in errors), errors
    finally:
        sim_node.close()


def test_the_allocator_places_claims_by_the_published_counters(layout: Path) -> None:
    sim_node = started(layout, 36, gate=False)
    try:
        sim_node.wait_for_devices(DYNAMIC + OTHERS)
        slices = sim_node.api.slices(DRIVER, NODE)

        def claim(profile: str) -> dict[str, Any]:
            expression = (f"device.attributes['{DRIVER}'].profile == '{profile}' && "
                          f"device.attributes['{DRIVER}'].parentUUID == '{sim_node.inventory.gpus[0].uuid}'")
            return {"metadata": {"name": "c", "namespace": "default", "uid": "u"}, "spec": {"devices": {"requests": [
                {"name": "mig", "exactly": {"deviceClassName": f"mig.{DRIVER}",
                                            "selectors": [{"cel": {"expression": expression}}]}}]}}}

        taken: set[str] = set()
        for _ in range(7):
            allocate(claim("1g.10gb"), slices, DRIVER, taken)
        with pytest.raises(AllocationError):
            allocate(claim("1g.10gb"), slices, DRIVER, taken)
        taken = set()
        allocate(claim("4g.40gb"), slices, DRIVER, taken)
        allocate(claim("3g.40gb"), slices, DRIVER, taken)
        assert taken == {"gpu-0-dynmig-4g40gb-0", "gpu-0-dynmig-3g40gb-4"}
        with pytest.raises(AllocationError):
            allocate(claim("4g.40gb"), slices, DRIVER, taken)
    finally:
        sim_node.close()
