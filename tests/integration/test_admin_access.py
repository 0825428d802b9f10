"""Admin access and tolerated health taints through the real driver process, kubelet stand-in and API server.

One simulated node serves every test of this module (each test leaves it as it found it): a whole
H100 (gpu-0, per-claim MPS), an H100 with one MIG device (gpu-1), an L4 in two MPS shares (gpu-2),
an H100 in two time-sliced shares (gpu-3), a consumable H100 (gpu-4) and an L4 kept for health
events (gpu-5).
"""

from __future__ import annotations

import json
import subprocess
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from driver.kubeletplugin.types import ClaimRef
from driver.simulation.hostroot import SIMULATED_CAPS_MAJOR
from tests.support.node import DRIVER, SimulatedNode, gpu_config, pid_alive, wait_until

LAYOUT: dict[str, Any] = {"description": "admin access: every device form on one node", "gpus": [
    {"model": "H100-80GB"}, {"model": "H100-80GB", "mig": [{"profile": "1g.10gb", "start": 6}]}, {"model": "L4"},
    {"model": "H100-80GB"}, {"model": "H100-80GB"}, {"model": "L4"}]}
PLANS: dict[str, Any] = {"plans": {"forms": {"gpus": [
    {"match": {"minor": 2}, "mps": {"shares": 2, "pinnedMemoryLimit": "4Gi"}},
    {"match": {"minor": 3}, "timeSlicing": {"shares": 2, "interval": "Long"}},
    {"match": {"minor": 4}, "consumable": {}}]}}}
DEVICES = ["gpu-0", "gpu-1-mig-1g10gb-6", "gpu-2-mps-0", "gpu-2-mps-1", "gpu-3-ts-0", "gpu-3-ts-1", "gpu-4-shared",
           "gpu-5"]
