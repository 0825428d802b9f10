"""DeviceState through its public API: prepare, unprepare, rollback on failure, recover, apply_layout.

The node is simulated (a host tree built from the ``demo`` layout: gpu-0 H100 whole, gpu-1 H100
with MIG 3g.40gb@0, 2g.20gb@4, 1g.10gb@6, gpu-2 L4); MPS daemons and time slices are recording
fakes that can be told to fail, so every side effect and every rollback is visible.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import cdi
from driver.gpu.claimconfig.choices import TimeSliceInterval
from driver.gpu.errors import PrepareError
from driver.gpu.mps.model import MpsDaemonRecord, MpsDaemonSpec, MpsError
from driver.gpu.published.devices import make_view
from driver.gpu.record.checkpoint import ClaimPhase
from driver.gpu.recovery import recover
from driver.gpu.runtime.timeslice import TimeSliceError
from driver.gpu.state import DeviceState
from driver.gpu.watch.daemonwatch import revive_daemons
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.types import Deadline
from driver.units import GIB
from tests.support.statenode import (
    DRIVER,
    POOL,
    StateNode,
    claim,
    device_env,
    gpu_config,
    mps_shares,
    ref,
    ts_shares,
)

# ----------------------------------------------------------------------------- prepare


def test_prepare_whole_gpu_writes_spec_and_checkpoint(state_node: StateNode) -> None:
    state = state_node.state()
    devices = state.prepare(claim("u1", "gpu-0"))
    assert [(d.device_name, d.pool_name, d.request_names) for d in devices] == [("gpu-0", POOL, ["r0"])]
    assert devices[0].cdi_device_ids == ["k8s.gpu.tessera.dev/claim=u1-gpu-0"]
    spec = state_node.spec_json("u1")
    assert spec["kind"] == "k8s.gpu.tessera.dev/claim"
    assert [d["name"] for d in spec["devices"]] == ["u1-gpu-0"]
    assert spec["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]
    assert spec["annotations"]["gpu.tessera.dev/claim"] == "default/claim-u1"
    assert "NVIDIA_VISIBLE_DEVICES=void" in spec["containerEdits"]["env"]
    [record] = state.prepared_claims()
    assert (record.uid, record.phase) == ("u1", ClaimPhase.PREPARE_COMPLETED)
    assert record.gpu_uuids == {state_node.uuid(0)}
    assert state_node.mps.calls == [] and state_node.timeslicer.calls == []


def test_prepare_mig_device_adds_its_capability_nodes(state_node: StateNode) -> None:
    state_node.state().prepare(claim("u1", "gpu-1-mig-1g10gb-6"))
    nodes = state_node.spec_json("u1")["devices"][0]["containerEdits"]["deviceNodes"]
    assert nodes[0] == {"path": "/dev/nvidia1"}
    caps = [n for n in nodes if n["path"].startswith("/dev/nvidia-caps/")]
    assert len(caps) == 2, "a MIG device needs its GI and CI access nodes"
    assert all(n["type"] == "c" and n["major"] == 237 for n in caps)


def test_prepare_again_returns_the_same_devices_without_new_side_effects(state_node: StateNode) -> None:
    state = state_node.state()
    first = state.prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    calls = list(state_node.mps.calls)
    again = state.prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    assert again == first
    assert state_node.mps.started() == [d for op, d in calls if op == "start"], "no second daemon"
    assert len(state.prepared_claims()) == 1


def test_a_prepared_claim_prepared_again_with_another_allocation_is_refused(state_node: StateNode) -> None:
    # The same UID allocated anew (reallocated after a missed unprepare): served as recorded, the pod would get
    # the devices and limits of the old allocation, not what the scheduler counted now.
    state = state_node.state()
    first = state.prepare(claim("u1", "gpu-0"))
    with pytest.raises(PrepareError, match="already prepared with another allocation"):
        state.prepare(claim("u1", "gpu-2"))
    assert state.prepare(claim("u1", "gpu-0")) == first, "the same allocation is still answered as before"
    assert state_node.spec_json("u1")["devices"][0]["containerEdits"]["deviceNodes"][0] == {"path": "/dev/nvidia0"}


def test_claim_without_results_for_this_driver_is_a_no_op(state_node: StateNode) -> None:
    other = ResourceClaim.model_validate({
        "metadata": {"name": "c", "namespace": "default", "uid": "u1"},
        "status": {"allocation": {"devices": {"results": [
            {"request": "r", "driver": "other.example.com", "pool": POOL, "device": "gpu-0"}]}}}})
    state = state_node.state()
    assert state.prepare(other) == []
    assert state.prepared_claims() == [] and state_node.cdi_files() == []


def test_device_of_another_pool_is_refused(state_node: StateNode) -> None:
    state = state_node.state()
    with pytest.raises(PrepareError, match=r"pool 'node-b'.*another node"):
        state.prepare(claim("u1", "gpu-0", pool="node-b"))
    assert state.prepared_claims() == [] and state_node.cdi_files() == []


def test_device_not_published_is_refused_listing_what_is(state_node: StateNode) -> None:
    state = state_node.state()
    with pytest.raises(PrepareError, match=r"'gpu-1' is not published.*gpu-0") as info:
        state.prepare(claim("u1", "gpu-1"))  # gpu 1 is MIG-enabled: only its MIG devices are published
    assert "delete the pod" in str(info.value)
    assert state.prepared_claims() == []


def test_device_prepared_for_another_claim_is_refused(state_node: StateNode) -> None:
    state = state_node.state()
    state.prepare(claim("u1", "gpu-0"))
    with pytest.raises(PrepareError, match="already prepared for claim default/claim-u1"):
        state.prepare(claim("u2", "gpu-2", "gpu-0"))
    assert [r.uid for r in state.prepared_claims()] == ["u1"]
    assert state_node.cdi_files() == ["k8s.gpu.tessera.dev-claim_u1.json"]


def test_invalid_opaque_config_is_refused_before_anything_happens(state_node: StateNode) -> None:
    bad = {"source": "FromClaim", "requests": [],
           "opaque": {"driver": DRIVER, "parameters": {"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "Nope"}}}
    state = state_node.state()
    with pytest.raises(PrepareError, match="invalid opaque configuration"):
        state.prepare(claim("u1", "gpu-0", configs=[bad]))
    assert state.prepared_claims() == [] and state_node.cdi_files() == []


def test_missing_device_node_fails_prepare_and_rolls_back(state_node: StateNode) -> None:
    (state_node.host / "dev" / "nvidia2").unlink()
    state = state_node.state()
    with pytest.raises(PrepareError, match=r"/dev/nvidia2 .* does not exist"):
        state.prepare(claim("u1", "gpu-2"))
    assert state.prepared_claims() == [] and state_node.cdi_files() == []


# ----------------------------------------------------------------------------- per-claim sharing


def test_claim_mps_config_starts_a_daemon_and_unprepare_stops_it(state_node: StateNode) -> None:
    state = state_node.state()
    mps = {"defaultActiveThreadPercentage": 25}
    state.prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS", mpsConfig=mps)]))
    [daemon_id] = state_node.mps.started()
    daemon = state_node.mps.running[daemon_id]
    assert daemon.spec.gpu_uuids == [state_node.uuid(0)]
    assert daemon.spec.active_thread_percentage == 25
    assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in device_env(state_node.spec_json("u1"))
    [record] = state.prepared_claims()
    assert record.owned_mps_daemons == [daemon_id]
    assert state_node.store.load().mps_daemons.keys() == {daemon_id}

    state.unprepare(ref("u1"))
    assert state_node.mps.stopped_after_start(daemon_id) and state_node.mps.running == {}
    assert state.prepared_claims() == [] and state_node.cdi_files() == []
    assert state_node.store.load().mps_daemons == {}


def test_cdi_write_failure_after_daemon_start_rolls_everything_back(state_node: StateNode,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(directory: Path, filename: str, text: str, **_options: bool) -> Path:
        raise OSError("simulated: no space left on device")

    monkeypatch.setattr(cdi, "write_spec_text", refuse)  # driver.gpu.state calls cdi.write_spec_text
    state = state_node.state()
    with pytest.raises(PrepareError, match="no space left"):
        state.prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    [daemon_id] = state_node.mps.started()
    assert state_node.mps.stopped_after_start(daemon_id)
    assert state_node.mps.running == {}
    assert state.prepared_claims() == []
    assert state_node.store.load().mps_daemons == {}
    assert state_node.cdi_files() == []


def test_mps_start_failure_leaves_nothing(state_node: StateNode) -> None:
    state_node.mps.fail_start = True
    state = state_node.state()
    with pytest.raises(PrepareError, match="starting MPS control daemon"):
        state.prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    assert state.prepared_claims() == []
    assert state_node.store.load().mps_daemons == {}
    assert state_node.cdi_files() == []


def test_claim_time_slicing_applies_and_unprepare_resets(state_node: StateNode) -> None:
    state = state_node.state()
    state.prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="TimeSlicing",
                                                           timeSlicingConfig={"interval": "Long"})]))
    assert state_node.timeslicer.intervals == {state_node.uuid(0): "Long"}
    [record] = state.prepared_claims()
    assert record.timeslice is not None and record.timeslice.gpu_uuids == [state_node.uuid(0)]
    state.unprepare(ref("u1"))
    assert state_node.timeslicer.intervals == {}
    assert state_node.timeslicer.calls[-1] == ("reset", (state_node.uuid(0),), None)


def test_time_slice_failure_leaves_nothing(state_node: StateNode) -> None:
    state_node.timeslicer.fail_apply = True
    state = state_node.state()
    with pytest.raises(PrepareError, match="simulated nvidia-smi exit 3"):
        state.prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="TimeSlicing",
                                                               timeSlicingConfig={"interval": "Short"})]))
    assert state.prepared_claims() == []
    assert state_node.cdi_files() == []
    assert state_node.timeslicer.intervals == {}
    # The GPU is put back to its default in case the failed command half-applied.
    assert state_node.timeslicer.calls[-1] == ("reset", (state_node.uuid(0),), None)


# ----------------------------------------------------------------------------- plan shares


def test_plan_mps_daemon_is_shared_and_stopped_after_its_last_user(state_node: StateNode) -> None:
    state = state_node.state()
    view, deferred = state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(0): mps_shares(2)})
    assert deferred == set()
    assert {"gpu-0-mps-0", "gpu-0-mps-1"} <= set(view.targets) and "gpu-0" not in view.targets

    state.prepare(claim("a", "gpu-0-mps-0"))
    state.prepare(claim("b", "gpu-0-mps-1"))
    [daemon_id] = state_node.mps.started()
    assert daemon_id.startswith("plan-")
    daemon = state_node.mps.running[daemon_id]
    assert daemon.spec.active_thread_percentage == 50
    assert daemon.spec.pinned_memory_limits == {state_node.uuid(0): 10 * GIB}
    for uid in ("a", "b"):
        assert "CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps" in device_env(state_node.spec_json(uid))

    before = len(state_node.mps.calls)
    state.unprepare(ref("a"))
    assert daemon_id in state_node.mps.running, "the daemon still serves claim b"
    assert state_node.mps.calls[before:] == []
    state.unprepare(ref("b"))
    assert state_node.mps.calls[before:] == [("stop", daemon_id)]
    assert state_node.mps.running == {}


def test_two_shares_of_one_gpu_in_one_claim_are_refused(state_node: StateNode) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(0): mps_shares(2)})
    with pytest.raises(PrepareError, match="2 shares of one GPU"):
        state.prepare(claim("u1", "gpu-0-mps-0", "gpu-0-mps-1"))
    assert state.prepared_claims() == [] and state_node.mps.started() == []


def test_apply_layout_defers_a_busy_gpu_and_changes_idle_ones(state_node: StateNode) -> None:
    state = state_node.state()
    state.prepare(claim("u1", "gpu-0"))
    desired = {state_node.uuid(0): mps_shares(2), state_node.uuid(2): ts_shares(2)}
    view, deferred = state.apply_layout(make_view(state_node.inventory, {}), desired)
    assert deferred == {state_node.uuid(0)}
    assert "gpu-0" in view.targets and "gpu-0-mps-0" not in view.targets
    assert {"gpu-2-ts-0", "gpu-2-ts-1"} <= set(view.targets) and "gpu-2" not in view.targets
    assert state.view is view
    assert state_node.timeslicer.intervals == {state_node.uuid(2): "Long"}, "plan time slices are applied with the plan"

    state.unprepare(ref("u1"))
    view, deferred = state.apply_layout(make_view(state_node.inventory, {}), desired)
    assert deferred == set()
    assert {"gpu-0-mps-0", "gpu-0-mps-1"} <= set(view.targets) and "gpu-0" not in view.targets
    assert [c for c in state_node.timeslicer.calls if c[0] == "apply"] == [("apply", (state_node.uuid(2),), "Long")], \
        "an unchanged plan time slice is not applied again"


def test_removing_a_plan_time_slice_resets_the_gpu(state_node: StateNode) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(2): ts_shares(2)})
    view, _ = state.apply_layout(make_view(state_node.inventory, {}), {})
    assert state_node.timeslicer.intervals == {}
    assert "gpu-2" in view.targets


def test_prepare_after_layout_change_refuses_a_stale_share(state_node: StateNode) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(0): mps_shares(2)})
    state.apply_layout(make_view(state_node.inventory, {}), {})
    with pytest.raises(PrepareError, match="stale"):
        state.prepare(claim("u1", "gpu-0-mps-0"))


# ----------------------------------------------------------------------------- unprepare


def test_unprepare_of_an_unknown_claim_succeeds_and_removes_a_stray_spec(state_node: StateNode) -> None:
    state_node.paths.cdi_root.mkdir(parents=True)
    state_node.spec_path("ghost").write_text("{}")
    state = state_node.state()
    state.unprepare(ref("ghost"))
    state.unprepare(ref("never-seen"))
    assert state_node.cdi_files() == []


def test_unprepare_leaves_other_claims_alone(state_node: StateNode) -> None:
    state = state_node.state()
    state.prepare(claim("u1", "gpu-0"))
    state.prepare(claim("u2", "gpu-2"))
    state.unprepare(ref("u1"))
    assert [r.uid for r in state.prepared_claims()] == ["u2"]
    assert state_node.cdi_files() == ["k8s.gpu.tessera.dev-claim_u2.json"]


# ----------------------------------------------------------------------------- recover


def _mark_started(state_node: StateNode, uid: str) -> None:
    """Turn a completed claim back into PrepareStarted: what a crash before the final save leaves."""
    store = state_node.store
    cp = store.load()
    cp.claims[uid].phase = ClaimPhase.PREPARE_STARTED
    store.save(cp)


def test_recover_rolls_back_an_interrupted_prepare(state_node: StateNode) -> None:
    state_node.state().prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    state_node.state().prepare(claim("u2", "gpu-2"))
    _mark_started(state_node, "u1")
    [daemon_id] = state_node.mps.started()

    restarted = state_node.state()
    report = recover(restarted)
    assert report.rolled_back == ["u1"]
    assert state_node.mps.stopped_after_start(daemon_id) and daemon_id not in state_node.mps.running
    assert [r.uid for r in restarted.prepared_claims()] == ["u2"]
    assert state_node.cdi_files() == ["k8s.gpu.tessera.dev-claim_u2.json"]
    assert state_node.store.load().mps_daemons == {}


def test_recover_resets_the_time_slice_of_an_interrupted_prepare(state_node: StateNode) -> None:
    state_node.state().prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="TimeSlicing",
                                                                        timeSlicingConfig={"interval": "Medium"})]))
    assert state_node.timeslicer.intervals == {state_node.uuid(0): "Medium"}
    _mark_started(state_node, "u1")
    report = recover(state_node.state())
    assert report.rolled_back == ["u1"]
    assert state_node.timeslicer.intervals == {}, "the GPU goes back to the default time slice"
    assert state_node.cdi_files() == []


def test_retried_prepare_after_an_interrupted_one_succeeds(state_node: StateNode) -> None:
    state_node.state().prepare(claim("u1", "gpu-0"))
    _mark_started(state_node, "u1")
    state = state_node.state()
    devices = state.prepare(claim("u1", "gpu-0"))  # the kubelet retries before any recover()
    assert [d.device_name for d in devices] == ["gpu-0"]
    [record] = state.prepared_claims()
    assert record.phase == ClaimPhase.PREPARE_COMPLETED
    assert state_node.spec_path("u1").exists()


def test_recover_recreates_a_missing_cdi_spec(state_node: StateNode) -> None:
    state_node.state().prepare(claim("u1", "gpu-1-mig-2g20gb-4"))
    before = state_node.spec_json("u1")
    state_node.spec_path("u1").unlink()  # e.g. /var/run/cdi is a tmpfs and the node rebooted
    report = recover(state_node.state())
    assert report.cdi_recreated == ["u1"]
    assert report.rolled_back == []
    assert state_node.spec_json("u1") == before


def test_recover_removes_orphan_cdi_specs_only_of_this_driver(state_node: StateNode) -> None:
    state_node.state().prepare(claim("u1", "gpu-0"))
    orphan = state_node.paths.cdi_root / "k8s.gpu.tessera.dev-claim_orphan.json"
    orphan.write_text("{}")
    foreign = state_node.paths.cdi_root / "nvidia.com-gpu.yaml"
    foreign.write_text("kept: true\n")
    report = recover(state_node.state())
    assert "cdi spec k8s.gpu.tessera.dev-claim_orphan.json" in report.orphans_removed
    assert state_node.cdi_files() == ["k8s.gpu.tessera.dev-claim_u1.json", "nvidia.com-gpu.yaml"]


@pytest.mark.parametrize("torn", [b"", b"\0" * 64, b'{"cdiVersion": "0.6.0", "kind": "k8s.gpu.tes'])
def test_recover_rewrites_a_spec_a_power_failure_tore(state_node: StateNode, torn: bytes) -> None:
    # Specs are written without fsync (the PrepareCompleted record is the durable part): after a
    # power failure the renamed file may be empty, zero-filled or cut short.
    state_node.state().prepare(claim("u1", "gpu-0"))
    before = state_node.spec_json("u1")
    state_node.spec_path("u1").write_bytes(torn)
    report = recover(state_node.state())
    assert report.cdi_recreated == ["u1"]
    assert state_node.spec_json("u1") == before


def test_recover_restarts_a_dead_daemon_and_rewrites_the_spec(state_node: StateNode) -> None:
    state_node.state().prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    [daemon_id] = state_node.mps.started()
    old_pid = state_node.mps.running.pop(daemon_id).pid  # the daemon died with the node
    report = recover(state_node.state())
    assert report.daemons_restarted == [daemon_id]
    assert report.cdi_recreated == ["u1"]
    assert state_node.mps.running[daemon_id].pid != old_pid
    assert state_node.store.load().mps_daemons[daemon_id].pid == state_node.mps.running[daemon_id].pid


def test_recover_adopts_a_live_daemon(state_node: StateNode) -> None:
    state_node.state().prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    report = recover(state_node.state())
    assert report.daemons_restarted == [] and report.cdi_recreated == []
    assert len(state_node.mps.started()) == 1


def test_recover_stops_daemons_nobody_records(state_node: StateNode) -> None:
    state_node.state().prepare(claim("u1", "gpu-0"))
    state_node.mps.on_disk = ["claim-leftover-0"]
    report = recover(state_node.state())
    assert "mps directory claim-leftover-0" in report.orphans_removed
    assert ("stop_by_id", "claim-leftover-0") in state_node.mps.calls


def test_recover_rebuilds_from_cdi_specs_when_the_checkpoint_is_corrupt(state_node: StateNode) -> None:
    state_node.state().prepare(claim("u1", "gpu-0"))
    state_node.state().prepare(claim("u2", "gpu-1-mig-1g10gb-6"))
    (state_node.paths.state_dir / "checkpoint.json").write_text("{garbage")
    restarted = state_node.state()
    report = recover(restarted)
    assert report.rebuilt_from_cdi
    records = {r.uid: r for r in restarted.prepared_claims()}
    assert set(records) == {"u1", "u2"}
    assert [d.device.device_name for d in records["u2"].devices] == ["gpu-1-mig-1g10gb-6"]
    assert records["u2"].devices[0].kind == "mig"
    assert records["u1"].phase == ClaimPhase.PREPARE_COMPLETED
    assert any(".corrupt-" in p.name for p in state_node.paths.state_dir.iterdir())
    restarted.unprepare(ref("u1"))  # and the rebuilt records can be unprepared normally
    assert state_node.cdi_files() == ["k8s.gpu.tessera.dev-claim_u2.json"]


def test_recover_republishes_the_previous_layout(state_node: StateNode) -> None:
    first = state_node.state()
    first.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(0): mps_shares(2)})
    first.prepare(claim("u1", "gpu-0-mps-0"))
    restarted = state_node.state()
    assert "gpu-0" in restarted.view.targets  # built with no layout
    recover(restarted)
    assert "gpu-0-mps-0" in restarted.view.targets and "gpu-0" not in restarted.view.targets
    assert [r.uid for r in restarted.prepared_claims()] == ["u1"]


def test_prepared_count_does_not_wait_for_the_node_lock(state_node: StateNode) -> None:
    state = state_node.state()
    assert state.prepared_count() == 0
    state.prepare(claim("u1", "gpu-0"))
    # Another process (the other pod of a rolling update) holds the node lock, as during a slow
    # MPS start: a metrics scrape must still answer at once.
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, sys, time; f = open(sys.argv[1], 'a'); fcntl.flock(f, fcntl.LOCK_EX); "
        "print('held', flush=True); time.sleep(30)"), str(state_node.paths.state_dir / "state.lock")],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        assert state.prepared_count() == 1
    finally:
        holder.kill()
        holder.wait()


# ----------------------------------------------------------------------------- review fixes


def test_devices_are_resolved_under_the_lock_so_a_concurrent_plan_change_cannot_hand_out_a_gpu_twice(
        state_node: StateNode, monkeypatch: pytest.MonkeyPatch) -> None:
    state = state_node.state()
    real_held = state.node_lock.held

    @contextlib.contextmanager
    def held_after_a_rescan() -> Iterator[None]:
        with real_held():
            # What a rescan that won the lock just before this prepare leaves behind.
            state._view = make_view(state_node.inventory, {state_node.uuid(0): mps_shares(2)})
            yield

    monkeypatch.setattr(state.node_lock, "held", held_after_a_rescan)
    with pytest.raises(PrepareError, match="'gpu-0' is not published"):
        state.prepare(claim("whole", "gpu-0"))
    assert state_node.cdi_files() == []


def test_a_claim_needing_two_mps_daemons_is_refused(state_node: StateNode) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(0): mps_shares(2),
                                                             state_node.uuid(2): mps_shares(2)})
    with pytest.raises(PrepareError, match="2 MPS daemons"):
        state.prepare(claim("two-gpus", "gpu-0-mps-0", "gpu-2-mps-0"))
    with pytest.raises(PrepareError, match="single CUDA process"):
        mig_mps = {"source": "FromClaim", "requests": ["r1"], "opaque": {"driver": DRIVER, "parameters": {
            "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}}}}
        state.prepare(claim("share-and-mig", "gpu-0-mps-1", "gpu-1-mig-1g10gb-6", configs=[mig_mps]))
    assert state_node.mps.started() == [] and state_node.cdi_files() == []


def test_after_a_reboot_time_slices_are_applied_again(state_node: StateNode) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(2): ts_shares(2)})
    state.prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="TimeSlicing",
                                                           timeSlicingConfig={"interval": "Medium"})]))
    cp = state_node.store.load()
    state_node.store.save(cp.model_copy(update={"boot_id": "an-earlier-boot"}))
    state_node.timeslicer.intervals.clear()  # a reboot forgets GPU settings
    restarted = state_node.state()
    recover(restarted)
    assert state_node.timeslicer.intervals == {state_node.uuid(0): "Medium"}
    restarted.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(2): ts_shares(2)})
    assert state_node.timeslicer.intervals == {state_node.uuid(0): "Medium", state_node.uuid(2): "Long"}


def test_one_gpu_refusing_a_plan_time_slice_does_not_block_the_others(state_node: StateNode,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    state = state_node.state()
    real_apply = state_node.timeslicer.apply

    def refuse_gpu0(gpu_uuids: list[str], interval: TimeSliceInterval) -> None:
        if state_node.uuid(0) in gpu_uuids:
            raise TimeSliceError("compute-policy is not supported on this GPU")
        real_apply(gpu_uuids, interval)

    monkeypatch.setattr(state_node.timeslicer, "apply", refuse_gpu0)
    state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(0): ts_shares(2),
                                                             state_node.uuid(2): ts_shares(2)})
    assert state_node.timeslicer.intervals == {state_node.uuid(2): "Long"}
    assert state_node.store.load().plan_timeslices == {state_node.uuid(2): "Long"}, "only what was done is recorded"


def test_recovery_survives_a_daemon_that_cannot_be_stopped(
        state_node: StateNode, monkeypatch: pytest.MonkeyPatch) -> None:
    state_node.mps.on_disk.append("claim-stuck-0")

    def stuck(daemon_id: str, deadline: Deadline | None = None) -> None:
        raise MpsError(f"MPS control daemon {daemon_id} still running after SIGKILL")

    monkeypatch.setattr(state_node.mps, "stop_by_id", stuck)
    state = state_node.state()
    recover(state)  # does not raise: logged and retried at the next start
    state.prepare(claim("u1", "gpu-0"))


def test_a_rebuilt_checkpoint_keeps_shares_daemons_and_time_slices(state_node: StateNode) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(2): mps_shares(2)})
    state.prepare(claim("share", "gpu-2-mps-0"))
    state.prepare(claim("ts", "gpu-0", configs=[gpu_config(strategy="TimeSlicing",
                                                           timeSlicingConfig={"interval": "Short"})]))
    [daemon_id] = state_node.mps.started()
    (state_node.paths.state_dir / "checkpoint.json").write_text("{garbage")

    restarted = state_node.state()
    report = recover(restarted)
    assert report.rebuilt_from_cdi
    assert daemon_id in state_node.mps.running, "the running workload keeps its MPS daemon"
    assert sorted(state_node.cdi_files()) == ["k8s.gpu.tessera.dev-claim_share.json",
                                              "k8s.gpu.tessera.dev-claim_ts.json"]
    assert "gpu-2-mps-0" in restarted.view.targets, "the GPU keeps its published form"
    records = {r.uid: r for r in restarted.prepared_claims()}
    assert records["share"].shared_mps_daemons == [daemon_id]
    assert records["ts"].timeslice is not None and records["ts"].timeslice.interval == "Short"
    restarted.unprepare(ref("share"))
    assert daemon_id not in state_node.mps.running, "unprepare still stops the daemon"
    restarted.unprepare(ref("ts"))
    assert ("reset", (state_node.uuid(0),), None) in state_node.timeslicer.calls


def test_installations_under_different_driver_names_leave_each_other_alone(state_node: StateNode) -> None:
    state_node.state().prepare(claim("u1", "gpu-0"))
    other = DeviceState(driver_name="gpu.other.example", pool_name=POOL, paths=state_node.paths,
                        toolkit=state_node.toolkit,
                        mps=state_node.mps, timeslicer=state_node.timeslicer, compute_modes=state_node.modes,
                        view=make_view(state_node.inventory, {}), lock_timeout=5)
    recover(other)
    assert state_node.cdi_files() == ["k8s.gpu.tessera.dev-claim_u1.json"]


def test_rescan_restarts_a_daemon_that_died(state_node: StateNode) -> None:
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(2): mps_shares(2)})
    state.prepare(claim("share", "gpu-2-mps-0"))
    [daemon_id] = state_node.mps.started()
    state_node.mps.running.pop(daemon_id)  # killed with an old plugin container
    assert revive_daemons(state) == [daemon_id]
    assert daemon_id in state_node.mps.running
    assert revive_daemons(state) == []


def test_leftover_temporary_files_are_removed_at_start(state_node: StateNode) -> None:
    state_node.paths.cdi_root.mkdir(parents=True)
    tmp = state_node.paths.cdi_root / ".k8s.gpu.tessera.dev-claim_u9.json.abc123.tmp"
    tmp.write_text("{")
    foreign = state_node.paths.cdi_root / ".nvidia.yaml.tmp"
    foreign.write_text("{")
    recover(state_node.state())
    assert not tmp.exists() and foreign.exists()


class _Crash(BaseException):
    """Stands for the process dying: not an Exception, so no rollback runs."""


def test_a_crash_after_the_spec_is_written_is_rolled_back_at_start(state_node: StateNode,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    state = state_node.state()
    real_save = state.ledger.store.save
    saves: list[str] = []

    def crash_on_completion(cp: Any, **kwargs: Any) -> None:
        saves.append(cp.claims["u1"].phase.value)
        if cp.claims["u1"].phase == ClaimPhase.PREPARE_COMPLETED:
            raise _Crash()
        real_save(cp, **kwargs)

    monkeypatch.setattr(state.ledger.store, "save", crash_on_completion)
    with pytest.raises(_Crash):
        state.prepare(claim("u1", "gpu-0"))
    assert saves == ["PrepareStarted", "PrepareCompleted"], "the reservation is durable before the spec is written"
    assert state_node.cdi_files() == ["k8s.gpu.tessera.dev-claim_u1.json"], "written, never completed"
    restarted = state_node.state()
    assert recover(restarted).rolled_back == ["u1"]
    assert state_node.cdi_files() == [] and restarted.prepared_claims() == []
    restarted.prepare(claim("u1", "gpu-0"))  # the kubelet's retry succeeds
    assert state_node.cdi_files() == ["k8s.gpu.tessera.dev-claim_u1.json"]


def test_a_claim_with_an_mps_daemon_records_its_intent_before_starting_it(state_node: StateNode,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    state = state_node.state()
    phases: list[str] = []
    real_start = state_node.mps.start

    def start(spec: MpsDaemonSpec, deadline: Deadline | None = None) -> MpsDaemonRecord:
        phases.append(state_node.store.load().claims["u1"].phase.value)
        return real_start(spec, deadline)

    monkeypatch.setattr(state_node.mps, "start", start)
    state.prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    assert phases == ["PrepareStarted"]


def test_a_shared_daemon_whose_record_was_lost_with_the_checkpoint_is_adopted_not_restarted(
        state_node: StateNode) -> None:
    gpu = state_node.uuid(0)
    first = state_node.state()
    first.apply_layout(make_view(state_node.inventory, {}), {gpu: mps_shares(2)})
    first.prepare(claim("u1", "gpu-0-mps-0"))
    [daemon_id] = state_node.mps.started()
    pid = state_node.mps.running[daemon_id].pid
    (state_node.paths.state_dir / "checkpoint.json").write_text("{garbage")
    restarted = state_node.state()
    assert recover(restarted).rebuilt_from_cdi
    restarted.prepare(claim("u2", "gpu-0-mps-1"))  # the second share of the GPU the first one's daemon serves
    assert state_node.mps.started() == [daemon_id], "u1's clients keep their daemon"
    assert state_node.mps.running[daemon_id].pid == pid and not state_node.mps.stopped_after_start(daemon_id)


def test_a_stale_inventory_is_not_applied_and_the_view_in_force_stays(state_node: StateNode) -> None:
    state = state_node.state()
    before, _ = state.apply_layout(make_view(state_node.inventory, {}), {state_node.uuid(2): mps_shares(2)})
    # The caller's inventory went stale while it was read (a MIG instance destroyed since): nothing changes.
    view, deferred = state.apply_layout(make_view(state_node.inventory, {}), {}, current=lambda: False)
    assert view is before is state.view and deferred == set()
    assert "gpu-2-mps-0" in state.view.targets and "gpu-2" not in state.view.targets
