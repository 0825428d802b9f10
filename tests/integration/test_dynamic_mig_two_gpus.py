"""Dynamic MIG on two GPUs at once through the real driver process: many claims for the smallest profile of
both GPUs in one NodePrepareResources call, round after round, never fail.

The simulated node (``dynamic-mig-2``: two H100s in MIG mode, no instances) changes only the /proc capability
files of the instance it creates or destroys, as the NVIDIA driver does, while a prepare on the other GPU (which
holds only its own GPU's lock) reads its instance's files.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support import mignode
from tests.support.node import SimulatedNode, wait_until

PLANS = {"defaultPlan": "p", "plans": {"p": {"gpus": [{"match": {"all": True}, "dynamicMig": {}}]}}}
ONE_G = [f"gpu-{gpu}-dynmig-1g10gb-{start}" for gpu in (0, 1) for start in range(7)]
ROUNDS = 25


@pytest.fixture
def sim_node() -> Iterator[SimulatedNode]:
    n = SimulatedNode("dynamic-mig-2", plans=PLANS)
    mignode.set_boot_id(n, "boot-1")
    try:
        yield n
    finally:
        n.close()


def test_fourteen_claims_on_two_mig_gpus_in_one_call_succeed_round_after_round(sim_node: SimulatedNode) -> None:
    sim_node.start()
    wait_until(lambda: set(ONE_G) <= set(sim_node.device_names()), 30, "the 1g.10gb placements of both GPUs")
    for round_ in range(ROUNDS):
        # As the scheduler would: allocate only what the node publishes again after the last round's unprepare.
        wait_until(lambda: set(ONE_G) <= set(sim_node.device_names()), 30, "the placements published again")
        refs = [sim_node.claim(f"r{round_}-{device}", [("gpu", device)]) for device in ONE_G]
        answers = sim_node.prepare(*refs)
        failed = {ref.name: answers[ref.uid].error for ref in refs if answers[ref.uid].error is not None}
        assert failed == {}, f"round {round_}: {len(failed)} of {len(refs)} prepares failed: {failed}"
        assert len(mignode.proc_caps(sim_node, 0)) == len(mignode.proc_caps(sim_node, 1)) == 14  # 7 GIs + 7 CIs each
        assert sim_node.unprepare(*refs) == {ref.uid: None for ref in refs}
        assert mignode.proc_caps(sim_node, 0) == mignode.proc_caps(sim_node, 1) == []
