"""Compute mode around MPS on the simulated node, through the kubelet's gRPC calls and a driver crash."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.node import DRIVER, SimulatedNode

PLANS: dict[str, Any] = {"plans": {"mps": {"gpus": [{"match": {"product": "NVIDIA L4"},
                                                    "mps": {"shares": 2, "pinnedMemoryLimit": "4Gi"}}]}}}
MIG_MPS = {"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": {
    "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}}}}


@pytest.fixture
def mps_node() -> Iterator[SimulatedNode]:
    n = SimulatedNode("demo", plans=PLANS, plan="mps")
    try:
        yield n
    finally:
        n.close()


def compute_mode(node: SimulatedNode, uuid: str) -> str:
    """What the nvidia-smi stand-in holds for the GPU (DEFAULT until something set it)."""
    path = node.work / "nvidia-smi-state.json"
    state: dict[str, dict[str, str]] = json.loads(path.read_text()) if path.exists() else {}
    return state.get(uuid, {}).get("compute_mode", "DEFAULT")


def test_an_mps_share_holds_exclusive_process_across_a_crash_and_two_mig_devices_are_refused(
        mps_node: SimulatedNode) -> None:
    l4 = next(g.uuid for g in mps_node.inventory.gpus if g.minor == 2)
    mps_node.start()
    mps_node.wait_for_devices(["gpu-0", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6",
                               "gpu-2-mps-0", "gpu-2-mps-1"])

    share = mps_node.claim("share", [("s", "gpu-2-mps-0")])
    mps_node.prepare_ok(share)
    assert compute_mode(mps_node, l4) == "EXCLUSIVE_PROCESS"
    assert mps_node.checkpoint()["compute_modes"] == {l4: "DEFAULT"}

    migs = mps_node.claim("migs", [("a", "gpu-1-mig-1g10gb-6"), ("b", "gpu-1-mig-2g20gb-4")], configs=[MIG_MPS])
    error = mps_node.prepare(migs)[migs.uid].error
    assert error is not None and "single CUDA process" in error and "gpu-1-mig-1g10gb-6" in error
    assert migs.uid not in mps_node.checkpoint()["claims"]

    mps_node.kill9()
    mps_node.restart()
    assert compute_mode(mps_node, l4) == "EXCLUSIVE_PROCESS", "the restarted driver keeps the daemon's GPU exclusive"
    assert mps_node.unprepare(share) == {share.uid: None}
    assert compute_mode(mps_node, l4) == "DEFAULT"
    assert mps_node.checkpoint()["compute_modes"] == {}
