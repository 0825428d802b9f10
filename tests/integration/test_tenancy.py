"""Who may share an MPS daemon, through the real driver process, the kubelet stand-in and the API server double.

Issue 12, "Done when" (d): under ``clients: nonRoot`` (the plan's default) a claim whose pod could run
as host root is refused before anything starts, with one line naming the pod, the container and the
field to set; a non-root pod is prepared; a plan entry with ``clients: any`` is prepared and its
devices say ``mps-advisory``. The pods are read on every prepare, so a claim already prepared is
refused when the kubelet sends it again with a root pod reserved.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support.node import NO_ESCALATION, SimulatedNode, pod

# The demo node: gpu-0 an H100 (whole), gpu-1 MIG, gpu-2 an L4.
PLANS: dict[str, Any] = {"plans": {"tenants": {"gpus": [
    {"match": {"minor": 0}, "mps": {"shares": 2, "clients": "any"}},
    {"match": {"product": "NVIDIA L4"}, "mps": {"shares": 4}},  # clients: nonRoot, the default
]}}}
MIG = ["gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6"]
DEVICES = ["gpu-0-mps-0", "gpu-0-mps-1", *MIG, *(f"gpu-2-mps-{k}" for k in range(4))]
ROOT_REFUSAL = (
    'pod default/train-0 container "main" may run as root (no runAsNonRoot: true or non-zero runAsUser at pod or '
    "container level), so it could control the MPS daemon shared with other claims on gpu-2; set "
    "securityContext.runAsNonRoot: true or runAsUser: <non-zero> on the pod or container, or use a share whose "
    "plan sets clients: any")


@pytest.fixture
def node() -> Iterator[SimulatedNode]:
    n = SimulatedNode("demo", plans=PLANS, plan="tenants")
    try:
        n.start()
        n.wait_for_devices(DEVICES)
        yield n
    finally:
        n.close()


def daemon_starts(node: SimulatedNode) -> list[int]:
    return [e["pid"] for e in node.journal() if e.get("event") == "start"]


def attributes(node: SimulatedNode, name: str) -> dict[str, Any]:
    attrs: dict[str, Any] = next(d for d in node.devices() if d["name"] == name)["attributes"]
    return attrs


def test_a_root_pod_is_refused_a_shared_daemon_and_a_non_root_pod_gets_it(node: SimulatedNode) -> None:
    assert attributes(node, "gpu-2-mps-0")["memoryLimitEnforcement"] == {"string": "mps-per-process"}
    assert attributes(node, "gpu-2-mps-0")["computeLimitEnforcement"] == {"string": "mps-per-process"}

    root = node.claim("root-share", [("share", "gpu-2-mps-0")], pods=[pod("train-0")])
    assert node.prepare(root)[root.uid].error == ROOT_REFUSAL
    assert daemon_starts(node) == [], "refused before any daemon started"
    assert node.cdi_files() == []
    assert root.uid not in node.checkpoint()["claims"]
    assert [p.name for p in (node.state_dir / "mps").glob("plan-*")] == []

    tenant = node.claim("tenant-share", [("share", "gpu-2-mps-1")],
                        pods=[pod("eval-0", pod_security={"runAsNonRoot": True},
                                  containers=[("main", {"runAsUser": 1000, "allowPrivilegeEscalation": False})])])
    assert node.prepare_ok(tenant).devices[0].device_name == "gpu-2-mps-1"
    record = node.checkpoint()["claims"][tenant.uid]
    assert (record["mps_clients"], record["mps_enforcement"]) == ("nonRoot", "mps-per-process")
    shown = subprocess.run(node.inspect_args(), capture_output=True, text=True, timeout=60)
    assert "mps clients nonRoot: limits mps-per-process" in shown.stdout, shown.stdout + shown.stderr
    [daemon] = daemon_starts(node)

    # The kubelet sends the prepared claim again (after its restart) with a second, root pod reserved.
    node.reserve(tenant, pod("debug-0", pod_security={"runAsUser": 1000}, containers=[
        ("main", NO_ESCALATION), ("shell", {"runAsUser": 0, **NO_ESCALATION})]))
    error = node.prepare(tenant)[tenant.uid].error or ""
    assert error.startswith('pod default/debug-0 container "shell" may run as root (runAsUser: 0 at container '
                            "level), so it could control the MPS daemon shared with other claims on gpu-2; "
                            "set securityContext.runAsUser: <non-zero> on the pod or container"), error
    assert "\n" not in error
    # The claim stays prepared for the pod already running with it.
    assert node.checkpoint()["claims"][tenant.uid]["phase"] == "PrepareCompleted"
    assert daemon_starts(node) == [daemon]
    assert node.unprepare(tenant) == {tenant.uid: None}


def test_a_share_whose_plan_admits_any_client_is_prepared_for_root_and_said_to_be_advisory(
        node: SimulatedNode) -> None:
    attrs = attributes(node, "gpu-0-mps-0")
    assert attrs["memoryLimitEnforcement"] == {"string": "mps-advisory"}
    assert attrs["computeLimitEnforcement"] == {"string": "mps-advisory"}

    ref = node.claim("any-share", [("share", "gpu-0-mps-0")], pods=[pod("train-0")])
    assert node.prepare_ok(ref).devices[0].device_name == "gpu-0-mps-0"
    record = node.checkpoint()["claims"][ref.uid]
    assert (record["mps_clients"], record["mps_enforcement"]) == ("any", "mps-advisory")
    assert node.unprepare(ref) == {ref.uid: None}


def test_a_claim_without_mps_reads_no_pod(node: SimulatedNode) -> None:
    ref = node.claim("mig", [("gpu", MIG[2])], pods=[pod("train-0")])
    node.prepare_ok(ref)
    assert [r for r in node.api.requests if "/pods/" in r[1]] == []
    assert node.unprepare(ref) == {ref.uid: None}
