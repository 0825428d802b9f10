"""The driver process registers with the kubelet and publishes the node's devices."""

from __future__ import annotations

import os
import subprocess

from driver.kubeletplugin.liveness import check_plugin
from tests.support.kubeletplugin import ServedElsewhere
from tests.support.node import DRIVER, NODE, SimulatedNode, wait_until

DEMO_DEVICES = ["gpu-0", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6", "gpu-2"]


def test_registers_v1_first_and_publishes_every_gpu_and_mig_instance(sim_node: SimulatedNode) -> None:
    sim_node.start()
    plugin = sim_node.kubelet.wait_for_plugin(DRIVER, timeout=5)
    assert plugin.supported_versions[0] == "v1.DRAPlugin"
    assert plugin.api_version == "v1.DRAPlugin"
    assert plugin.endpoint == str(sim_node.state_dir / "dra.sock")
    sim_node.wait_for_devices(DEMO_DEVICES)
    [slice_] = sim_node.api.slices(DRIVER, NODE)
    assert slice_["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    assert slice_["metadata"]["ownerReferences"][0]["kind"] == "Node"
    by_name = {d["name"]: d for d in sim_node.devices()}
    gpu0 = by_name["gpu-0"]["attributes"]
    assert gpu0["type"] == {"string": "gpu"}
    assert gpu0["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert gpu0["cudaComputeCapability"] == {"version": "9.0.0"}
    assert gpu0["driverVersion"] == {"version": "580.95.5"}
    mig = by_name["gpu-1-mig-1g10gb-6"]["attributes"]
    assert mig["type"] == {"string": "mig"} and mig["profile"] == {"string": "1g.10gb"}
    assert "gpu-1" not in by_name, "a MIG-enabled GPU is published only as its MIG instances"
    ok, detail = check_plugin(ServedElsewhere(DRIVER, sim_node.work / "reg" / f"{DRIVER}-reg.sock",
                                              sim_node.state_dir / "dra.sock"))
    assert ok, detail


def test_pod_uid_sockets_for_rolling_updates(sim_node: SimulatedNode) -> None:
    sim_node.start("--pod-uid", "1234-abcd")
    plugin = sim_node.kubelet.wait_for_plugin(DRIVER, timeout=5)
    assert plugin.registration_socket.name == f"{DRIVER}-1234-abcd-reg.sock"
    assert plugin.endpoint.endswith("dra-1234-abcd.sock")
    assert sim_node.stop() == 0
    assert not plugin.registration_socket.exists(), "a stopping pod removes its own sockets"


def test_registration_refused_by_the_kubelet_exits_non_zero(sim_node: SimulatedNode) -> None:
    sim_node.start(register=False)
    sim_node.kubelet.wait_for_plugin(DRIVER, timeout=30, reject_with="plugin validation failed: test says no")
    assert sim_node.proc is not None
    assert sim_node.proc.wait(timeout=20) == 1
    assert any("refused" in str(e.get("msg")) and "test says no" in str(e) for e in sim_node.log())


def test_slices_are_recreated_after_the_kubelet_wipes_them(sim_node: SimulatedNode) -> None:
    sim_node.start()
    sim_node.wait_for_devices(DEMO_DEVICES)
    assert sim_node.api.wipe_slices(NODE) == 1
    sim_node.wait_for_devices(DEMO_DEVICES)


def test_server_rejection_is_retried_with_backoff_not_a_hot_loop(sim_node: SimulatedNode) -> None:
    sim_node.api.reject_next_slice_writes(3, "admission webhook denied the request", status=422, reason="Invalid")
    sim_node.start()
    sim_node.wait_for_devices(DEMO_DEVICES, timeout=30)
    creates = [r for r in sim_node.api.requests if r[0] == "POST" and r[1].endswith("/resourceslices")]
    assert 4 <= len(creates) <= 6, creates
    assert any("admission webhook denied the request" in str(e) for e in sim_node.log())


def test_metrics_and_health_endpoints(sim_node: SimulatedNode) -> None:
    import json
    import urllib.request

    sim_node.start()
    sim_node.wait_for_devices(DEMO_DEVICES)
    # Devices are published a moment before "driver started" is logged: wait for the line.
    wait_until(lambda: any(e.get("msg") == "driver started" for e in sim_node.log()), what="the driver started line")
    started = next(e for e in sim_node.log() if e.get("msg") == "driver started")
    base = f"http://127.0.0.1:{started['http_port']}"
    assert urllib.request.urlopen(f"{base}/healthz", timeout=10).status == 200
    wait_until(lambda: urllib.request.urlopen(f"{base}/readyz", timeout=10).status == 200, what="ready")
    ref = sim_node.claim("c1", [("gpu", "gpu-0")])
    sim_node.prepare_ok(ref)
    metrics = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    assert 'tessera_prepare_claims_total{' in metrics and 'result="success"' in metrics
    assert "tessera_prepare_claim_duration_seconds_bucket" in metrics
    assert "tessera_prepared_claims" in metrics and "tessera_published_devices" in metrics
    outcome = [e for e in sim_node.log() if e.get("claim_uid") == ref.uid]
    assert outcome, "log lines carry the claim UID"
    json.dumps(outcome)


def test_slices_follow_a_hardware_change() -> None:
    import tempfile
    from pathlib import Path

    layout = Path(tempfile.mkdtemp(prefix="tsl-", dir="/tmp")) / "node.yaml"
    layout.write_text("gpus:\n  - model: H100-80GB\n  - model: L4\n")
    sim_node = SimulatedNode(str(layout))
    try:
        sim_node.start()
        sim_node.wait_for_devices(["gpu-0", "gpu-1"])
        generation = sim_node.api.slices(DRIVER, NODE)[0]["spec"]["pool"]["generation"]
        # SIMULATION of an operator enabling MIG on gpu-0 and creating two instances.
        layout.write_text("gpus:\n  - model: H100-80GB\n    mig:\n      - {profile: 3g.40gb, start: 0}\n"
                          "      - {profile: 3g.40gb, start: 4}\n  - model: L4\n")
        sim_node.wait_for_devices(["gpu-0-mig-3g40gb-0", "gpu-0-mig-3g40gb-4", "gpu-1"])
        assert sim_node.api.slices(DRIVER, NODE)[0]["spec"]["pool"]["generation"] >= generation
    finally:
        sim_node.close()
        layout.unlink()
        layout.parent.rmdir()


def test_startup_problems_exit_with_one_clear_line(sim_node: SimulatedNode) -> None:
    code, output = sim_node.run_to_exit("--kubeconfig", str(sim_node.work / "missing-kubeconfig"))
    assert code == 1 and "tessera: cannot use kubeconfig" in output and "Traceback" not in output
    code, output = sim_node.run_to_exit("--simulate", "no-such-layout")
    assert code == 2 and "--simulate 'no-such-layout': unknown simulated layout" in output  # a usage error
    assert "Traceback" not in output
    code, output = sim_node.run_to_exit("--node-name", "")
    assert code == 2 and "python -m driver run: the node name is required" in output  # a usage error
    assert not list((sim_node.work / "reg").glob("*.sock")), "nothing was served"


def test_relative_paths_are_resolved_against_the_working_directory_at_start(sim_node: SimulatedNode) -> None:
    # Every path flag relative, run from the node's directory: the driver registers, with absolute sockets.
    cdi = os.path.relpath(sim_node.cdi_dir, sim_node.work)
    sim_node.env = sim_node._environment(None)
    with open(sim_node.log_path, "ab") as log:
        sim_node.proc = subprocess.Popen(sim_node.args("--plugins-dir", "plugins", "--registrar-dir", "reg",
                                                       "--cdi-root", cdi,
                                                       "--kubeconfig", os.path.relpath(sim_node.kubeconfig,
                                                                                       sim_node.work)),
                                         cwd=sim_node.work, stdout=log, stderr=subprocess.STDOUT, env=sim_node.env)
    plugin = sim_node.kubelet.wait_for_plugin(DRIVER, timeout=30)
    assert plugin.endpoint == str(sim_node.state_dir / "dra.sock")
    sim_node.wait_for_devices(DEMO_DEVICES)
    assert "Traceback" not in sim_node.log_path.read_text()
