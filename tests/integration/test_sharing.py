"""Sharing a GPU: MPS daemons with enforced limits and time-slicing, from the plan or per claim."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.node import NODE, PLAN_LABEL, SimulatedNode, gpu_config, pid_alive, wait_until

PLANS: dict[str, Any] = {
    "plans": {
        "whole": {},
        "mps": {"gpus": [{"match": {"product": "NVIDIA L4"},
                          "mps": {"shares": 4, "activeThreadPercentage": 25, "pinnedMemoryLimit": "4Gi"}}]},
        "ts": {"gpus": [{"match": {"minor": 0}, "timeSlicing": {"shares": 2, "interval": "Long"}}]},
    }
}
SHARES = [f"gpu-2-mps-{k}" for k in range(4)]
MIG = ["gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6"]


@pytest.fixture
def mps_node() -> Iterator[SimulatedNode]:
    n = SimulatedNode("demo", plans=PLANS, plan="mps")
    try:
        yield n
    finally:
        n.close()


def commands(sim_node: SimulatedNode, pid: int | None = None) -> list[str]:
    return [" ".join([e["cmd"], *e["args"]]) for e in sim_node.journal()
            if "cmd" in e and (pid is None or e["pid"] == pid)]


def daemon_starts(sim_node: SimulatedNode) -> list[int]:
    return [e["pid"] for e in sim_node.journal() if e.get("event") == "start"]


def test_plan_publishes_mps_shares_with_enforcement_attributes(mps_node: SimulatedNode) -> None:
    mps_node.start()
    mps_node.wait_for_devices(["gpu-0", *MIG, *SHARES])
    share = next(d for d in mps_node.devices() if d["name"] == "gpu-2-mps-1")
    attrs = share["attributes"]
    assert attrs["type"] == {"string": "mps"}
    assert attrs["sharingStrategy"] == {"string": "MPS"}
    assert (attrs["shareIndex"], attrs["shareCount"]) == ({"int": 1}, {"int": 4})
    assert attrs["activeThreadPercentage"] == {"int": 25}
    assert attrs["memoryLimitEnforcement"] == {"string": "mps-per-process"}
    assert attrs["parentUUID"]["string"] == mps_node.inventory.gpus[2].uuid
    assert share["capacity"]["memory"] == {"value": "4Gi"}


def test_mps_share_limits_applied_before_readiness_and_one_daemon_per_gpu(mps_node: SimulatedNode) -> None:
    mps_node.start()
    mps_node.wait_for_devices(["gpu-0", *MIG, *SHARES])
    first = mps_node.claim("first", [("share", "gpu-2-mps-0")])
    second = mps_node.claim("second", [("share", "gpu-2-mps-3")])
    mps_node.prepare_ok(first)
    [pid] = daemon_starts(mps_node)
    # Readiness first (the daemon answers), then the limits set and read back, all before prepare returns;
    # each session ends with a sentinel whose answer shows it was served, not refused as busy.
    sentinel = "get_default_active_thread_percentage"
    assert commands(mps_node, pid) == [
        "get_default_active_thread_percentage", sentinel,
        "set_default_active_thread_percentage 25", "set_default_device_pinned_mem_limit 0 4096M", sentinel,
        "get_default_active_thread_percentage", "get_default_device_pinned_mem_limit 0", sentinel]

    spec = json.loads(mps_node.cdi_spec(first.uid).read_text())
    edits = spec["devices"][0]["containerEdits"]
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in edits["env"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in edits["env"]
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=4096M" in edits["env"]
    mounts = {m["containerPath"]: m["hostPath"] for m in edits["mounts"]}
    assert mounts["/tmp/nvidia-mps"].startswith(str(mps_node.state_dir / "mps"))
    assert "/dev/shm" in mounts
    assert edits["deviceNodes"] == [{"path": "/dev/nvidia2"}]

    mps_node.prepare_ok(second)
    assert daemon_starts(mps_node) == [pid], "the second share uses the same daemon"
    assert mps_node.unprepare(first) == {first.uid: None}
    assert pid_alive(pid), "still needed by the second share"
    assert mps_node.unprepare(second) == {second.uid: None}
    wait_until(lambda: not pid_alive(pid), what="the daemon to stop after its last share")
    assert "quit" in commands(mps_node, pid)
    assert mps_node.checkpoint()["mps_daemons"] == {}
    assert [p.name for p in (mps_node.state_dir / "mps").glob("plan-*")] == []


def test_two_shares_of_one_gpu_in_one_claim_are_refused(mps_node: SimulatedNode) -> None:
    mps_node.start()
    ref = mps_node.claim("greedy", [("a", "gpu-2-mps-0"), ("b", "gpu-2-mps-1")])
    error = mps_node.prepare(ref)[ref.uid].error or ""
    assert "2 shares of one GPU" in error and "allowMultipleSharesPerClaim" in error
    assert daemon_starts(mps_node) == [] and mps_node.cdi_files() == []


def test_restart_adopts_a_live_daemon_and_restarts_a_dead_one(mps_node: SimulatedNode) -> None:
    mps_node.start()
    ref = mps_node.claim("c", [("share", "gpu-2-mps-0")])
    mps_node.prepare_ok(ref)
    [pid] = daemon_starts(mps_node)
    mps_node.restart()
    assert daemon_starts(mps_node) == [pid], "adopted, never duplicated"
    assert pid_alive(pid)

    mps_node.stop()
    import os
    import signal

    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: not pid_alive(pid), what="the daemon to die")
    mps_node.start()
    starts = daemon_starts(mps_node)
    assert len(starts) == 2 and starts[0] == pid
    assert [c for c in commands(mps_node, starts[1]) if c.startswith("set_")] == [
        "set_default_active_thread_percentage 25", "set_default_device_pinned_mem_limit 0 4096M"], "same limits"
    assert mps_node.prepare_ok(ref).devices[0].device_name == "gpu-2-mps-0"
    assert mps_node.unprepare(ref) == {ref.uid: None}
    wait_until(lambda: not pid_alive(starts[1]), what="the restarted daemon to stop")


def test_per_claim_mps_limits_on_a_whole_gpu(sim_node: SimulatedNode) -> None:
    sim_node.start()
    ref = sim_node.claim("c", [("gpu", "gpu-0")], configs=[gpu_config(
        strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 50, "defaultPinnedDeviceMemoryLimit": "10Gi"})])
    sim_node.prepare_ok(ref)
    [pid] = daemon_starts(sim_node)
    assert [c for c in commands(sim_node, pid) if c.startswith("set_")] == [
        "set_default_active_thread_percentage 50", "set_default_device_pinned_mem_limit 0 10240M"]
    env = json.loads(sim_node.cdi_spec(ref.uid).read_text())["devices"][0]["containerEdits"]["env"]
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M" in env
    assert sim_node.unprepare(ref) == {ref.uid: None}
    wait_until(lambda: not pid_alive(pid), what="the claim's daemon to stop")


def test_daemon_that_fails_to_start_is_a_claim_error_with_its_log_and_leaves_nothing(sim_node: SimulatedNode) -> None:
    sim_node.start(env={"TESSERA_SIM_MPS_FAIL": "start"})
    ref = sim_node.claim("c", [("gpu", "gpu-0")], configs=[gpu_config(strategy="MPS")])
    error = sim_node.prepare(ref)[ref.uid].error or ""
    assert "MPS" in error and "SIMULATION" in error, error  # the stand-in's control.log tail
    assert sim_node.cdi_files() == [] and sim_node.checkpoint()["claims"] == {}
    assert all(not pid_alive(p) for p in daemon_starts(sim_node))


def test_per_claim_time_slicing_is_set_at_prepare_and_reset_at_unprepare(sim_node: SimulatedNode) -> None:
    sim_node.start()
    uuid = sim_node.inventory.gpus[0].uuid
    ref = sim_node.claim("c", [("gpu", "gpu-0")], configs=[gpu_config(
        strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"})])
    sim_node.prepare_ok(ref)
    # nvidia-smi only for the slice (NVML has no call for it); the compute mode, already DEFAULT, is read via NVML.
    assert sim_node.nvidia_smi_calls() == [["compute-policy", "-i", uuid, "--set-timeslice", "3"]]
    assert [(c["call"], c["uuid"]) for c in sim_node.nvml_calls()] == [("nvmlDeviceGetComputeMode", uuid)]
    assert sim_node.unprepare(ref) == {ref.uid: None}
    assert sim_node.nvidia_smi_calls()[1:] == [["compute-policy", "-i", uuid, "--set-timeslice", "0"]]


def test_failing_nvidia_smi_is_a_clear_claim_error(sim_node: SimulatedNode) -> None:
    sim_node.start(env={"TESSERA_SIM_NVIDIA_SMI_FAIL": "--set-timeslice 2"})
    ref = sim_node.claim("c", [("gpu", "gpu-0")], configs=[gpu_config(
        strategy="TimeSlicing", timeSlicingConfig={"interval": "Medium"})])
    error = sim_node.prepare(ref)[ref.uid].error or ""
    assert "nvidia-smi" in error and "set-timeslice" in error
    assert sim_node.cdi_files() == [] and sim_node.checkpoint()["claims"] == {}


def test_time_slice_plan_is_applied_to_the_gpu_at_start() -> None:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="ts")
    try:
        sim_node.start()
        sim_node.wait_for_devices(["gpu-0-ts-0", "gpu-0-ts-1", *MIG, "gpu-2"])
        uuid = sim_node.inventory.gpus[0].uuid
        assert ["compute-policy", "-i", uuid, "--set-timeslice", "3"] in sim_node.nvidia_smi_calls()
        ts = next(d for d in sim_node.devices() if d["name"] == "gpu-0-ts-1")["attributes"]
        assert ts["timeSliceInterval"] == {"string": "Long"}
        assert ts["memoryLimitEnforcement"] == {"string": "none"}
    finally:
        sim_node.close()


def test_plan_change_is_deferred_while_claims_are_prepared(mps_node: SimulatedNode) -> None:
    mps_node.start()
    mps_node.wait_for_devices(["gpu-0", *MIG, *SHARES])
    ref = mps_node.claim("c", [("share", "gpu-2-mps-0")])
    mps_node.prepare_ok(ref)
    mps_node.api.set_node_labels(NODE, {PLAN_LABEL: "whole"})
    wait_until(lambda: any("deferred" in str(e.get("msg")) for e in mps_node.log()), what="the deferral log line")
    assert sorted(mps_node.device_names()) == sorted(["gpu-0", *MIG, *SHARES]), "not applied under a workload"
    assert mps_node.unprepare(ref) == {ref.uid: None}
    mps_node.wait_for_devices(["gpu-0", *MIG, "gpu-2"])


def test_bad_plan_stops_the_driver_with_a_message_naming_the_entry() -> None:
    plans = {"plans": {"bad": {"gpus": [{"match": {"all": True}, "mps": {"shares": 1}}]}}}
    sim_node = SimulatedNode("demo", plans=plans, plan="bad")
    try:
        code, output = sim_node.run_to_exit()
        assert code == 1
        assert "plans.bad.gpus[0].mps.shares" in output
    finally:
        sim_node.close()


@pytest.mark.parametrize("plan", ["mps", "ts", "whole"])
def test_published_slices_validate_against_the_kubernetes_schemas(plan: str) -> None:
    import kubernetes_validate  # type: ignore[import-untyped]

    sim_node = SimulatedNode("demo", plans=PLANS, plan=plan)
    try:
        sim_node.start()
        wait_until(lambda: bool(sim_node.devices()), what="slices")
        for slice_ in sim_node.api.slices():
            for version in ("1.34", "1.36"):
                kubernetes_validate.validate(slice_, version, strict=True)
    finally:
        sim_node.close()


def test_a_prepare_at_the_first_instant_waits_for_the_multi_user_probe_and_starts_its_daemon_multi_user(
        mps_node: SimulatedNode) -> None:
    # The stand-in holds the probe's -M daemon until the file exists: the prepare comes while the probe
    # has no answer yet. A daemon started then used to be single-user for as long as claims used it.
    hold = mps_node.work / "release-multi-user-probe"
    ref = mps_node.claim("first", [("share", "gpu-2-mps-0")])
    mps_node.start(env={"TESSERA_SIM_MPS_HOLD_MULTI_USER": str(hold)})
    answers: dict[str, Any] = {}
    prepare = threading.Thread(target=lambda: answers.update(mps_node.prepare(ref)))
    prepare.start()
    wait_until(lambda: not prepare.is_alive() or any(
        "waits for the multi-user probe" in str(e.get("msg")) for e in mps_node.log()), what="the prepare to wait")
    hold.touch()
    prepare.join(60)
    assert answers[ref.uid].error is None, answers[ref.uid].error
    [start] = [e for e in mps_node.journal() if e.get("event") == "start"]
    assert start["multi_user"] is True, "the first plan daemon started multi-user"
    assert next(iter(mps_node.checkpoint()["mps_daemons"].values()))["spec"]["multi_user"] is True


def test_multi_user_mode_is_probed_after_start_then_published_and_used(mps_node: SimulatedNode) -> None:
    # The stand-in without TESSERA_SIM_MPS_DRIVER knows -M: the probe answers yes after registration.
    mps_node.start()

    def multi_user() -> list[object]:
        return [d["attributes"].get("mpsMultiUser") for d in mps_node.devices() if d["name"] in SHARES]

    wait_until(lambda: multi_user() == [{"bool": True}] * 4, what="mpsMultiUser republished as true")
    probes = [e for e in mps_node.journal(probes=True) if e.get("event") == "start" and e not in mps_node.journal()]
    assert [e["multi_user"] for e in probes] == [True], "one throwaway daemon, with -M"
    assert not pid_alive(probes[0]["pid"]) and not (mps_node.state_dir / "mps" / "probe-multi-user").exists()

    ref = mps_node.claim("share", [("share", "gpu-2-mps-0")])
    mps_node.prepare_ok(ref)
    [start] = [e for e in mps_node.journal() if e.get("event") == "start"]
    assert start["multi_user"] is True
    assert next(iter(mps_node.checkpoint()["mps_daemons"].values()))["spec"]["multi_user"] is True
