"""Who may share an MPS daemon, through the real driver process, the kubelet stand-in and the API server double.

Under ``clients: nonRoot`` (the plan's default) a claim is prepared only if every consumer it is
reserved for is a pod that meets Pod Security "baseline" and cannot run as root or group root;
anything else (a root pod, no pod, a consumer that is not a core Pod, a pod under another UID) is
refused before anything starts, with one line naming the pod, the container, the field and the
rule. A plan entry with ``clients: any`` admits every claim and its devices say ``mps-advisory``.
The pods are read on every prepare, so a claim already prepared is refused when the kubelet sends
it again with a root pod reserved.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from driver.kubeletplugin.types import ClaimRef
from tests.support.node import NO_ESCALATION, NON_ROOT, SimulatedNode, pod

# The demo node: gpu-0 an H100 (whole), gpu-1 MIG, gpu-2 an L4.
PLANS: dict[str, Any] = {"plans": {"tenants": {"gpus": [
    {"match": {"minor": 0}, "mps": {"shares": 2, "clients": "any"}},
    {"match": {"product": "NVIDIA L4"}, "mps": {"shares": 4}},  # clients: nonRoot, the default
]}}}
MIG = ["gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6"]
DEVICES = ["gpu-0-mps-0", "gpu-0-mps-1", *MIG, *(f"gpu-2-mps-{k}" for k in range(4))]
SHARED_RULE = ('the MPS daemon shared with other claims on gpu-2 admits only pods that meet Pod Security "baseline" '
               "and cannot run as root or group root (clients: nonRoot)")
ROOT_REFUSAL = (
    'pod default/train-0 container "main": spec.containers[0].securityContext.runAsNonRoot is not true here or in '
    'spec.securityContext; Pod Security "restricted" requires true (without it the image\'s user decides, and that '
    f"may be root) (2 more findings); {SHARED_RULE}; set securityContext.runAsNonRoot: true on the pod or container, "
    "or use a share whose plan sets clients: any")


@pytest.fixture
def sim_node() -> Iterator[SimulatedNode]:
    n = SimulatedNode("demo", plans=PLANS, plan="tenants")
    try:
        n.start()
        n.wait_for_devices(DEVICES)
        yield n
    finally:
        n.close()


def daemon_starts(sim_node: SimulatedNode) -> list[int]:
    return [e["pid"] for e in sim_node.journal() if e.get("event") == "start"]


def attributes(sim_node: SimulatedNode, name: str) -> dict[str, Any]:
    attrs: dict[str, Any] = next(d for d in sim_node.devices() if d["name"] == name)["attributes"]
    return attrs


def test_a_root_pod_is_refused_a_shared_daemon_and_a_non_root_pod_gets_it(sim_node: SimulatedNode) -> None:
    assert attributes(sim_node, "gpu-2-mps-0")["memoryLimitEnforcement"] == {"string": "mps-per-process"}
    assert attributes(sim_node, "gpu-2-mps-0")["computeLimitEnforcement"] == {"string": "mps-per-process"}

    root = sim_node.claim("root-share", [("share", "gpu-2-mps-0")], pods=[pod("train-0")])
    assert sim_node.prepare(root)[root.uid].error == ROOT_REFUSAL
    assert daemon_starts(sim_node) == [], "refused before any daemon started"
    assert sim_node.cdi_files() == []
    assert root.uid not in sim_node.checkpoint()["claims"]
    assert [p.name for p in (sim_node.state_dir / "mps").glob("plan-*")] == []

    tenant = sim_node.claim("tenant-share", [("share", "gpu-2-mps-1")],
                            pods=[pod("eval-0", pod_security={"runAsNonRoot": True},
                                      containers=[("main", {"runAsUser": 1000, "runAsGroup": 1000,
                                                            "allowPrivilegeEscalation": False})])])
    assert sim_node.prepare_ok(tenant).devices[0].device_name == "gpu-2-mps-1"
    record = sim_node.checkpoint()["claims"][tenant.uid]
    assert (record["mps_clients"], record["mps_enforcement"]) == ("nonRoot", "mps-per-process")
    shown = subprocess.run(sim_node.inspect_args(), capture_output=True, text=True, timeout=60)
    assert "mps clients nonRoot: limits mps-per-process" in shown.stdout, shown.stdout + shown.stderr
    [daemon] = daemon_starts(sim_node)

    # The kubelet sends the prepared claim again (after its restart) with a second, root pod reserved.
    sim_node.reserve(tenant, pod("debug-0", pod_security=NON_ROOT, containers=[
        ("main", NO_ESCALATION), ("shell", {"runAsUser": 0, **NO_ESCALATION})]))
    error = sim_node.prepare(tenant)[tenant.uid].error or ""
    assert error == ('pod default/debug-0 container "shell": spec.containers[1].securityContext.runAsUser: 0 is not '
                     f'allowed by Pod Security "restricted" (it runs as root); {SHARED_RULE}; set a non-zero '
                     "runAsUser, or use a share whose plan sets clients: any"), error
    assert "\n" not in error
    # The claim stays prepared for the pod already running with it.
    assert sim_node.checkpoint()["claims"][tenant.uid]["phase"] == "PrepareCompleted"
    assert daemon_starts(sim_node) == [daemon]
    assert sim_node.unprepare(tenant) == {tenant.uid: None}


def test_a_share_whose_plan_admits_any_client_is_prepared_for_root_and_said_to_be_advisory(
        sim_node: SimulatedNode) -> None:
    attrs = attributes(sim_node, "gpu-0-mps-0")
    assert attrs["memoryLimitEnforcement"] == {"string": "mps-advisory"}
    assert attrs["computeLimitEnforcement"] == {"string": "mps-advisory"}

    ref = sim_node.claim("any-share", [("share", "gpu-0-mps-0")],
                         pods=[pod("train-0", hostPID=True, volumes=[{"name": "sock", "hostPath": {"path": "/"}}])])
    assert sim_node.prepare_ok(ref).devices[0].device_name == "gpu-0-mps-0"
    record = sim_node.checkpoint()["claims"][ref.uid]
    assert (record["mps_clients"], record["mps_enforcement"]) == ("any", "mps-advisory")
    # Nor does it ask who the consumer is.
    other = sim_node.claim("any-share-deployment", [("share", "gpu-0-mps-1")], pods=())
    set_reserved_for(sim_node, other, [{"apiGroup": "apps", "resource": "deployments", "name": "web", "uid": "w"}])
    assert sim_node.prepare_ok(other).devices[0].device_name == "gpu-0-mps-1"
    assert [r for r in sim_node.api.requests if "/pods/" in r[1]] == []
    assert sim_node.unprepare(ref, other) == {ref.uid: None, other.uid: None}


def test_a_claim_without_mps_reads_no_pod(sim_node: SimulatedNode) -> None:
    ref = sim_node.claim("mig", [("gpu", MIG[2])], pods=[pod("train-0")])
    sim_node.prepare_ok(ref)
    assert [r for r in sim_node.api.requests if "/pods/" in r[1]] == []
    assert sim_node.unprepare(ref) == {ref.uid: None}


def set_reserved_for(sim_node: SimulatedNode, ref: ClaimRef, entries: list[dict[str, Any]]) -> None:
    """Write ``status.reservedFor`` as given (what a buggy or forged controller could have written)."""
    claim = next(c for c in sim_node.api.claims() if c["metadata"]["uid"] == ref.uid)
    claim.setdefault("status", {})["reservedFor"] = entries
    sim_node.api.put_claim(claim)


def put_pod(sim_node: SimulatedNode, body: dict[str, Any]) -> dict[str, Any]:
    stored: dict[str, Any] = sim_node.api.put_pod({**body, "metadata": {**body["metadata"], "namespace": "default"}})
    return stored


def test_a_non_root_share_refuses_every_consumer_it_cannot_vouch_for_and_admits_a_restricted_pod(
        sim_node: SimulatedNode) -> None:
    evil = put_pod(sim_node, pod("evil"))  # no securityContext: the image's root user
    benign = put_pod(sim_node, pod("benign", pod_security=NON_ROOT, containers=[("main", NO_ESCALATION)]))
    fix = "or use a share whose plan sets clients: any"
    attacks: list[tuple[str, list[dict[str, Any]], str]] = [
        ("no consumer", [], f"the claim is reserved for no pod (status.reservedFor is empty); {SHARED_RULE}; "
                            f"reserve the claim for the pod that uses it, {fix}"),
        ("a deployment", [{"apiGroup": "apps", "resource": "deployments", "name": "web", "uid": "uid-web"}],
         'status.reservedFor[0] names "deployments" "web" of API group "apps", not a Pod (API group "", resource '
         f'"pods"), so the pods that would use the claim cannot be checked; {SHARED_RULE}; reserve the claim for the '
         f"pods that use it, not for another object, {fix}"),
        ("a pod of API group core", [{"apiGroup": "core", "resource": "pods", "name": "evil",
                                      "uid": evil["metadata"]["uid"]}],
         'status.reservedFor[0] names "pods" "evil" of API group "core", not a Pod (API group "", resource "pods"), '
         "so the pods that would use the claim cannot be checked"),
        ("benign's name with evil's uid", [{"resource": "pods", "name": "benign", "uid": evil["metadata"]["uid"]}],
         f'status.reservedFor[0] names pod default/benign with uid "{evil["metadata"]["uid"]}", but pod '
         f'default/benign has uid "{benign["metadata"]["uid"]}"; the kubelet matches pods by uid, so the pod that '
         f"would use the claim cannot be checked; {SHARED_RULE}; let status.reservedFor name each pod with its own "
         f"uid, {fix}"),
        ("group root and the runtime's socket", [pod("sock-0", pod_security={**NON_ROOT, "runAsGroup": 0},
                                                     containers=[("main", NO_ESCALATION)],
                                                     volumes=[{"name": "sock", "hostPath": {
                                                         "path": "/run/containerd/containerd.sock"}}])],
         'pod default/sock-0: spec.volumes[0].hostPath is not allowed by Pod Security "baseline" (a host path can '
         'reach host root; this one is "/run/containerd/containerd.sock") (1 more finding)'),
        ("the host's processes", [pod("pid-0", pod_security=NON_ROOT, containers=[("main", NO_ESCALATION)],
                                      hostPID=True)],
         'pod default/pid-0: spec.hostPID: true is not allowed by Pod Security "baseline" (it shares the host\'s '
         f"processes, to see and signal); {SHARED_RULE}; remove spec.hostPID, {fix}"),
    ]
    for what, consumers, refusal in attacks:
        ref = sim_node.claim(f"attack-{len(what)}", [("share", "gpu-2-mps-0")], pods=())
        if consumers and "spec" in consumers[0]:
            sim_node.reserve(ref, consumers[0])
        else:
            set_reserved_for(sim_node, ref, consumers)
        error = sim_node.prepare(ref)[ref.uid].error or ""
        assert error.startswith(refusal), f"{what}: {error}"
        assert "\n" not in error and "()" not in error, what
        assert daemon_starts(sim_node) == [] and sim_node.cdi_files() == [], f"{what}: refused before anything started"
        assert ref.uid not in sim_node.checkpoint()["claims"], what

    restricted = pod("tenant-0", pod_security={**NON_ROOT, "seccompProfile": {"type": "RuntimeDefault"}},
                     containers=[("main", {**NO_ESCALATION, "capabilities": {"drop": ["ALL"]}})])
    ref = sim_node.claim("tenant", [("share", "gpu-2-mps-0")], pods=[restricted])
    assert sim_node.prepare_ok(ref).devices[0].device_name == "gpu-2-mps-0"
    assert len(daemon_starts(sim_node)) == 1
    assert sim_node.unprepare(ref) == {ref.uid: None}