MIG_MPS = {"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": {
    "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}}}}
# Form -> (device, the workload's configs, the workload's consumed capacity). The admin claim's
# consumedCapacity on the consumable GPU would leave no room for the workload's if it were counted.
FORMS: dict[str, tuple[str, list[dict[str, Any]], dict[str, str] | None]] = {
    "gpu": ("gpu-0", [gpu_config(strategy="MPS")], None),
    "mig": ("gpu-1-mig-1g10gb-6", [MIG_MPS], None),
    "mps": ("gpu-2-mps-0", [], None),
    "timeslice": ("gpu-3-ts-0", [], None),
    "consumable": ("gpu-4-shared", [], {"memory": "40Gi", "multiprocessors": "66"}),
}
ADMIN_CONSUMED = {"memory": "70Gi", "multiprocessors": "130"}
TAINT_KEY = f"{DRIVER}/unhealthy"


@pytest.fixture(scope="module")
def sim_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SimulatedNode]:
    layout = tmp_path_factory.mktemp("layout") / "admin-forms.yaml"
    layout.write_text(yaml.safe_dump(LAYOUT))
    n = SimulatedNode(str(layout), plans=PLANS, plan="forms")
    try:
        start(n)
        yield n
    finally:
        n.close()


def start(sim_node: SimulatedNode) -> None:
    sim_node.start(env={"TESSERA_SIM_EVENTS": str(sim_node.events_file)})
    sim_node.wait_for_devices(DEVICES, timeout=30)


def gpu_uuid(sim_node: SimulatedNode, minor: int) -> str:
    gpu = sim_node.inventory.gpu_by_minor(minor)
    assert gpu is not None
    return gpu.uuid


def gpu_settings(sim_node: SimulatedNode) -> dict[str, Any]:
    """What the stand-ins hold per GPU: compute mode and time slice, for GPUs not at the defaults (a GPU's
    entry appears at its first query)."""
    path = sim_node.work / "nvidia-smi-state.json"
    data: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    defaults = {"compute_mode": "DEFAULT", "timeslice": 0}
    return {uuid: s for uuid, s in data.items() if {**defaults, **s} != defaults}


def runtime(sim_node: SimulatedNode) -> dict[str, Any]:
    """Everything claims change on the node besides their own CDI specs and checkpoint entries."""
    cp = sim_node.checkpoint()
    return {"daemons": {i: d["pid"] for i, d in cp["mps_daemons"].items()}, "modes": cp["compute_modes"],
            "plan_timeslices": cp["plan_timeslices"], "gpus": gpu_settings(sim_node),
            "exclusive": {u: sorted(c["exclusive_gpus"]) for u, c in cp["claims"].items() if c["exclusive_gpus"]}}


def daemon_activity(sim_node: SimulatedNode) -> list[dict[str, Any]]:
    """Starts, stops and settings sent to MPS daemons (reads are left out: a limit check may read at any time)."""
    return [e for e in sim_node.journal() if not str(e.get("cmd", "")).startswith("get_")]


def check_admin_spec(sim_node: SimulatedNode, ref: ClaimRef, device: str) -> None:
    spec = json.loads(sim_node.cdi_spec(ref.uid).read_text())
    [dev] = spec["devices"]
    edits = dev["containerEdits"]
    assert edits["deviceNodes"][0]["path"] == f"/dev/nvidia{device[4]}", edits  # gpu-<minor>...
    assert "mounts" not in edits, "no MPS pipe directory or /dev/shm for an admin claim"
    assert not [e for e in edits.get("env", []) if e.startswith(("CUDA_MPS", "NVIDIA_GPU_MEMORY"))]
    assert dev["annotations"][f"{DRIVER}/admin-access"] == "true" and dev["annotations"][f"{DRIVER}/device"] == device
    assert any(m["containerPath"].endswith(".so.1") or "lib" in m["containerPath"]
               for m in spec["containerEdits"].get("mounts", [])), "the driver libraries are mounted"
    # On a MIG GPU the monitor capability (nvidia-cap2, read from /proc/driver/nvidia/capabilities/mig/monitor) lets
    # nvidia-smi in the monitoring pod list the GPU's MIG devices; a GPU without MIG needs none.
    monitor = [n for n in edits["deviceNodes"] if n["path"] == "/dev/nvidia-caps/nvidia-cap2"]
    expected = [{"path": "/dev/nvidia-caps/nvidia-cap2", "type": "c", "major": SIMULATED_CAPS_MAJOR, "minor": 2,
                 "fileMode": 0o444}]
    assert monitor == (expected if "-mig-" in device else []), edits["deviceNodes"]


@pytest.mark.parametrize("order", ["workload-first", "admin-first"])
@pytest.mark.parametrize("form", list(FORMS))
def test_admin_access_on_a_device_a_workload_holds(sim_node: SimulatedNode, form: str, order: str) -> None:
    device, configs, consumed = FORMS[form]
    share_ids = {device: str(uuid.uuid4())} if form == "consumable" else None
    work = sim_node.claim(f"work-{form}-{order}", [("gpu", device)], configs=configs, share_ids=share_ids,
                          consumed={device: consumed} if consumed else None)
    look = sim_node.claim(f"look-{form}-{order}", [("gpu", device)], namespace="monitoring", admin_access=True,
                          share_ids={device: str(uuid.uuid4())} if share_ids else None,
                          consumed={device: ADMIN_CONSUMED} if consumed else None)
    try:
        if order == "workload-first":
            sim_node.prepare_ok(work)
            held, activity = runtime(sim_node), daemon_activity(sim_node)
            answer = sim_node.prepare_ok(look)
            assert [d.device_name for d in answer.devices] == [device]
            check_admin_spec(sim_node, look, device)
            assert (runtime(sim_node), daemon_activity(sim_node)) == (held,
                                                                      activity), "the admin prepare changed nothing"
            assert sim_node.unprepare(look) == {look.uid: None}
            assert (runtime(sim_node), daemon_activity(sim_node)) == (held,
                                                                      activity), "the admin unprepare changed nothing"
            assert all(pid_alive(pid) for pid in held["daemons"].values()), "the workload's daemon still runs"
            assert sim_node.cdi_spec(work.uid).exists()
        else:
            sim_node.prepare_ok(look)
            check_admin_spec(sim_node, look, device)
            idle, started = runtime(sim_node), len([e for e in sim_node.journal() if e.get("event") == "start"])
            sim_node.prepare_ok(work)  # not refused: the admin claim holds nothing
            pids = [e["pid"] for e in sim_node.journal() if e.get("event") == "start"][started:]
            assert bool(pids) == (form != "timeslice"), f"the workload's own MPS daemon: {pids}"
            if form in ("gpu", "mps"):
                assert gpu_settings(sim_node)[gpu_uuid(sim_node, int(device[4]))]["compute_mode"] == "EXCLUSIVE_PROCESS"
            # The workload's unprepare undoes all of it though the admin claim still holds the device.
            assert sim_node.unprepare(work) == {work.uid: None}
            wait_until(lambda: not any(pid_alive(p) for p in pids), what="the workload's daemon to stop")
            assert runtime(sim_node) == idle and sim_node.cdi_spec(look.uid).exists()
            assert sim_node.checkpoint()["claims"][look.uid]["devices"][0]["admin_access"] is True
    finally:
        sim_node.unprepare(look, work)
    assert {look.uid, work.uid}.isdisjoint(sim_node.checkpoint()["claims"])


def test_recovery_and_inspect_know_admin_claims(sim_node: SimulatedNode) -> None:
    work = sim_node.claim("work-recovery", [("gpu", "gpu-2-mps-1")])
    look = sim_node.claim("look-recovery", [("gpu", "gpu-2-mps-1")], namespace="monitoring", admin_access=True)
    try:
        sim_node.prepare_ok(work)
        sim_node.prepare_ok(look)
        report = json.loads(subprocess.run(sim_node.inspect_args("--json"), capture_output=True, text=True,
                                           timeout=60).stdout)
        shown = {c["claim"]: c["devices"][0]["admin_access"] for c in report["claims"]}
        assert shown == {"default/work-recovery": False, "monitoring/look-recovery": True}
        text = subprocess.run(sim_node.inspect_args(), capture_output=True, text=True, timeout=60).stdout
        assert "admin-access" in text
        [daemon] = sim_node.checkpoint()["mps_daemons"].values()

        # Killed with its checkpoint corrupt, the driver rebuilds both claims from their CDI specs.
        sim_node.kill9()
        (sim_node.state_dir / "checkpoint.json").write_text("{not json")
        sim_node.restart(env={"TESSERA_SIM_EVENTS": str(sim_node.events_file)})
        sim_node.wait_for_devices(DEVICES, timeout=30)
        rebuilt = sim_node.checkpoint()["claims"]
        assert rebuilt[look.uid]["devices"][0]["admin_access"] is True
        assert rebuilt[look.uid]["shared_mps_daemons"] == [] and rebuilt[look.uid]["exclusive_gpus"] == []
        assert rebuilt[work.uid]["devices"][0]["admin_access"] is False and rebuilt[work.uid]["shared_mps_daemons"]
        assert pid_alive(daemon["pid"]), "the workload's daemon survived the driver"
        # The last share's unprepare stops the daemon; the admin claim neither blocks nor needs it.
        assert sim_node.unprepare(work) == {work.uid: None}
        wait_until(lambda: not pid_alive(daemon["pid"]), what="the daemon to stop after the last share")
        assert sim_node.checkpoint()["mps_daemons"] == {} and sim_node.cdi_spec(look.uid).exists()
    finally:
        sim_node.unprepare(look, work)


def test_a_claim_tolerating_the_health_taint_is_prepared_and_one_that_does_not_is_refused(
        sim_node: SimulatedNode) -> None:
    with sim_node.events_file.open("a") as events:
        events.write(json.dumps({"uuid": gpu_uuid(sim_node, 5), "xid": 79}) + "\n")

    def gpu5_taints() -> list[dict[str, Any]]:
        return next((d.get("taints", []) for d in sim_node.devices() if d["name"] == "gpu-5"), [])

    wait_until(lambda: [t.get("value") for t in gpu5_taints()] == ["xid-79"], 10, "gpu-5 to be tainted")
    diag = sim_node.claim("diag", [("gpu", "gpu-5")],
                          tolerations=[{"key": TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"}])
    other = sim_node.claim("other", [("gpu", "gpu-5")],
                           tolerations=[{"key": TAINT_KEY, "operator": "Equal", "value": "xid-48"}])
    try:
        error = sim_node.prepare(other)[other.uid].error
        assert error is not None and "device gpu-5 (xid-79" in error and "is unhealthy" in error
        sim_node.prepare_ok(diag)
        [line] = [e for e in sim_node.log() if "tolerates the device's taints" in str(e.get("msg"))
                  and e.get("claim_uid") == diag.uid]
        assert line["level"].lower() == "info" and line["device"] == "gpu-5"
        assert line["tolerated"] == [f"{TAINT_KEY}=xid-79:NoSchedule"] and line["reason"].startswith("xid-79")
        assert other.uid not in sim_node.checkpoint()["claims"]
    finally:
        sim_node.unprepare(diag, other)
        with sim_node.events_file.open("a") as events:
            events.write(json.dumps({"uuid": gpu_uuid(sim_node, 5), "recovered": True}) + "\n")
        wait_until(lambda: gpu5_taints() == [], 10, "gpu-5 to recover")
