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


def test_restart_keeps_prepared_claims(sim_node: SimulatedNode) -> None:
    sim_node.start()
    ref = sim_node.claim("c", [("gpu", "gpu-0")])
    first = sim_node.prepare_ok(ref)
    sim_node.restart()
    assert sim_node.cdi_spec(ref.uid).exists()
    assert sim_node.prepare_ok(ref).devices == first.devices, "the recorded answer, not a new prepare"
    assert sim_node.unprepare(ref) == {ref.uid: None}
    assert sim_node.cdi_files() == []


def test_cdi_specs_lost_in_a_reboot_are_recreated_at_start(sim_node: SimulatedNode) -> None:
    sim_node.start()
    refs = [sim_node.claim("a", [("gpu", "gpu-0")]), sim_node.claim("b", [("mig", "gpu-1-mig-1g10gb-6")])]
    before = {r.uid: json.loads(sim_node.cdi_spec(r.uid).read_text()) for r in refs if sim_node.prepare_ok(r)}
    sim_node.stop()
    for path in sim_node.cdi_dir.iterdir():
        path.unlink()  # /var/run/cdi is a tmpfs: a reboot empties it
    sim_node.start()
    for ref in refs:
        assert json.loads(sim_node.cdi_spec(ref.uid).read_text()) == before[ref.uid]


def test_orphan_cdi_specs_are_removed_at_start(sim_node: SimulatedNode) -> None:
    sim_node.start()
    sim_node.stop()
    orphan = sim_node.cdi_dir / "k8s.gpu.tessera.dev-claim_33333333-3333-3333-3333-333333333333.json"
    sim_node.cdi_dir.mkdir(exist_ok=True)
    orphan.write_text("{}")
    unrelated = sim_node.cdi_dir / "nvidia.yaml"
    unrelated.write_text("cdiVersion: 0.5.0\n")
    sim_node.start()
    assert not orphan.exists()
    assert unrelated.exists(), "other producers' specs are never touched"


def test_kill_9_in_the_middle_of_prepare_is_rolled_back_at_restart(sim_node: SimulatedNode) -> None:
    # The MPS daemon stand-in is told to hang, so prepare blocks while waiting for readiness:
    # the PrepareStarted record and a live daemon exist when the driver is killed.
    sim_node.start(env={"TESSERA_SIM_MPS_FAIL": "hang"})
    ref = sim_node.claim("c", [("gpu", "gpu-0")], configs=[gpu_config(strategy="MPS")])
    daemon_pid = kill_9_while_daemon_starts(sim_node, ref)

    sim_node.restart(env={"TESSERA_SIM_MPS_FAIL": ""})
    wait_until(lambda: not pid_alive(daemon_pid), what="the leaked daemon to be stopped")
    assert ref.uid not in sim_node.checkpoint()["claims"]
    assert sim_node.checkpoint()["mps_daemons"] == {}
    assert sim_node.cdi_files() == []
    assert [p.name for p in (sim_node.state_dir / "mps").glob("claim-*")] == []
    answer = sim_node.prepare_ok(ref)  # the kubelet's retry now succeeds
    assert answer.devices[0].device_name == "gpu-0"
    assert sim_node.unprepare(ref) == {ref.uid: None}


def test_corrupt_checkpoint_is_set_aside_and_state_rebuilt_from_cdi(sim_node: SimulatedNode) -> None:
    sim_node.start()
    ref = sim_node.claim("c", [("gpu", "gpu-2")])
    first = sim_node.prepare_ok(ref)
    sim_node.stop()
    (sim_node.state_dir / "checkpoint.json").write_text('{"version": 1, "checksum": "sha256:00", "data": {"cla')
    sim_node.start()
    assert sim_node.proc is not None and sim_node.proc.poll() is None, "no crash loop"
    assert any("CHECKPOINT CORRUPT" in str(e.get("msg")) for e in sim_node.log())
    assert list(sim_node.state_dir.glob("checkpoint.json.corrupt-*")), "the bad file is kept for inspection"
    assert sim_node.prepare_ok(ref).devices == first.devices
    assert list(sim_node.checkpoint()["claims"]) == [ref.uid]
    assert sim_node.unprepare(ref) == {ref.uid: None}
    assert sim_node.cdi_files() == []


def test_inspect_shows_claims_devices_and_cdi_files(sim_node: SimulatedNode) -> None:
    import subprocess

    sim_node.start()
    ref = sim_node.claim("c", [("mig", "gpu-1-mig-1g10gb-6")])
    sim_node.prepare_ok(ref)
    args = sim_node.inspect_args()
    text = subprocess.run(args, capture_output=True, text=True, check=True).stdout
    assert "default/c" in text and ref.uid in text and "gpu-1-mig-1g10gb-6" in text
    assert "cdi spec (present)" in text
    report = json.loads(subprocess.run([*args, "--json"], capture_output=True, text=True, check=True).stdout)
    [claim] = report["claims"]
    assert claim["devices"][0]["mig"].startswith("MIG-")
    assert claim["cdi_spec_present"] is True


