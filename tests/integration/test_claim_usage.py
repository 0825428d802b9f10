"""Per-claim GPU usage from simulated processes: metrics through /metrics, the log line, and inspect."""

from __future__ import annotations

import json
import subprocess
import uuid
from pathlib import Path
from typing import Any

from driver.kubeletplugin.types import ClaimRef
from tests.integration.test_health import gpu_uuid, metrics
from tests.support.node import DRIVER, NO_ESCALATION, NODE, NON_ROOT, SimulatedNode, wait_until
from tests.support.node import pod as pod_object

PLANS: dict[str, Any] = {"plans": {"ts": {"gpus": [
    {"match": {"product": "NVIDIA L4"}, "timeSlicing": {"shares": 2, "interval": "Long"}}]}, "mps": {"gpus": [
    {"match": {"product": "NVIDIA L4"}, "mps": {"shares": 2, "pinnedMemoryLimit": "4Gi"}}]}}}
GIB = 1 << 30


def reserved_claim(sim_node: SimulatedNode, name: str, device: str, pod_uid: str, admin: bool = False) -> ClaimRef:
    """A claim allocated to ``device`` and reserved for one pod (one that a ``clients: nonRoot`` share admits),
    as the scheduler leaves it."""
    uid = str(uuid.uuid4())
    sim_node.api.put_pod(pod_object(f"{name}-pod", pod_security=NON_ROOT, containers=[("main", NO_ESCALATION)])
                         | {"metadata": {"name": f"{name}-pod", "namespace": "team-a", "uid": pod_uid}})
    result: dict[str, Any] = {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}
    if admin:
        result["adminAccess"] = True
    sim_node.api.put_claim({
        "metadata": {"name": name, "namespace": "team-a", "uid": uid}, "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": [result], "config": []}},
            "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": pod_uid}]}})
    return ClaimRef(namespace="team-a", name=name, uid=uid)


def _start(sim_node: SimulatedNode, processes: Path, share: str) -> None:
    """Start the driver reading simulated GPU processes from ``processes``; the L4 shared as ``share``."""
    sim_node.start(env={"TESSERA_SIM_PROCESSES": str(processes)})
    sim_node.wait_for_devices(["gpu-0", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6",
                               f"gpu-2-{share}-0", f"gpu-2-{share}-1"], timeout=30)


def test_usage_of_a_time_sliced_claim_is_metered_and_going_over_its_entitlement_is_reported() -> None:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="ts")
    processes = sim_node.work / "processes.json"
    try:
        _start(sim_node, processes, "ts")
        pod, other_pod = str(uuid.uuid4()), str(uuid.uuid4())
        sim_node.prepare_ok(reserved_claim(sim_node, "train", "gpu-2-ts-0", pod))
        l4 = gpu_uuid(sim_node, 2)
        # The demo's L4 has 24 GB: a share of two is entitled to half; the claim's pod uses 20 GiB.
        processes.write_text(json.dumps([
            {"uuid": l4, "pid": 4242, "pod_uid": pod, "memory_bytes": 20 * GIB, "sm_percent": 35},
            {"uuid": l4, "pid": 5151, "pod_uid": other_pod, "memory_bytes": GIB}]))
        labels = (("claim", "train"), ("device", "gpu-2-ts-0"), ("enforced", "false"), ("kind", "timeslice"),
                  ("namespace", "team-a"))
        scraped = metrics(sim_node)
        assert scraped[("tessera_claim_gpu_memory_used_bytes", labels)] == 20 * GIB
        assert scraped[("tessera_claim_gpu_processes", labels)] == 1
        assert scraped[("tessera_claim_gpu_sm_utilization_percent", labels)] == 35
        assert scraped[("tessera_claim_gpu_sm_limit_percent", labels)] == 50
        limit = scraped[("tessera_claim_gpu_memory_limit_bytes", labels)]
        assert 20 * GIB > limit > 0
        assert scraped[("tessera_claim_gpu_over_entitlement", tuple(sorted((*labels, ("resource", "memory")))))] == 1
        assert scraped[("tessera_claim_gpu_over_entitlement", tuple(sorted((*labels, ("resource", "sm")))))] == 0
        wait_until(lambda: any(e.get("msg", "").startswith("a claim's processes use more than") and
                               e.get("claim") == "team-a/train" and e.get("resource") == "memory"
                               for e in sim_node.log()), 5, "the over-entitlement log line")
        shown = subprocess.run(sim_node.inspect_args(), capture_output=True, text=True, timeout=60)
        assert "team-a/train gpu-2-ts-0: memory 20480MiB of" in shown.stdout, shown.stdout + shown.stderr
        assert "OVER ENTITLEMENT (memory)" in shown.stdout
    finally:
        sim_node.close()


