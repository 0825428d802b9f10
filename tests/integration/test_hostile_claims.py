"""Hostile claims through the real driver process, the kubelet stand-in and the API server double.

A claim within the API server's limits (32 configs of 10 KiB each) must be refused with a short per-claim
error, and the kubelet request it comes in must still be answered for every claim.
"""

from __future__ import annotations

from typing import Any

from tests.support.node import DRIVER, SimulatedNode
from tests.unit.gpu.claimconfig.test_hostile_claims import CONFIGS_MAX, ERROR_MAX_BYTES, REQUESTS, unknown_fields_config


def hostile_config() -> dict[str, Any]:
    return {"source": "FromClaim", "requests": REQUESTS,
            "opaque": {"driver": DRIVER, "parameters": unknown_fields_config()}}


def test_a_claim_of_hostile_configs_is_refused_shortly_and_the_request_is_answered(sim_node: SimulatedNode) -> None:
    sim_node.start()
    hostile = sim_node.claim("hostile", [(REQUESTS[0], "gpu-0")], configs=[hostile_config()] * CONFIGS_MAX)
    innocent = sim_node.claim("innocent", [("gpu", "gpu-2")])
    # Before the fix the answer was ~100 MB and the kubelet's gRPC client refused it (RESOURCE_EXHAUSTED):
    # no claim of the request got an answer.
    answers = sim_node.prepare(hostile, innocent)
    error = answers[hostile.uid].error or ""
    assert error.startswith("invalid opaque configuration: claim config #1 (requests: ["), error[:300]
    assert len(error.encode()) <= ERROR_MAX_BYTES, f"the claim's error is {len(error.encode())} bytes"
    assert error.splitlines()[-1].startswith("... and ")
    assert answers[innocent.uid].error is None
    assert [d.device_name for d in answers[innocent.uid].devices] == ["gpu-2"]
    assert hostile.uid not in sim_node.checkpoint()["claims"]


def test_a_claim_nested_deeper_than_the_driver_reads_is_told_so(sim_node: SimulatedNode) -> None:
    # The API server keeps opaque parameters of any depth within 10 KiB, another driver's included: the error
    # must point the claim's author at the nesting, not the operator at the cluster's API versions.
    sim_node.start()
    deep: dict[str, Any] = {}
    level = deep
    for _ in range(400):
        level["a"] = {}
        level = level["a"]
    config = {"source": "FromClaim", "requests": [], "opaque": {"driver": "other.example.com", "parameters": deep}}
    claim = sim_node.claim("deep", [("gpu", "gpu-2")], configs=[config])
    error = sim_node.prepare(claim)[claim.uid].error or ""
    assert "nests its JSON deeper than this driver reads" in error and "resource.k8s.io/v1" not in error
    assert claim.uid not in sim_node.checkpoint()["claims"]


FORGED = "I1128 12:00:00.000000 kubelet.go:1] claim prepared"


def test_a_claim_value_with_a_line_break_is_echoed_on_one_line_in_the_kubelets_error_and_the_log(
        sim_node: SimulatedNode) -> None:
    # A raw echo let the value start a line of its own in the pod's events and the log (a text log, or a
    # JSON log read by a tool that prints each field), looking like someone else's: it is quoted and escaped.
    sim_node.start()
    values = {"shmSize": f"64Mi\n{FORGED}", "defaultPinnedDeviceMemoryLimit": f"1Gi\u2028{FORGED}",
              "defaultPerDevicePinnedMemoryLimit": {f"GPU-x\r\n{FORGED}": "1Gi"}}
    for field, value in values.items():
        ref = sim_node.claim(field.lower(), [("gpu", "gpu-0")], configs=[{
            "source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": {
                "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig",
                "sharing": {"strategy": "MPS", "mpsConfig": {field: value}}}}}])
        error = sim_node.prepare(ref)[ref.uid].error or ""
        assert field in error and "I1128" in error, error
        assert not any(line.startswith(FORGED) for line in error.splitlines()), error
        assert "\u2028" not in error and "\r" not in error, error
    logged = [str(v) for entry in sim_node.log() for v in entry.values() if "I1128" in str(v)]
    assert logged, "the refusals are logged"
    assert not any(line.startswith(FORGED) for text in logged for line in text.splitlines()), logged