@pytest.mark.parametrize("lost", ["corrupt", "deleted-after-kill-9"])
def test_a_claims_own_daemon_is_adopted_after_a_rebuild_and_restarted_when_it_dies(sim_node: SimulatedNode,
                                                                                   lost: str) -> None:
    # After a checkpoint rebuilt from the CDI specs, a claim's own MPS daemon (no later prepare needs it) used to
    # have no record: never checked again, never restarted. Its spec now carries its settings. A deleted
    # checkpoint used to be read as empty: the claim's spec was removed and its daemon stopped under it.
    sim_node.start()
    limits = {"defaultActiveThreadPercentage": 40}
    ref = sim_node.claim("c", [("gpu", "gpu-0")], configs=[gpu_config(strategy="MPS", mpsConfig=limits)])
    sim_node.prepare_ok(ref)
    [(daemon_id, daemon)] = sim_node.checkpoint()["mps_daemons"].items()
    if lost == "corrupt":
        sim_node.stop()
        (sim_node.state_dir / "checkpoint.json").write_text('{"version": 1, "checksum": "sha256:00", "data": {"cla')
    else:
        sim_node.kill9()
        (sim_node.state_dir / "checkpoint.json").unlink()
    sim_node.start()
    assert sim_node.cdi_spec(ref.uid).exists(), "the running claim keeps its CDI spec"
    assert sim_node.checkpoint()["mps_daemons"][daemon_id]["pid"] == daemon["pid"], "the live daemon adopted"
    os.kill(daemon["pid"], signal.SIGKILL)
    wait_until(lambda: sim_node.checkpoint()["mps_daemons"][daemon_id]["pid"] != daemon["pid"], 30,
               "the watcher to restart the adopted daemon")
    assert sim_node.unprepare(ref) == {ref.uid: None}
    assert sim_node.checkpoint()["mps_daemons"] == {} and sim_node.cdi_files() == []


# gpu-2 (an L4) in four MPS shares, as in test_mps_limit_watch.py.
MPS_PLANS: dict[str, Any] = {"plans": {"mps": {"gpus": [{"match": {"product": "NVIDIA L4"}, "mps": {
    "shares": 4, "activeThreadPercentage": 25, "pinnedMemoryLimit": "4Gi"}}]}}}


@pytest.mark.parametrize("tenant_changed_limits", [False, True], ids=["limits-kept", "limits-changed"])
@pytest.mark.parametrize("kind", daemon_params())
def test_a_plan_daemon_alive_when_a_deleted_checkpoint_is_rebuilt_is_stopped_by_the_last_unprepare(
        kind: MpsDaemonKind, tenant_changed_limits: bool) -> None:
    # kill -9 of the driver, then checkpoint.json deleted: the rebuilt checkpoint must still know the live
    # daemon (adopted, its limits restored if a tenant changed them) so the last unprepare stops it.
    sim_node = SimulatedNode("demo", plans=MPS_PLANS, plan="mps")
    try:
        kind.install(sim_node.sim_host.driver_root / "usr" / "bin")
        sim_node.start()
        wait_until(lambda: "gpu-2-mps-1" in sim_node.device_names(), timeout=30, what="the MPS shares")
        refs = [sim_node.claim(f"c{k}", [("share", f"gpu-2-mps-{k}")], namespace=f"tenant-{k}") for k in (0, 1)]
        for ref in refs:
            sim_node.prepare_ok(ref)
        [(daemon_id, daemon)] = sim_node.checkpoint()["mps_daemons"].items()
        control = sim_node.sim_host.driver_root / "usr" / "bin" / CONTROL

        def tenant(command: str) -> str:
            env = {"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": daemon["pipe_dir"]}
            return subprocess.run([str(control)], input=command + "\n", check=True, capture_output=True, text=True,
                                  timeout=30, env=env).stdout.strip()

        if tenant_changed_limits:
            tenant("set_default_active_thread_percentage 100")
        sim_node.kill9()
        (sim_node.state_dir / "checkpoint.json").unlink()
        sim_node.start()
        assert pid_alive(daemon["pid"]), "the daemon outlived the driver and its checkpoint"
        assert sim_node.checkpoint()["mps_daemons"][daemon_id]["pid"] == daemon["pid"], "adopted, not restarted"
        assert tenant("get_default_active_thread_percentage") == "25.0", "a tenant's change is set back"
        assert sim_node.unprepare(refs[0]) == {refs[0].uid: None}
        assert pid_alive(daemon["pid"]), "the other claim still uses it"
        assert sim_node.unprepare(refs[1]) == {refs[1].uid: None}
        assert not pid_alive(daemon["pid"]), "the last unprepare stopped the adopted daemon"
        assert sim_node.checkpoint()["mps_daemons"] == {}
        assert not (sim_node.state_dir / "mps" / daemon_id).exists()
    finally:
        sim_node.close()
