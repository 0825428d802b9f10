"""The engines of NVIDIA's MIG profile tables, published by the real driver process as its counters, so the
scheduler (here the simulated allocator, placing by the published counters) refuses what NVIDIA refuses at
create: a second ``+me`` instance on an H100 (the GPU has one OFA engine, which each ``+me`` instance takes).

Engine counts: the NVIDIA MIG User Guide, "Supported MIG Profiles", H100 table (driver/simulation/mig-engines.json).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from driver.simulation.allocator import AllocationError, allocate
from tests.support import mignode
from tests.support.node import DRIVER, SimulatedNode, wait_until

PLANS = {"defaultPlan": "p", "plans": {"p": {"gpus": [{"match": {"minor": 0}, "dynamicMig": {}}]}}}
ME = [f"gpu-0-dynmig-1g10gbme-{start}" for start in range(7)]


@pytest.fixture
def sim_node() -> Iterator[SimulatedNode]:
    with mignode.dynamic_mig_node(PLANS) as n:
        n.start()
        wait_until(lambda: set(ME) <= set(n.device_names()), 30, "the 1g.10gb+me placements published")
        yield n


def claim_for(sim_node: SimulatedNode, profile: str, name: str) -> dict[str, Any]:
    expression = (f"device.attributes['{DRIVER}'].profile == '{profile}' && "
                  f"device.attributes['{DRIVER}'].parentUUID == '{sim_node.inventory.gpus[0].uuid}'")
    return {"metadata": {"name": name, "namespace": "default", "uid": name}, "spec": {"devices": {"requests": [
        {"name": "mig", "exactly": {"deviceClassName": f"mig.{DRIVER}",
                                    "selectors": [{"cel": {"expression": expression}}]}}]}}}


def test_the_h100s_counters_hold_its_published_engines_and_one_me_instance_takes_its_only_ofa(
        sim_node: SimulatedNode) -> None:
    [counter_set] = [c for s in sim_node.api.slices(DRIVER, "node-a") for c in s["spec"].get("sharedCounters", [])]
    counters = {name: value["value"] for name, value in counter_set["counters"].items()}
    assert (counters["decoders"], counters["jpeg-engines"], counters["ofa-engines"], counters["copy-engines"]) == (
        "7", "7", "1", "8")
    devices = {d["name"]: d for d in sim_node.devices()}
    me = devices["gpu-0-dynmig-1g10gbme-3"]["consumesCounters"][0]["counters"]
    assert {k: me[k]["value"] for k in ("decoders", "jpeg-engines", "ofa-engines")} == {
        "decoders": "1", "jpeg-engines": "1", "ofa-engines": "1"}
    slices = sim_node.api.slices(DRIVER, "node-a")
    taken: set[str] = set()
    first = allocate(claim_for(sim_node, "1g.10gb+me", "first"), slices, DRIVER, taken)
    with pytest.raises(AllocationError):
        allocate(claim_for(sim_node, "1g.10gb+me", "second"), slices, DRIVER, taken)
    # Six plain 1g.10gb instances still fit beside it: each has its own decoder and JPEG engine, none an OFA.
    for k in range(6):
        allocate(claim_for(sim_node, "1g.10gb", f"plain-{k}"), slices, DRIVER, taken)
    # What the allocator gave is what the simulated NVML creates: the +me instance is prepared.
    [result] = first["status"]["allocation"]["devices"]["results"]
    ref = sim_node.claim("first", [("mig", result["device"])])
    sim_node.prepare_ok(ref)
    assert [p[1] for p in mignode.placements(sim_node)] == [1]
