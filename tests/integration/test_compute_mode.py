"""Compute mode around MPS on the simulated node, through the kubelet's gRPC calls and a driver crash.

The driver reads and sets it through NVML in its own process; on the simulated node that is the NVML double
(driver/simulation/nvmlcompute.py), which records every call, and no `nvidia-smi -c` runs.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.integration.test_health import metrics
from tests.support.node import DRIVER, SimulatedNode, wait_until

DEVICES = ["gpu-0", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6", "gpu-2-mps-0", "gpu-2-mps-1"]
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


def compute_mode(sim_node: SimulatedNode, uuid: str) -> str:
    """What the simulated NVML (and the stand-ins, from the same file) holds for the GPU (DEFAULT until set)."""
    return sim_node.compute_mode(uuid)


def nvidia_smi_compute_mode_calls(sim_node: SimulatedNode) -> list[list[str]]:
    """nvidia-smi runs that read or set a compute mode: none since the driver uses NVML in its own process."""
    return [c for c in sim_node.nvidia_smi_calls() if "-c" in c or any(a.startswith("--query-gpu") for a in c)]


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


def test_compute_mode_goes_through_nvml_in_the_driver_and_never_through_nvidia_smi(mps_node: SimulatedNode) -> None:
    l4 = next(g.uuid for g in mps_node.inventory.gpus if g.minor == 2)
    mps_node.start()
    mps_node.wait_for_devices(DEVICES)
    first, second = mps_node.claim("first", [("s", "gpu-2-mps-0")]), mps_node.claim("second", [("s", "gpu-2-mps-1")])
    mps_node.prepare_ok(first)
    mps_node.prepare_ok(second)
    asked = [(c["call"], c.get("mode")) for c in mps_node.nvml_calls() if c["uuid"] == l4]
    # The first share reads the mode (to restore it later) and sets EXCLUSIVE_PROCESS; the second finds it held.
    assert asked == [("nvmlDeviceGetComputeMode", None), ("nvmlDeviceSetComputeMode", "EXCLUSIVE_PROCESS")]
    assert compute_mode(mps_node, l4) == "EXCLUSIVE_PROCESS"

    assert mps_node.unprepare(first) == {first.uid: None}
    assert compute_mode(mps_node, l4) == "EXCLUSIVE_PROCESS", "the second share's daemon still serves the GPU"
    assert mps_node.unprepare(second) == {second.uid: None}
    assert [c.get("mode") for c in mps_node.nvml_calls() if c["uuid"] == l4][-1] == "DEFAULT"
    assert compute_mode(mps_node, l4) == "DEFAULT"
    assert nvidia_smi_compute_mode_calls(mps_node) == []


def test_a_compute_mode_nvml_refuses_fails_the_claim_with_nvmls_error_and_leaves_nothing(
        mps_node: SimulatedNode) -> None:
    l4 = next(g.uuid for g in mps_node.inventory.gpus if g.minor == 2)
    mps_node.start(env={"TESSERA_SIM_NVML_FAIL": f"nvmlDeviceSetComputeMode {l4}"})
    mps_node.wait_for_devices(DEVICES)
    share = mps_node.claim("share", [("s", "gpu-2-mps-0")])
    error = mps_node.prepare(share)[share.uid].error or ""
    assert f"nvmlDeviceSetComputeMode EXCLUSIVE_PROCESS for {l4} failed: NVML error 999: Unknown Error" in error
    cp = mps_node.checkpoint()
    assert cp["claims"] == {} and cp["compute_modes"] == {} and cp["mps_daemons"] == {}
    assert mps_node.cdi_files() == [] and compute_mode(mps_node, l4) == "DEFAULT"
    assert nvidia_smi_compute_mode_calls(mps_node) == []


def test_a_gpu_put_back_to_default_under_an_mps_share_is_set_exclusive_again_with_an_event_and_the_metric(
        mps_node: SimulatedNode) -> None:
    l4 = next(g.uuid for g in mps_node.inventory.gpus if g.minor == 2)
    mps_node.start("--mps-limit-check-interval", "1")
    mps_node.wait_for_devices(DEVICES)
    share = mps_node.claim("share", [("s", "gpu-2-mps-0")], namespace="tenant-a")
    mps_node.prepare_ok(share)
    assert compute_mode(mps_node, l4) == "EXCLUSIVE_PROCESS"
    # Behind the driver's back, as a GPU reset ("always resets to Default", nvml.h) or another root process does.
    smi = mps_node.sim_host.driver_root / "usr" / "bin" / "nvidia-smi"
    subprocess.run([str(smi), "-i", l4, "-c", "DEFAULT"], check=True, capture_output=True, timeout=30,
                   env=dict(os.environ, TESSERA_SIM_NVIDIA_SMI_STATE=str(mps_node.work / "nvidia-smi-state.json")))
    assert compute_mode(mps_node, l4) == "DEFAULT"

    def restored() -> list[dict[str, Any]]:
        return [e for e in mps_node.log()
                if e.get("msg") == "a GPU serving MPS claims was out of EXCLUSIVE_PROCESS; set it back"]

    wait_until(lambda: bool(restored()), timeout=30, what="the watcher to set the compute mode back")
    assert compute_mode(mps_node, l4) == "EXCLUSIVE_PROCESS"
    assert (restored()[0]["gpu_uuid"], restored()[0]["found"], restored()[0]["claims"]) == (l4, "DEFAULT", [share.uid])
    wait_until(lambda: any(e["reason"] == "ComputeModeRestored" for e in mps_node.api.events()), timeout=15,
               what="a ComputeModeRestored Event on the claim")
    [event] = [e for e in mps_node.api.events() if e["reason"] == "ComputeModeRestored"]
    assert event["type"] == "Warning" and event["metadata"]["namespace"] == "tenant-a"
    assert (event["regarding"]["kind"], event["regarding"]["uid"]) == ("ResourceClaim", share.uid)
    assert f"GPU {l4}" in event["note"] and "found in compute mode DEFAULT" in event["note"]
    assert metrics(mps_node)[("tessera_compute_mode_restored_total", (("gpu", l4),))] == 1
    # Released as before: the mode the GPU had before the share, DEFAULT.
    assert mps_node.unprepare(share) == {share.uid: None}
    assert compute_mode(mps_node, l4) == "DEFAULT"
