"""Whose MIG instance, through the real driver process, on a simulated node whose NVML derives a MIG device's UUID
from its GPU and GI/CI ids alone (published MIG UUIDs are name-based, version 5; nvml.h does not say from what).

The attacker: another tool on the node (root, ``nvidia-smi mig``) destroys a claim's instance and creates the same
profile at the same placement, which then has the claim's GI and CI ids *and* its MIG UUID. It must never pass for
the claim's: the driver's unprepare must not destroy it, and no claim may be given it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import mignode
from tests.support.node import SimulatedNode, wait_until

PLANS = {"defaultPlan": "p", "plans": {"p": {"gpus": [{"match": {"minor": 0}, "dynamicMig": {}}]}}}
ONE_G = "gpu-0-dynmig-1g10gb-3"
LOST = "a claim's MIG device was destroyed outside Tessera; forgotten, so an instance made again at its place is " \
       "never taken for the claim's"


@pytest.fixture
def sim_node() -> Iterator[SimulatedNode]:
    with mignode.dynamic_mig_node(PLANS) as n:
        mignode.engine(n).use_name_derived_uuids()
        n.start("--mps-limit-check-interval", "1")
        wait_until(lambda: ONE_G in n.device_names(), 30, "the dynamic MIG placements published")
        yield n


def lost_lines(sim_node: SimulatedNode) -> list[dict[str, Any]]:
    return [e for e in sim_node.log() if e.get("msg") == LOST]


def test_an_instance_another_tool_made_again_at_a_claims_place_with_its_uuid_is_never_taken_for_the_claims(
        sim_node: SimulatedNode) -> None:
    gpu = sim_node.inventory.gpus[0]
    victim = sim_node.claim("victim", [("mig", ONE_G)], namespace="tenant-a")
    sim_node.prepare_ok(victim)
    [dev] = sim_node.checkpoint()["claims"][victim.uid]["devices"]
    engine = mignode.engine(sim_node)
    # The other tool: destroys the claim's instance...
    engine.destroy(gpu.uuid, dev["mig_gi_id"], dev["mig_ci_id"])
    wait_until(lambda: bool(lost_lines(sim_node)), 30, "the driver to see the claim's instance gone")
    # ...and makes the same profile at the same place: same ids, and (name-derived) the same MIG UUID.
    one_g = next(p for p in gpu.mig_profiles if p.name == "1g.10gb")
    impostor = engine.create(gpu.uuid, one_g, 3)
    assert (impostor.gi_id, impostor.ci_id, impostor.uuid) == (dev["mig_gi_id"], dev["mig_ci_id"], dev["mig_uuid"])

    assert lost_lines(sim_node)[0]["devices"] == [ONE_G] and lost_lines(sim_node)[0]["claim_uid"] == victim.uid
    [forgotten] = sim_node.checkpoint()["claims"][victim.uid]["devices"]
    assert (forgotten["mig_gi_id"], forgotten["mig_uuid"]) == (None, None)
    assert not sim_node.cdi_spec(victim.uid).exists(), "a restarted container must not get the impostor's nodes"
    wait_until(lambda: any(e["reason"] == "MigDeviceLost" for e in sim_node.api.events()), 15, "a MigDeviceLost Event")
    [event] = [e for e in sim_node.api.events() if e["reason"] == "MigDeviceLost"]
    assert event["regarding"]["uid"] == victim.uid and event["metadata"]["namespace"] == "tenant-a"

    assert sim_node.unprepare(victim) == {victim.uid: None}
    assert mignode.placements(sim_node) == [(3, 1, 0)], "the other tool's instance is never destroyed"
    # Nor handed to a claim: the placement is someone else's.
    thief = sim_node.claim("thief", [("mig", ONE_G)])
    error = sim_node.prepare(thief)[thief.uid].error
    assert error is not None and "Tessera did not create" in error
    assert mignode.placements(sim_node) == [(3, 1, 0)] and thief.uid not in sim_node.checkpoint()["claims"]
