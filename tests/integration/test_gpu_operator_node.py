"""The real driver process on a simulated GPU Operator node: hostPath device nodes, the operator's spec, readiness."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest

from tests.support.node import SimulatedNode, wait_until


@pytest.fixture
def operator_node() -> Iterator[SimulatedNode]:
    n = SimulatedNode("gpu-operator")
    try:
        yield n
    finally:
        n.close()


def _readyz(base: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"{base}/readyz", timeout=10) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.read().decode()


def test_claims_on_a_gpu_operator_node_and_readiness_without_libraries(operator_node: SimulatedNode) -> None:
    sim_node = operator_node
    sim_node.start()
    sim_node.wait_for_devices(["gpu-0", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6", "gpu-2"])
    # The devices are published a moment before "driver started" is logged: wait for the line, do not assume it.
    wait_until(lambda: any(e.get("msg") == "driver started" for e in sim_node.log()), what="the driver started line")
    started = next(e for e in sim_node.log() if e.get("msg") == "driver started")
    base = f"http://127.0.0.1:{started['http_port']}"
    wait_until(lambda: _readyz(base)[0] == 200, what="ready with the operator's toolkit spec found in the CDI root")

    ref = sim_node.claim("whole-and-mig", [("a", "gpu-0"), ("b", "gpu-1-mig-1g10gb-6")])
    sim_node.prepare_ok(ref)
    spec = json.loads(sim_node.cdi_spec(ref.uid).read_text())
    gpu0 = spec["devices"][0]["containerEdits"]["deviceNodes"]
    assert gpu0 == [{"path": "/dev/nvidia0", "hostPath": "/run/nvidia/driver/dev/nvidia0"}]
    assert all(n["hostPath"] == "/run/nvidia/driver" + n["path"]
               for d in spec["devices"] for n in d["containerEdits"]["deviceNodes"])
    assert any(m["hostPath"].startswith("/run/nvidia/driver/usr/lib/") and "libcuda.so" in m["hostPath"]
               for m in spec["containerEdits"]["mounts"])

    # The operator's toolkit spec goes away (toolkit pod removed): the node stops being ready, says
    # why in the log, and claims fail with the reason instead of starting containers without CUDA.
    sim_node.sim_host.toolkit_spec.unlink()
    wait_until(lambda: _readyz(base)[0] == 503, what="not ready without driver libraries")
    _status, body = _readyz(base)
    assert "driver libraries" in body and "/run" not in body and "/var" not in body
    assert any("no usable driver libraries" in e.get("msg", "") for e in sim_node.log())
    failed = sim_node.prepare(sim_node.claim("after", [("a", "gpu-2")]))
    assert any("no usable driver libraries" in (a.error or "") for a in failed.values())
