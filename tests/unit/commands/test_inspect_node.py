"""``inspect``: the report built from the checkpoint and CDI directory, and its text rendering."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import cdi
from driver.commands.inspect import collect, inspect, render_text
from driver.config import Settings
from driver.gpu.claimcdi.toolkit import load_toolkit_edits
from driver.gpu.claimconfig.choices import DeviceKind
from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.mps.model import MpsDaemonRecord, MpsDaemonSpec
from driver.gpu.published.devices import make_view
from driver.gpu.record.checkpoint import (
    Checkpoint,
    CheckpointStore,
    ClaimPhase,
    ClaimRecord,
    PreparedDeviceRecord,
    TimeSliceRecord,
)
from driver.gpu.state import DeviceState, StatePaths
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.types import PreparedDevice
from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.hostroot import build_host_root
from tests.support.statenode import FakeComputeModes

GPU0 = "GPU-00000000-0000-0000-0000-000000000000"
MIG = "MIG-11111111-1111-1111-1111-111111111111"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(node_name="node-a", plugins_dir=tmp_path / "plugins", cdi_root=tmp_path / "cdi")


def _store(settings: Settings) -> CheckpointStore:
    return CheckpointStore(settings.state_dir / "checkpoint.json")


def _record(uid: str, name: str, device: str = "gpu-0", phase: ClaimPhase = ClaimPhase.PREPARE_COMPLETED,
            mig: str | None = None, daemon: str | None = None) -> ClaimRecord:
    prepared = PreparedDevice(request_names=["gpu"], pool_name="node-a", device_name=device,
                              cdi_device_ids=[f"k8s.gpu.tessera.dev/claim={uid}-{device}"])
    dev = PreparedDeviceRecord(device=prepared, kind="mig" if mig else "gpu", gpu_uuid=GPU0, gpu_minor=0,
                               mig_uuid=mig, mps_daemon_id=daemon)
    return ClaimRecord(uid=uid, namespace="team-a", name=name, phase=phase, devices=[dev],
                       owned_mps_daemons=[daemon] if daemon else [],
                       cdi_spec_file=f"k8s.gpu.tessera.dev-claim_{uid}.json", updated_at="2025-01-01T00:00:00+00:00")


def _start_time(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19])
    except OSError:
        return 1


def _daemon(daemon_id: str, pid: int, tmp: Path) -> MpsDaemonRecord:
    return MpsDaemonRecord(spec=MpsDaemonSpec(daemon_id=daemon_id, gpu_uuids=[GPU0], active_thread_percentage=40),
                           pid=pid, pipe_dir=tmp / daemon_id / "pipe", log_dir=tmp / daemon_id / "log",
                           started_at="2025-01-01T00:00:00+00:00", process_start_time=_start_time(pid))


def _write_spec(settings: Settings, uid: str) -> Path:
    spec = cdi.Spec.from_wire({"cdiVersion": "0.6.0", "kind": "k8s.gpu.tessera.dev/claim", "devices": [
        {"name": f"{uid}-gpu-0", "containerEdits": {"deviceNodes": [{"path": "/dev/nvidia0"}]}}]}, "test")
    return cdi.write_spec(settings.cdi_root, f"k8s.gpu.tessera.dev-claim_{uid}.json", spec)


def _unused_pid() -> int:
    pid = 4_000_000
    while Path(f"/proc/{pid}").exists():
        pid -= 1
    return pid


def test_no_checkpoint_is_a_note_not_a_problem(settings: Settings) -> None:
    # A node that has prepared nothing yet is healthy: inspect must not fail on it.
    report = collect(settings)
    assert report["claims"] == [] and report["mps_daemons"] == []
    assert report["problems"] == []
    assert report["notes"] == ["no checkpoint: nothing has been prepared on this node yet"]
    text = render_text(report)
    assert "0 prepared claim(s)" in text
    assert "note: no checkpoint" in text and "PROBLEM" not in text


def test_corrupt_checkpoint_is_reported_and_left_for_the_driver(settings: Settings) -> None:
    settings.state_dir.mkdir(parents=True)
    (settings.state_dir / "checkpoint.json").write_text("{broken")
    report = collect(settings)
    assert any("cannot be read" in p and "sets it aside" in p for p in report["problems"])
    # inspect is read-only: only the driver, under its lock, sets a bad checkpoint aside.
    assert (settings.state_dir / "checkpoint.json").read_text() == "{broken"
    assert not list(settings.state_dir.glob("checkpoint.json.corrupt-*"))


def test_claims_daemons_orphans_and_missing_specs(settings: Settings, tmp_path: Path) -> None:
    live, dead = _daemon("claim-live-0", os.getpid(), tmp_path), _daemon("claim-dead-0", _unused_pid(), tmp_path)
    cp = Checkpoint(boot_id="boot-1", claims={
        "u-ok": _record("u-ok", "with-spec", daemon="claim-live-0"),
        "u-missing": _record("u-missing", "without-spec", device="gpu-1-mig-1g10gb-6", mig=MIG),
        "u-started": _record("u-started", "half-done", device="gpu-2", phase=ClaimPhase.PREPARE_STARTED),
    }, mps_daemons={"claim-live-0": live, "claim-dead-0": dead})
    _store(settings).save(cp)
    _write_spec(settings, "u-ok")
    orphan = _write_spec(settings, "u-orphan")
    (settings.cdi_root / "nvidia.yaml").write_text("not ours\n")

    report = collect(settings)
    assert report["driver"] == "gpu.tessera.dev" and report["boot_id"] == "boot-1"
    claims = {c["uid"]: c for c in report["claims"]}
    assert [c["claim"] for c in report["claims"]] == ["team-a/half-done", "team-a/with-spec", "team-a/without-spec"]
    assert claims["u-ok"]["cdi_spec_present"] is True
    assert claims["u-missing"]["cdi_spec_present"] is False
    assert claims["u-started"]["phase"] == "PrepareStarted"
    assert claims["u-ok"]["devices"][0]["mps_daemon"] == "claim-live-0"
    assert claims["u-missing"]["devices"][0]["mig"] == MIG
    assert report["orphan_cdi_specs"] == [str(orphan)]
    # Only a completed claim without its spec is a problem; a PrepareStarted one is rolled back at start.
    [problem] = report["problems"]
    assert "u-missing" in problem and "is missing" in problem
    daemons = {d["id"]: d for d in report["mps_daemons"]}
    assert daemons["claim-live-0"]["pid_alive"] is True and daemons["claim-live-0"]["claims"] == ["u-ok"]
    assert daemons["claim-dead-0"]["pid_alive"] is False and daemons["claim-dead-0"]["claims"] == []

    text = render_text(report)
    assert "3 prepared claim(s)" in text
    assert "cdi spec (MISSING)" in text and "cdi spec (present)" in text
    assert f"mig={MIG}" in text and "mps-daemon=claim-live-0" in text
    assert "cdi: k8s.gpu.tessera.dev/claim=u-ok-gpu-0" in text
    assert "2 MPS control daemon(s)" in text
    assert "(running)" in text and "(NOT RUNNING)" in text and "threads=40%" in text
    assert f"orphan CDI spec (no checkpoint entry; removed at next driver start): {orphan}" in text
    assert text.splitlines()[-1].startswith("PROBLEM: claim u-missing")


def test_timeslice_and_plan_timeslices_are_shown(settings: Settings) -> None:
    record = _record("u-ts", "sliced")
    record.timeslice = TimeSliceRecord(gpu_uuids=[GPU0], interval="Long")
    cp = Checkpoint(claims={"u-ts": record}, plan_timeslices={GPU0: "Medium"})
    _store(settings).save(cp)
    report = collect(settings)
    assert report["plan_timeslices"] == {GPU0: "Medium"}
    assert f"time slice Long on {GPU0}" in render_text(report)


def test_each_consumable_share_shows_what_it_consumed(settings: Settings) -> None:
    small = _record("u-small", "small", device="gpu-0-shared", daemon="share-0123456789ab")
    large = _record("u-large", "large", device="gpu-0-shared", daemon="share-ba9876543210")
    small.devices[0] = small.devices[0].model_copy(update={
        "kind": DeviceKind.CONSUMABLE, "consumed_memory_bytes": 10 << 30, "consumed_multiprocessors": 33})
    large.devices[0] = large.devices[0].model_copy(update={
        "kind": DeviceKind.CONSUMABLE, "consumed_memory_bytes": (20 << 30) + 1, "consumed_multiprocessors": 66})
    _store(settings).save(Checkpoint(claims={"u-small": small, "u-large": large, "u-gpu": _record("u-gpu", "g")}))
    report = collect(settings)
    consumed = {c["uid"]: c["devices"][0]["consumed"] for c in report["claims"]}
    assert consumed == {"u-small": {"memory": "10Gi", "memory_bytes": 10 << 30, "multiprocessors": 33},
                        "u-large": {"memory": f"{(20 << 30) + 1} bytes", "memory_bytes": (20 << 30) + 1,
                                    "multiprocessors": 66},
                        "u-gpu": None}
    text = render_text(report)
    assert "consumed=10Gi,33 SMs" in text and f"consumed={(20 << 30) + 1} bytes,66 SMs" in text
    assert text.count("consumed=") == 2


def test_inspect_json_is_parseable(settings: Settings) -> None:
    _store(settings).save(Checkpoint(claims={"u1": _record("u1", "c")}))
    data = json.loads(inspect(settings, as_json=True))
    assert [c["uid"] for c in data["claims"]] == ["u1"]
    assert inspect(settings, as_json=False).startswith("driver gpu.tessera.dev")


def test_state_prepared_by_the_driver_reads_back(settings: Settings, tmp_path: Path) -> None:
    inventory = SimulatedDiscovery("demo", "node-a").discover()
    host = tmp_path / "host"
    build_host_root(host, inventory)
    state = DeviceState(
        driver_name="gpu.tessera.dev", pool_name="node-a",
        paths=StatePaths(state_dir=settings.state_dir, cdi_root=settings.cdi_root, host_root=host, mps_shm_dir=None),
        toolkit=load_toolkit_edits(host / "etc" / "cdi" / "nvidia.yaml"),
        mps=None, timeslicer=None,  # type: ignore[arg-type]  # a whole GPU without sharing needs neither
        view=make_view(inventory, {}), compute_modes=FakeComputeModes())
    state.prepare(ResourceClaim.model_validate({
        "metadata": {"name": "train", "namespace": "team-a", "uid": "u1"},
        "status": {"allocation": {"devices": {"results": [
            {"request": "gpu", "driver": "gpu.tessera.dev", "pool": "node-a", "device": "gpu-1-mig-3g40gb-0"}]}}}}))

    report = collect(settings)
    [claim] = report["claims"]
    assert claim["claim"] == "team-a/train" and claim["phase"] == "PrepareCompleted"
    assert claim["cdi_spec_present"] is True
    assert [d["device"] for d in claim["devices"]] == ["gpu-1-mig-3g40gb-0"]
    assert claim["devices"][0]["kind"] == "mig" and claim["devices"][0]["mig"] is not None
    assert report["problems"] == [] and report["orphan_cdi_specs"] == []

    Path(claim["cdi_spec"]).unlink()
    text = render_text(collect(settings))
    assert "cdi spec (MISSING)" in text
    assert "PROBLEM: claim u1: CDI spec" in text


def test_a_recycled_pid_is_not_reported_running(settings: Settings, tmp_path: Path) -> None:
    stale = _daemon("claim-stale-0", os.getpid(), tmp_path).model_copy(update={"process_start_time": 1})
    cp = Checkpoint(claims={"u-ok": _record("u-ok", "with-spec", daemon="claim-stale-0")},
                    mps_daemons={"claim-stale-0": stale})
    CheckpointStore(settings.state_dir / "checkpoint.json").save(cp)
    [daemon] = collect(settings)["mps_daemons"]
    assert daemon["pid_alive"] is False


def test_recorded_compute_modes_and_where_mps_daemons_run(settings: Settings) -> None:
    gpu1 = "GPU-22222222-2222-2222-2222-222222222222"
    held = _record("u-mps", "shared", daemon="plan-000000000000")
    held.exclusive_gpus = [GPU0]
    # GPU0: set for MPS (it was DEFAULT); gpu1: released, but restoring its mode failed so far.
    cp = Checkpoint(claims={"u-mps": held},
                    compute_modes={GPU0: ComputeMode.DEFAULT, gpu1: ComputeMode.PROHIBITED})
    _store(settings).save(cp)

    report = collect(settings)
    assert report["compute_modes"] == [
        {"gpu": GPU0, "mode": "EXCLUSIVE_PROCESS", "restore_to": "DEFAULT", "claims": ["u-mps"]},
        {"gpu": gpu1, "mode": None, "restore_to": "PROHIBITED", "claims": []},
    ]
    assert report["claims"][0]["exclusive_gpus"] == [GPU0]
    text = render_text(report)
    assert (f"{GPU0}: compute mode EXCLUSIVE_PROCESS for MPS, held by 1 claim(s); restored to DEFAULT when the "
            "last one is unprepared") in text
    assert f"{gpu1}: compute mode to be restored to PROHIBITED" in text
    assert ("MPS daemons run as: child processes of the plugin process (they stop with it: in a pod, with the "
            "plugin container)") in text

    hosted = settings.model_copy(update={"mps_host_socket": Path("/run/tessera/mps-host/host.sock")})
    assert collect(hosted)["mps_daemons_run_by"] == ("MPS host at /run/tessera/mps-host/host.sock "
                                                     "(daemons outlive the plugin)")
