"""Crash safety: restarts, kill -9 in the middle of prepare, a lost CDI dir, a corrupt checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from typing import Any

import pytest

from tests.support.mpsdaemons import CONTROL, MpsDaemonKind, daemon_params
from tests.support.node import SimulatedNode, gpu_config, kill_9_while_daemon_starts, pid_alive, wait_until


def test_restart_keeps_prepared_claims(node: SimulatedNode) -> None:
    node.start()
    ref = node.claim("c", [("gpu", "gpu-0")])
    first = node.prepare_ok(ref)
    node.restart()
    assert node.cdi_spec(ref.uid).exists()
    assert node.prepare_ok(ref).devices == first.devices, "the recorded answer, not a new prepare"
    assert node.unprepare(ref) == {ref.uid: None}
    assert node.cdi_files() == []


def test_cdi_specs_lost_in_a_reboot_are_recreated_at_start(node: SimulatedNode) -> None:
    node.start()
    refs = [node.claim("a", [("gpu", "gpu-0")]), node.claim("b", [("mig", "gpu-1-mig-1g10gb-6")])]
    before = {r.uid: json.loads(node.cdi_spec(r.uid).read_text()) for r in refs if node.prepare_ok(r)}
    node.stop()
    for path in node.cdi_dir.iterdir():
        path.unlink()  # /var/run/cdi is a tmpfs: a reboot empties it
    node.start()
    for ref in refs:
        assert json.loads(node.cdi_spec(ref.uid).read_text()) == before[ref.uid]


def test_orphan_cdi_specs_are_removed_at_start(node: SimulatedNode) -> None:
    node.start()
    node.stop()
    orphan = node.cdi_dir / "k8s.gpu.tessera.dev-claim_33333333-3333-3333-3333-333333333333.json"
    node.cdi_dir.mkdir(exist_ok=True)
    orphan.write_text("{}")
    unrelated = node.cdi_dir / "nvidia.yaml"
    unrelated.write_text("cdiVersion: 0.5.0\n")
    node.start()
    assert not orphan.exists()
    assert unrelated.exists(), "other producers' specs are never touched"


def test_kill_9_in_the_middle_of_prepare_is_rolled_back_at_restart(node: SimulatedNode) -> None:
    # The MPS daemon stand-in is told to hang, so prepare blocks while waiting for readiness:
    # the PrepareStarted record and a live daemon exist when the driver is killed.
    node.start(env={"TESSERA_SIM_MPS_FAIL": "hang"})
    ref = node.claim("c", [("gpu", "gpu-0")], configs=[gpu_config(strategy="MPS")])
    daemon_pid = kill_9_while_daemon_starts(node, ref)

    node.restart(env={"TESSERA_SIM_MPS_FAIL": ""})
    wait_until(lambda: not pid_alive(daemon_pid), what="the leaked daemon to be stopped")
    assert ref.uid not in node.checkpoint()["claims"]
    assert node.checkpoint()["mps_daemons"] == {}
    assert node.cdi_files() == []
    assert [p.name for p in (node.state_dir / "mps").glob("claim-*")] == []
    answer = node.prepare_ok(ref)  # the kubelet's retry now succeeds
    assert answer.devices[0].device_name == "gpu-0"
    assert node.unprepare(ref) == {ref.uid: None}


def test_corrupt_checkpoint_is_set_aside_and_state_rebuilt_from_cdi(node: SimulatedNode) -> None:
    node.start()
    ref = node.claim("c", [("gpu", "gpu-2")])
    first = node.prepare_ok(ref)
    node.stop()
    (node.state_dir / "checkpoint.json").write_text('{"version": 1, "checksum": "sha256:00", "data": {"cla')
    node.start()
    assert node.proc is not None and node.proc.poll() is None, "no crash loop"
    assert any("CHECKPOINT CORRUPT" in str(e.get("msg")) for e in node.log())
    assert list(node.state_dir.glob("checkpoint.json.corrupt-*")), "the bad file is kept for inspection"
    assert node.prepare_ok(ref).devices == first.devices
    assert list(node.checkpoint()["claims"]) == [ref.uid]
    assert node.unprepare(ref) == {ref.uid: None}
    assert node.cdi_files() == []


def test_inspect_shows_claims_devices_and_cdi_files(node: SimulatedNode) -> None:
    import subprocess

    node.start()
    ref = node.claim("c", [("mig", "gpu-1-mig-1g10gb-6")])
    node.prepare_ok(ref)
    args = node.inspect_args()
    text = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert "default/c" in text and ref.uid in text and "gpu-1-mig-1g10gb-6" in text
    assert "cdi spec (present)" in text
    report = json.loads(subprocess.run([*args, "--json"], capture_output=True, text=True, check=True).stdout)
    [claim] = report["claims"]
    assert claim["devices"][0]["mig"].startswith("MIG-")
    assert claim["cdi_spec_present"] is True


@pytest.mark.parametrize("lost", ["corrupt", "deleted-after-kill-9"])
def test_a_claims_own_daemon_is_adopted_after_a_rebuild_and_restarted_when_it_dies(node: SimulatedNode,
                                                                                   lost: str) -> None:
    # After a checkpoint rebuilt from the CDI specs, a claim's own MPS daemon (no later prepare needs it) used to
    # have no record: never checked again, never restarted. Its spec now carries its settings. A deleted
    # checkpoint used to be read as empty: the claim's spec was removed and its daemon stopped under it.
    node.start()
    limits = {"defaultActiveThreadPercentage": 40}
    ref = node.claim("c", [("gpu", "gpu-0")], configs=[gpu_config(strategy="MPS", mpsConfig=limits)])
    node.prepare_ok(ref)
    [(daemon_id, daemon)] = node.checkpoint()["mps_daemons"].items()
    if lost == "corrupt":
        node.stop()
        (node.state_dir / "checkpoint.json").write_text('{"version": 1, "checksum": "sha256:00", "data": {"cla')
    else:
        node.kill9()
        (node.state_dir / "checkpoint.json").unlink()
    node.start()
    assert node.cdi_spec(ref.uid).exists(), "the running claim keeps its CDI spec"
    assert node.checkpoint()["mps_daemons"][daemon_id]["pid"] == daemon["pid"], "the live daemon adopted"
    os.kill(daemon["pid"], signal.SIGKILL)
    wait_until(lambda: node.checkpoint()["mps_daemons"][daemon_id]["pid"] != daemon["pid"], 30,
               "the watcher to restart the adopted daemon")
    assert node.unprepare(ref) == {ref.uid: None}
    assert node.checkpoint()["mps_daemons"] == {} and node.cdi_files() == []


# gpu-2 (an L4) in four MPS shares, as in test_mps_limit_watch.py.
MPS_PLANS: dict[str, Any] = {"plans": {"mps": {"gpus": [{"match": {"product": "NVIDIA L4"}, "mps": {
    "shares": 4, "activeThreadPercentage": 25, "pinnedMemoryLimit": "4Gi"}}]}}}


@pytest.mark.parametrize("tenant_changed_limits", [False, True], ids=["limits-kept", "limits-changed"])
@pytest.mark.parametrize("kind", daemon_params())
def test_a_plan_daemon_alive_when_a_deleted_checkpoint_is_rebuilt_is_stopped_by_the_last_unprepare(
        kind: MpsDaemonKind, tenant_changed_limits: bool) -> None:
    # kill -9 of the driver, then checkpoint.json deleted: the rebuilt checkpoint must still know the live
    # daemon (adopted, its limits restored if a tenant changed them) so the last unprepare stops it.
    node = SimulatedNode("demo", plans=MPS_PLANS, plan="mps")
    try:
        kind.install(node.sim_host.driver_root / "usr" / "bin")
        node.start()
        wait_until(lambda: "gpu-2-mps-1" in node.device_names(), timeout=30, what="the MPS shares")
        refs = [node.claim(f"c{k}", [("share", f"gpu-2-mps-{k}")], namespace=f"tenant-{k}") for k in (0, 1)]
        for ref in refs:
            node.prepare_ok(ref)
        [(daemon_id, daemon)] = node.checkpoint()["mps_daemons"].items()
        control = node.sim_host.driver_root / "usr" / "bin" / CONTROL

        def tenant(command: str) -> str:
            env = {"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": daemon["pipe_dir"]}
            return subprocess.run([str(control)], input=command + "\n", check=True, capture_output=True, text=True,
                                  timeout=30, env=env).stdout.strip()

        if tenant_changed_limits:
            tenant("set_default_active_thread_percentage 100")
        node.kill9()
        (node.state_dir / "checkpoint.json").unlink()
        node.start()
        assert pid_alive(daemon["pid"]), "the daemon outlived the driver and its checkpoint"
        assert node.checkpoint()["mps_daemons"][daemon_id]["pid"] == daemon["pid"], "adopted, not restarted"
        assert tenant("get_default_active_thread_percentage") == "25.0", "a tenant's change is set back"
        assert node.unprepare(refs[0]) == {refs[0].uid: None}
        assert pid_alive(daemon["pid"]), "the other claim still uses it"
        assert node.unprepare(refs[1]) == {refs[1].uid: None}
        assert not pid_alive(daemon["pid"]), "the last unprepare stopped the adopted daemon"
        assert node.checkpoint()["mps_daemons"] == {}
        assert not (node.state_dir / "mps" / daemon_id).exists()
    finally:
        node.close()
