"""Consumable GPUs through the real sockets and the HTTP API double: claims sized by what they consumed."""

from __future__ import annotations

import json
import uuid
from typing import Any

from driver.kubeletplugin.types import ClaimRef
from driver.simulation.allocator import allocate
from tests.support.node import DRIVER, NODE, SimulatedNode, kill_9_while_daemon_starts, pid_alive, wait_until

PLANS: dict[str, Any] = {"plans": {"c": {"gpus": [
    {"match": {"minor": 0}, "consumable": {"fallback": {"mps": {"shares": 2}}}}]}}}


def allocated_claim(sim_node: SimulatedNode, name: str, memory: str, sms: str, consumed: dict[str, dict[str, int]],
                    uid: str) -> tuple[ClaimRef, dict[str, Any]]:
    """A claim the simulated scheduler allocated from the node's published slices."""
    claim = {"metadata": {"name": name, "namespace": "default", "uid": uid},
             "spec": {"devices": {"requests": [{"name": "share", "exactly": {
                 "deviceClassName": f"consumable.{DRIVER}",
                 "capacity": {"requests": {"memory": memory, "multiprocessors": sms}}}}]}}}
    done = allocate(claim, sim_node.api.slices(DRIVER, NODE), DRIVER, set(), consumed)
    sim_node.api.put_claim(done)
    [result] = done["status"]["allocation"]["devices"]["results"]
    return ClaimRef(namespace="default", name=name, uid=uid), result


def test_differently_sized_claims_share_one_gpu_with_their_own_limits() -> None:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="c")
    try:
        sim_node.start()
        sim_node.wait_for_devices(["gpu-0-shared", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6",
                                   "gpu-2"])
        [device] = [d for d in sim_node.devices() if d["name"] == "gpu-0-shared"]
        assert device["allowMultipleAllocations"] is True
        assert device["capacity"]["multiprocessors"]["requestPolicy"]["validRange"] == {
            "min": "2", "max": "132", "step": "1"}

        consumed: dict[str, dict[str, int]] = {}
        small, small_result = allocated_claim(sim_node, "small", "10Gi", "33", consumed, str(uuid.uuid4()))
        large, large_result = allocated_claim(sim_node, "large", "20Gi", "66", consumed, str(uuid.uuid4()))
        assert small_result["device"] == large_result["device"] == "gpu-0-shared"
        answers = sim_node.prepare(small, large)
        for ref, result in ((small, small_result), (large, large_result)):
            answer = answers[ref.uid]
            assert answer.error is None, answer.error
            assert [d.share_id for d in answer.devices] == [result["shareID"]]
        env = {ref.name: json.loads(sim_node.cdi_spec(ref.uid).read_text())["devices"][0]["containerEdits"]["env"]
               for ref in (small, large)}
        for name, percent, mib in (("small", 25, 10240), ("large", 50, 20480)):
            assert {f"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE={percent}",
                    f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={mib}M"} <= set(env[name])
        # Each claim's own daemon got its limits as defaults, so the container cannot raise them.
        commands = [" ".join([e["cmd"], *e["args"]]) for e in sim_node.journal() if "cmd" in e]
        for wanted in ("set_default_active_thread_percentage 25", "set_default_device_pinned_mem_limit 0 10240M",
                       "set_default_active_thread_percentage 50", "set_default_device_pinned_mem_limit 0 20480M"):
            assert wanted in commands
        assert len([e for e in sim_node.journal() if e.get("event") == "start"]) == 2

        # An allocation past the GPU's capacity (the scheduler's double allocation) is refused at prepare.
        over = ClaimRef(namespace="default", name="over", uid=str(uuid.uuid4()))
        sim_node.api.put_claim({"metadata": {"name": "over", "namespace": "default", "uid": over.uid},
                                "spec": {"devices": {"requests": []}},
                                "status": {"allocation": {"devices": {"config": [], "results": [{
                                "request": "share", "driver": DRIVER, "pool": NODE, "device": "gpu-0-shared",
                                "shareID": "00000000-0000-0000-0000-0000000000cc",
                                "consumedCapacity": {"memory": "60Gi", "multiprocessors": "2"}}]}}}})
        error = sim_node.prepare(over)[over.uid].error
        assert error is not None and "memory: 60Gi asked, 30Gi held by 2 other claim(s)" in error

        # Killed with its checkpoint corrupt, the driver rebuilds both shares from the CDI specs and still counts them.
        sim_node.kill9()
        (sim_node.state_dir / "checkpoint.json").write_text("{not json")
        sim_node.restart()
        sim_node.wait_for_devices(["gpu-0-shared", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6",
                                   "gpu-2"])
        rebuilt = {c["name"]: c["devices"][0] for c in sim_node.checkpoint()["claims"].values()}
        assert (rebuilt["large"]["consumed_memory_bytes"], rebuilt["large"]["consumed_multiprocessors"]) == (
            20 << 30, 66)
        assert sim_node.prepare(small)[small.uid].error is None
        error = sim_node.prepare(over)[over.uid].error
        assert error is not None and "would be overcommitted" in error
        assert sim_node.unprepare(small) == {small.uid: None}
        assert sim_node.prepare(over)[over.uid].error is not None  # 60 + 20 > 79 GiB even without small
        assert sorted(c["uid"] for c in sim_node.checkpoint()["claims"].values()) == [large.uid]
    finally:
        sim_node.close()


def test_without_consumable_capacity_the_plan_falls_back() -> None:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="c", minor_version=34)
    try:
        sim_node.start()
        sim_node.wait_for_devices(["gpu-0-mps-0", "gpu-0-mps-1", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4",
                                   "gpu-1-mig-1g10gb-6", "gpu-2"])
        assert any("publishing the plan's fallback" in str(line.get("msg")) for line in sim_node.log())
    finally:
        sim_node.close()


