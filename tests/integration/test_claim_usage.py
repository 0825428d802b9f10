"""Per-claim GPU usage from simulated processes: metrics through /metrics, the log line, and inspect."""

from __future__ import annotations

import json
import subprocess
import uuid
from typing import Any

from driver.kubeletplugin.types import ClaimRef
from tests.integration.test_health import gpu_uuid, metrics
from tests.support.node import DRIVER, NODE, SimulatedNode, wait_until

PLANS: dict[str, Any] = {"plans": {"ts": {"gpus": [
    {"match": {"product": "NVIDIA L4"}, "timeSlicing": {"shares": 2, "interval": "Long"}}]}}}
GIB = 1 << 30


def reserved_claim(node: SimulatedNode, name: str, device: str, pod_uid: str) -> ClaimRef:
    """A claim allocated to ``device`` and reserved for one pod, as the scheduler leaves it."""
    uid = str(uuid.uuid4())
    node.api.put_claim({
        "metadata": {"name": name, "namespace": "team-a", "uid": uid}, "spec": {"devices": {"requests": []}},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": DRIVER, "pool": NODE, "device": device}], "config": []}},
            "reservedFor": [{"resource": "pods", "name": f"{name}-pod", "uid": pod_uid}]}})
    return ClaimRef(namespace="team-a", name=name, uid=uid)


def test_usage_of_a_time_sliced_claim_is_metered_and_going_over_its_entitlement_is_reported() -> None:
    node = SimulatedNode("demo", plans=PLANS, plan="ts")
    processes = node.work / "processes.json"
    try:
        node.start(env={"TESSERA_SIM_PROCESSES": str(processes)})
        node.wait_for_devices(["gpu-0", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6",
                               "gpu-2-ts-0", "gpu-2-ts-1"], timeout=30)
        pod, other_pod = str(uuid.uuid4()), str(uuid.uuid4())
        node.prepare_ok(reserved_claim(node, "train", "gpu-2-ts-0", pod))
        l4 = gpu_uuid(node, 2)
        # The demo's L4 has 24 GB: a share of two is entitled to half; the claim's pod uses 20 GiB.
        processes.write_text(json.dumps([
            {"uuid": l4, "pid": 4242, "pod_uid": pod, "memory_bytes": 20 * GIB, "sm_percent": 35},
            {"uuid": l4, "pid": 5151, "pod_uid": other_pod, "memory_bytes": GIB}]))
        labels = (("claim", "train"), ("device", "gpu-2-ts-0"), ("enforced", "false"), ("kind", "timeslice"),
                  ("namespace", "team-a"))
        scraped = metrics(node)
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
                               for e in node.log()), 5, "the over-entitlement log line")
        shown = subprocess.run(node.inspect_args(), capture_output=True, text=True, timeout=60)
        assert "team-a/train gpu-2-ts-0: memory 20480MiB of" in shown.stdout, shown.stdout + shown.stderr
        assert "OVER ENTITLEMENT (memory)" in shown.stdout
    finally:
        node.close()
