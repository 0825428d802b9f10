"""What a claim got, in its ResourceClaim's status.devices: written by the real driver process (server-side apply,
after prepare, never in its way), flipped by a health event, removed at unprepare, kept once across a restart,
and left alone by a server without the field. Checked on the API server double as a user would read it."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from driver.kubeletplugin.kubeclient import APPLY_PATCH, request_json
from driver.kubeletplugin.types import ClaimRef
from tests.integration.test_mps_limit_watch import tenant
from tests.support import mignode
from tests.support.node import DRIVER, NODE, SimulatedNode, wait_until

PLANS: dict[str, Any] = {"plans": {"mixed": {"gpus": [
    {"match": {"product": "NVIDIA L4"}, "mps": {"shares": 2, "activeThreadPercentage": 25, "pinnedMemoryLimit": "4Gi"}},
    {"match": {"minor": 0}, "timeSlicing": {"shares": 2, "interval": "Long"}},
]}}}
MIG = "gpu-1-mig-2g20gb-4"
OTHER_DRIVER = "nic.example.com"


def entries(sim_node: SimulatedNode, ref: ClaimRef, driver: str = DRIVER) -> list[dict[str, Any]]:
    claim = next(c for c in sim_node.api.claims() if c["metadata"]["uid"] == ref.uid)
    return [e for e in (claim.get("status") or {}).get("devices") or [] if e["driver"] == driver]


def conditions(entry: dict[str, Any]) -> dict[str, str]:
    return {c["type"]: c["status"] for c in entry["conditions"]}


def wait_ready(sim_node: SimulatedNode, ref: ClaimRef, count: int = 1) -> list[dict[str, Any]]:
    wait_until(lambda: len(entries(sim_node, ref)) == count, what=f"{count} status entries of {ref.name}")
    return entries(sim_node, ref)


def gpu_uuid(sim_node: SimulatedNode, minor: int) -> str:
    gpu = sim_node.inventory.gpu_by_minor(minor)
    assert gpu is not None
    return gpu.uuid


def test_shares_and_mig_slices_show_what_they_got_flip_on_health_and_go_at_unprepare() -> None:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="mixed")
    try:
        sim_node.start(env={"TESSERA_SIM_EVENTS": str(sim_node.events_file)})
        sim_node.wait_for_devices(["gpu-0-ts-0", "gpu-0-ts-1", "gpu-1-mig-3g40gb-0", MIG, "gpu-1-mig-1g10gb-6",
                                   "gpu-2-mps-0", "gpu-2-mps-1"])
        mps = sim_node.claim("mps", [("gpu", "gpu-2-mps-1")])
        ts = sim_node.claim("ts", [("gpu", "gpu-0-ts-0")])
        mig = sim_node.claim("mig", [("gpu", MIG)])
        for ref in (mps, ts, mig):
            sim_node.prepare_ok(ref)

        [share] = wait_ready(sim_node, mps)
        assert (share["pool"], share["device"]) == (NODE, "gpu-2-mps-1")
        assert conditions(share) == {"Ready": "True", "Healthy": "True"}
        assert share["data"]["gpuUUID"] == gpu_uuid(sim_node, 2) and share["data"]["productName"] == "NVIDIA L4"
        sharing = share["data"]["sharing"]
        assert (sharing["strategy"], sharing["activeThreadPercentage"], sharing["pinnedMemoryLimit"]) == (
            "MPS", 25, "4Gi")
        published = next(d for d in sim_node.devices() if d["name"] == "gpu-2-mps-1")["attributes"]
        assert sharing["memoryLimitEnforcement"] == published["memoryLimitEnforcement"]["string"]
        assert sharing["computeLimitEnforcement"] == published["computeLimitEnforcement"]["string"]

        [slice_] = wait_ready(sim_node, ts)
        assert slice_["device"] == "gpu-0-ts-0" and slice_["data"]["gpuUUID"] == gpu_uuid(sim_node, 0)
        assert slice_["data"]["sharing"]["strategy"] == "TimeSlicing"
        assert slice_["data"]["sharing"]["timeSliceInterval"] == "Long"
        assert slice_["data"]["sharing"]["computeLimitEnforcement"] == "none"

        [instance] = wait_ready(sim_node, mig)
        gpu1 = sim_node.inventory.gpu_by_minor(1)
        assert gpu1 is not None
        expected_mig = next(m for m in gpu1.mig_instances if m.placement_start == 4)
        assert instance["data"]["gpuUUID"] == gpu1.uuid and instance["data"]["migUUID"] == expected_mig.uuid
        assert instance["data"]["memory"] and conditions(instance) == {"Ready": "True", "Healthy": "True"}

        shown = json.loads(subprocess.run(sim_node.inspect_args("--json"), capture_output=True, text=True, check=True,
                                          env=sim_node.env, timeout=60).stdout)
        by_uid = {c["uid"]: c["status_devices"] for c in shown["claims"]}
        assert [e["data"] for e in by_uid[mps.uid]] == [share["data"]], "inspect shows what the claim shows"
        assert [e["data"] for e in by_uid[mig.uid]] == [instance["data"]]

        with sim_node.events_file.open("a") as handle:
            handle.write(json.dumps({"uuid": gpu1.uuid, "xid": 79}) + "\n")  # fallen off the bus
        wait_until(lambda: conditions(entries(sim_node, mig)[0])["Healthy"] == "False", what="the health flip")
        flipped = next(c for c in entries(sim_node, mig)[0]["conditions"] if c["type"] == "Healthy")
        assert flipped["reason"] and flipped["message"]
        assert conditions(entries(sim_node, mps)[0])["Healthy"] == "True", "another GPU's claim stays healthy"

        assert sim_node.unprepare(mps, ts, mig) == {mps.uid: None, ts.uid: None, mig.uid: None}
        for ref in (mps, ts, mig):
            wait_until(lambda ref=ref: entries(sim_node, ref) == [], what=f"{ref.name}'s entries removed")
    finally:
        sim_node.close()


def test_a_whole_gpu_entry_survives_a_restart_once_and_other_drivers_entries_stay() -> None:
    sim_node = SimulatedNode("demo")
    try:
        sim_node.start()
        sim_node.wait_for_devices(["gpu-0", "gpu-1-mig-3g40gb-0", MIG, "gpu-1-mig-1g10gb-6", "gpu-2"])
        ref = sim_node.claim("whole", [("gpu", "gpu-0")])
        claim = next(c for c in sim_node.api.claims() if c["metadata"]["uid"] == ref.uid)
        claim["status"]["allocation"]["devices"]["results"].append(
            {"request": "nic", "driver": OTHER_DRIVER, "pool": NODE, "device": "nic-0"})
        sim_node.api.put_claim(claim)
        other = {"driver": OTHER_DRIVER, "pool": NODE, "device": "nic-0", "data": {"ip": "10.1.2.3"}}
        request_json(sim_node.api.api_client(), "PATCH",
                     f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{ref.name}/status",
                     body={"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                           "metadata": {"name": ref.name, "namespace": "default"}, "status": {"devices": [other]}},
                     content_type=APPLY_PATCH, query=[("fieldManager", OTHER_DRIVER)])
        sim_node.prepare_ok(ref)
        [entry] = wait_ready(sim_node, ref)
        assert "shareID" not in entry and entry["device"] == "gpu-0"
        published = next(d for d in sim_node.devices() if d["name"] == "gpu-0")
        assert entry["data"]["gpuUUID"] == gpu_uuid(sim_node, 0)
        assert entry["data"]["memory"] == published["capacity"]["memory"]["value"]
        assert entry["data"]["productName"].startswith("NVIDIA H100")
        assert "sharing" not in entry["data"]

        sim_node.restart()
        wait_until(lambda: any(e.get("msg") == "driver started" for e in sim_node.log()), what="restart")
        sim_node.prepare_ok(ref)  # the kubelet prepares again after a restart: idempotent
        assert entries(sim_node, ref) == [entry], "the same entry, once, unchanged"
        assert entries(sim_node, ref, OTHER_DRIVER) == [other]
        assert sim_node.unprepare(ref) == {ref.uid: None}
        wait_until(lambda: entries(sim_node, ref) == [], what="the entry removed")
        assert entries(sim_node, ref, OTHER_DRIVER) == [other], "another driver's entry is untouched"
    finally:
        sim_node.close()


def test_a_server_without_the_field_is_logged_once_and_prepares_go_on() -> None:
    sim_node = SimulatedNode("demo")
    sim_node.api.claim_device_status = False  # DRAResourceClaimDeviceStatus off: the server drops the field
    try:
        sim_node.start()
        sim_node.wait_for_devices(["gpu-0", "gpu-1-mig-3g40gb-0", MIG, "gpu-1-mig-1g10gb-6", "gpu-2"])
        refs = [sim_node.claim(f"c{i}", [("gpu", device)]) for i, device in enumerate(["gpu-0", "gpu-2"])]
        sim_node.prepare_ok(refs[0])
        wait_until(lambda: any("DRAResourceClaimDeviceStatus" in str(e.get("msg")) for e in sim_node.log()),
                   what="the dropped field logged")
        sim_node.prepare_ok(refs[1])
        assert sim_node.unprepare(*refs) == {r.uid: None for r in refs}
        assert all(entries(sim_node, r) == [] for r in refs)
        assert len([e for e in sim_node.log() if "DRAResourceClaimDeviceStatus" in str(e.get("msg"))]) == 1
        assert len([r for r in sim_node.api.requests if r[0] == "PATCH"]) == 1, "left alone after the first write"
    finally:
        sim_node.close()


def test_a_limit_the_driver_restored_shows_in_the_claims_status() -> None:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="mixed")
    try:
        sim_node.start()
        sim_node.wait_for_devices(["gpu-0-ts-0", "gpu-0-ts-1", "gpu-1-mig-3g40gb-0", MIG, "gpu-1-mig-1g10gb-6",
                                   "gpu-2-mps-0", "gpu-2-mps-1"])
        ref = sim_node.claim("victim", [("gpu", "gpu-2-mps-0")])
        sim_node.prepare_ok(ref)
        [before] = wait_ready(sim_node, ref)
        assert "limitsRestored" not in before["data"]["sharing"]
        [daemon] = sim_node.checkpoint()["mps_daemons"].values()
        assert tenant(sim_node, daemon["pipe_dir"], "set_default_active_thread_percentage 100").returncode == 0
        wait_until(lambda: entries(sim_node, ref)[0]["data"]["sharing"].get("limitsRestored") == 1, timeout=30,
                   what="the restored limit in the claim's status")
        after = entries(sim_node, ref)[0]["data"]["sharing"]
        assert after["activeThreadPercentage"] == 25 and after["lastLimitsRestore"]
        assert conditions(entries(sim_node, ref)[0]) == {"Ready": "True", "Healthy": "True"}
    finally:
        sim_node.close()


def test_a_mig_instance_created_for_the_claim_shows_its_uuid() -> None:
    plans = {"defaultPlan": "p", "plans": {"p": {"gpus": [{"match": {"minor": 0}, "dynamicMig": {}}]}}}
    with mignode.dynamic_mig_node(plans) as sim_node:
        sim_node.start()
        wait_until(lambda: "gpu-0-dynmig-3g40gb-4" in sim_node.device_names(), 30, "the dynamic MIG placements")
        ref = sim_node.claim("c", [("mig", "gpu-0-dynmig-3g40gb-4")])
        sim_node.prepare_ok(ref)
        [gi] = mignode.instances(sim_node)
        [entry] = wait_ready(sim_node, ref)
        assert entry["data"]["migUUID"] == gi["uuid"] and entry["data"]["migCreatedForClaim"] is True
        assert entry["data"]["gpuUUID"] == gpu_uuid(sim_node, 0) and entry["data"]["migProfile"] == "3g.40gb"
        assert sim_node.unprepare(ref) == {ref.uid: None}
        wait_until(lambda: entries(sim_node, ref) == [], what="the entry removed with the instance")