def test_a_server_running_without_consumable_capacity_gets_the_fallback_once_it_drops_the_fields() -> None:
    # A 1.36 server whose admin turned DRAConsumableCapacity off stores the consumable GPU without
    # allowMultipleAllocations, silently: one claim would then take the whole GPU, or the scheduler would give
    # it out once per claim with nothing counted. Seen in what it stored, the plan's fallback is published.
    sim_node = SimulatedNode("demo", plans=PLANS, plan="c", minor_version=36)
    sim_node.api.consumable_capacity = False  # SIMULATION: the server's gate, off on a release that has it on
    try:
        sim_node.start()
        sim_node.wait_for_devices(["gpu-0-mps-0", "gpu-0-mps-1", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4",
                                   "gpu-1-mig-1g10gb-6", "gpu-2"], timeout=30)
        assert any("DRAConsumableCapacity" in str(line.get("msg")) and line.get("level") in ("ERROR", "error")
                   for line in sim_node.log())
    finally:
        sim_node.close()


def test_kill_9_mid_prepare_of_a_share_rolls_back_its_daemon_and_a_retry_prepares_it_with_the_kernel_limit() -> None:
    # The R615 layout also shows detection end to end: the device says `kernel` and the spec carries the hook.
    sim_node = SimulatedNode("kernel-memory", plans=PLANS, plan="c")
    try:
        sim_node.start(env={"TESSERA_SIM_MPS_FAIL": "hang"})  # the daemon stand-in never answers: prepare blocks
        sim_node.wait_for_devices(["gpu-0-shared", "gpu-1"])
        [device] = [d for d in sim_node.devices() if d["name"] == "gpu-0-shared"]
        assert device["attributes"]["memoryLimitEnforcement"] == {"string": "kernel"}
        ref, result = allocated_claim(sim_node, "share", "10Gi", "33", {}, str(uuid.uuid4()))

        daemon_pid = kill_9_while_daemon_starts(sim_node, ref)

        sim_node.restart(env={"TESSERA_SIM_MPS_FAIL": ""})
        wait_until(lambda: not pid_alive(daemon_pid), what="the share's leaked daemon to be stopped")
        assert ref.uid not in sim_node.checkpoint()["claims"] and sim_node.checkpoint()["mps_daemons"] == {}
        assert sim_node.cdi_files() == [] and list((sim_node.state_dir / "mps").glob("share-*")) == []

        answer = sim_node.prepare_ok(ref)  # the kubelet's retry
        assert [d.share_id for d in answer.devices] == [result["shareID"]]
        edits = json.loads(sim_node.cdi_spec(ref.uid).read_text())["devices"][0]["containerEdits"]
        assert [h["args"][1:] for h in edits["hooks"]] == [
            ["apply-cuda-memory-limits", "--driver-root", "/", "--gpu-id", sim_node.inventory.gpus[0].uuid]]
        assert {"NVIDIA_GPU_MEMORY_REQUEST=10240", "NVIDIA_GPU_MEMORY_LIMIT=10240"} <= set(edits["env"])
        assert sim_node.unprepare(ref) == {ref.uid: None}
        assert sim_node.checkpoint()["mps_daemons"] == {}
    finally:
        sim_node.close()
