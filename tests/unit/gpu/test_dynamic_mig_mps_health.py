"""MPS daemons of dynamic MIG claims whose instance is gone, through DeviceState (``dynamicmignode.py``: the
simulated MIG partitioner, MPS daemons as recording fakes).

After a reboot another tool can take a claim's placement before the driver is back: the claim cannot get its
instance again, so recovery removes its CDI spec (it named capability nodes by GI/CI ids NVML may have handed to
that tool's instance) and leaves its daemon down. The daemon watcher and the rescans must not undo that.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.gpu.state import DeviceState
from driver.gpu.watch.daemonwatch import revive_daemons
from tests.support.dynamicmignode import DynamicMigNode
from tests.support.statenode import claim, ref

THREE_G = "gpu-0-dynmig-3g40gb-4"


def mig_mps_config(**mps: object) -> dict[str, object]:
    return {"source": "FromClaim", "requests": [],
            "opaque": {"driver": "gpu.tessera.dev", "parameters": {
                "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "MigDeviceConfig",
                "sharing": {"strategy": "MPS", "mpsConfig": mps}}}}


@pytest.fixture
def mig_node(tmp_path: Path) -> DynamicMigNode:
    return DynamicMigNode(tmp_path)


def reboot_and_lose_the_placement(mig_node: DynamicMigNode) -> DeviceState:
    """Prepare an MPS claim on a 3g.40gb, reboot, let another tool take placement 4 first, start the driver."""
    state = mig_node.state()
    state.prepare(claim("u1", THREE_G, configs=[mig_mps_config(defaultActiveThreadPercentage=50)]))
    mig_node.engine.reboot()
    mig_node.set_boot_id("boot-2")
    mig_node.mps.running.clear()  # daemons do not survive a reboot
    mig_node.engine.create(mig_node.gpu().uuid, {p.name: p for p in mig_node.gpu().mig_profiles}["3g.40gb"], 4)
    restarted = mig_node.state()
    assert not mig_node.spec_path("u1").exists() and mig_node.mps.running == {}, "recovery's part (tested elsewhere)"
    return restarted


@pytest.mark.parametrize("limits", [True, False], ids=["watcher", "rescan"])
def test_a_claim_whose_instance_could_not_be_made_again_gets_neither_its_daemon_nor_its_spec_back(
        mig_node: DynamicMigNode, limits: bool) -> None:
    state = reboot_and_lose_the_placement(mig_node)
    assert revive_daemons(state, limits=limits) == []
    assert mig_node.mps.running == {}, "no daemon started on the MIG UUID of an instance the reboot took"
    assert not mig_node.spec_path("u1").exists(), "the spec recovery removed stays removed"
    state.unprepare(ref("u1"))  # the kubelet's unprepare still cleans up
    assert state.prepared_claims() == [] and state.ledger.read().mps_daemons == {}