def test_mps_clients_memory_is_metered_while_sm_on_mps_and_mig_is_unknown_and_admin_devices_have_no_entitlement(
        ) -> None:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="mps")
    processes = sim_node.work / "processes.json"
    try:
        _start(sim_node, processes, "mps")
        pod, mig_pod, monitor_pod, mps_host_pod = (str(uuid.uuid4()) for _ in range(4))
        sim_node.prepare_ok(reserved_claim(sim_node, "infer", "gpu-2-mps-0", pod))
        sim_node.prepare_ok(reserved_claim(sim_node, "slice", "gpu-1-mig-1g10gb-6", mig_pod))
        sim_node.prepare_ok(reserved_claim(sim_node, "monitor", "gpu-0", monitor_pod, admin=True))
        l4 = gpu_uuid(sim_node, 2)
        [daemon] = [d for d in sim_node.checkpoint()["mps_daemons"].values() if d["spec"]["gpu_uuids"] == [l4]]
        mig_uuid = next(m.uuid for g in sim_node.inventory.gpus for m in g.mig_instances if m.profile == "1g.10gb")
        # As NVML lists MPS: the server (the control daemon's child, in the MPS host's pod) with all the SM
        # work; the client in the MPS list with its own memory and a zero sample. The MIG process too has a
        # zero sample; the admin claim's process uses 60 GiB of the whole GPU it shares.
        processes.write_text(json.dumps([
            {"uuid": gpu_uuid(sim_node, 2), "pid": 4000, "pod_uid": mps_host_pod, "parent_pid": daemon["pid"],
             "memory_bytes": 300 << 20, "sm_percent": 80},
            {"uuid": gpu_uuid(sim_node, 2), "pid": 4242, "pod_uid": pod, "mps_client": True, "memory_bytes": 3 * GIB,
             "sm_percent": 0},
            {"uuid": mig_uuid, "pid": 5151, "pod_uid": mig_pod, "memory_bytes": GIB, "sm_percent": 0},
            {"uuid": gpu_uuid(sim_node, 0), "pid": 6161, "pod_uid": monitor_pod, "memory_bytes": 60 * GIB,
             "sm_percent": 50}]))

        def labels(claim: str, device: str, kind: str, enforced: str, *extra: tuple[str, str]) -> Any:
            return tuple(sorted((("claim", claim), ("device", device), ("enforced", enforced), ("kind", kind),
                                 ("namespace", "team-a"), *extra)))

        scraped = metrics(sim_node)
        infer = labels("infer", "gpu-2-mps-0", "mps", "true")
        assert scraped[("tessera_claim_gpu_memory_used_bytes", infer)] == 3 * GIB
        assert scraped[("tessera_claim_gpu_processes", infer)] == 1  # the server is no claim's
        mig = labels("slice", "gpu-1-mig-1g10gb-6", "mig", "true")
        assert scraped[("tessera_claim_gpu_memory_used_bytes", mig)] == GIB
        monitor = labels("monitor", "gpu-0", "gpu", "false")
        assert scraped[("tessera_claim_gpu_sm_utilization_percent", monitor)] == 50
        for series in (infer, mig):
            assert ("tessera_claim_gpu_sm_utilization_percent", series) not in scraped
            assert ("tessera_claim_gpu_over_entitlement", tuple(sorted((*series, ("resource", "sm"))))) not in scraped
        assert not [k for k in scraped if k[0] in ("tessera_claim_gpu_over_entitlement",
                                                   "tessera_claim_gpu_memory_limit_bytes") and k[1] in
                    (labels("monitor", "gpu-0", "gpu", "false", ("resource", "memory")), monitor)]
        assert not [e for e in sim_node.log() if e.get("msg", "").startswith("a claim's processes use more than")]
        shown = subprocess.run(sim_node.inspect_args(), capture_output=True, text=True, timeout=60)
        out = shown.stdout + shown.stderr
        assert "team-a/infer gpu-2-mps-0: memory 3072MiB of 4096MiB limit, SM unknown (MPS:" in out, out
        assert "team-a/slice gpu-1-mig-1g10gb-6: memory 1024MiB of" in out and "SM unknown (MIG device:" in out, out
        assert "team-a/monitor gpu-0: memory 61440MiB, SM 50%, 1 process(es), admin access: no entitlement" in out
    finally:
        sim_node.close()
