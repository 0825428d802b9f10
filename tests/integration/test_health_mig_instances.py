"""Health events scoped to a GPU instance, through the real driver process on the simulated ``dynamic-mig`` node.

NVML names the GPU and the ``gpuInstanceId`` an XID happened in; the driver finds the MIG device from that. An
instance made since the driver's last rescan (here by another tool, with rescans an hour apart) must still be
found, so the error reaches that instance alone, not every device of its GPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import mignode
from tests.support.node import SimulatedNode, wait_until

PLANS = {"defaultPlan": "p", "plans": {"p": {"gpus": [{"match": {"minor": 0}, "dynamicMig": {}}]}}}
THREE_G = "gpu-0-dynmig-3g40gb-4"


@pytest.fixture
def node() -> Iterator[SimulatedNode]:
    with mignode.dynamic_mig_node(PLANS) as n:
        yield n


def inject(node: SimulatedNode, **event: Any) -> None:
    with node.events_file.open("a") as handle:
        handle.write(json.dumps(event) + "\n")


def tainted(node: SimulatedNode) -> dict[str, str]:
    return {d["name"]: d["taints"][0]["value"] for d in node.devices() if d.get("taints")}


def test_an_xid_in_an_instance_made_since_the_last_rescan_reaches_only_that_instance(node: SimulatedNode) -> None:
    node.start("--rescan-interval", "3600", env={"TESSERA_SIM_EVENTS": str(node.events_file)})
    wait_until(lambda: THREE_G in node.device_names(), 30, "the dynamic MIG placements published")
    ref = node.claim("c", [("mig", THREE_G)])
    node.prepare_ok(ref)
    claimed = node.checkpoint()["claims"][ref.uid]["devices"][0]
    gpu = node.inventory.gpus[0]
    one_g = next(p for p in gpu.mig_profiles if p.name == "1g.10gb")
    other = mignode.engine(node).create(gpu.uuid, one_g, 0)  # another tool; the driver rescans an hour later

    inject(node, uuid=gpu.uuid, xid=94, gpu_instance=other.gi_id, compute_instance=other.ci_id)
    inject(node, uuid=gpu.uuid, xid=95, gpu_instance=claimed["mig_gi_id"])  # the claim's instance, after it
    wait_until(lambda: THREE_G in tainted(node), 10, f"the claim's instance tainted (have {tainted(node)})")
    assert tainted(node) == {THREE_G: "xid-95"}, "the other instance's XID 94 reached no device of the GPU"
    unhealthy = {e["uuid"]: e["reason"] for e in node.log() if e.get("msg") == "device became unhealthy"}
    assert unhealthy == {other.uuid: "xid-94", claimed["mig_uuid"]: "xid-95"}
