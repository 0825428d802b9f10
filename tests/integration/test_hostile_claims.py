"""Hostile claims through the real driver process, the kubelet stand-in and the API server double.

A claim within the API server's limits (32 configs of 10 KiB each) must be refused with a short per-claim
error, and the kubelet request it comes in must still be answered for every claim.
"""

from __future__ import annotations

from typing import Any

from tests.support.node import DRIVER, SimulatedNode
from tests.unit.test_hostile_claims import CONFIGS_MAX, ERROR_MAX_BYTES, REQUESTS, unknown_fields_config


def hostile_config() -> dict[str, Any]:
    return {"source": "FromClaim", "requests": REQUESTS,
            "opaque": {"driver": DRIVER, "parameters": unknown_fields_config()}}


def test_a_claim_of_hostile_configs_is_refused_shortly_and_the_request_is_answered(node: SimulatedNode) -> None:
    node.start()
    hostile = node.claim("hostile", [(REQUESTS[0], "gpu-0")], configs=[hostile_config()] * CONFIGS_MAX)
    innocent = node.claim("innocent", [("gpu", "gpu-2")])
    # Before the fix the answer was ~100 MB and the kubelet's gRPC client refused it (RESOURCE_EXHAUSTED):
    # no claim of the request got an answer.
    answers = node.prepare(hostile, innocent)
    error = answers[hostile.uid].error or ""
    assert error.startswith("invalid opaque configuration: claim config #1 (requests: ["), error[:300]
    assert len(error.encode()) <= ERROR_MAX_BYTES, f"the claim's error is {len(error.encode())} bytes"
    assert error.splitlines()[-1].startswith("... and ")
    assert answers[innocent.uid].error is None
    assert [d.device_name for d in answers[innocent.uid].devices] == ["gpu-2"]
    assert hostile.uid not in node.checkpoint()["claims"]
