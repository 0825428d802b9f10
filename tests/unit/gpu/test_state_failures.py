"""DeviceState when a rollback fails, the checkpoint is rebuilt while the driver runs, or a plan reset waits.

Uses the simulated node and fakes of ``tests/support/statenode.py`` (gpu-0 H100 whole, gpu-2 L4).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.errors import PrepareError
from driver.gpu.mps.model import MpsDaemonRecord, MpsError
from driver.gpu.published.devices import make_view
from driver.gpu.record.checkpoint import ClaimPhase
from driver.gpu.runtime.timeslice import TimeSliceError
from driver.gpu.watch.daemonwatch import revive_daemons
from driver.kubeletplugin.types import Deadline
from tests.support.statenode import StateNode, claim, gpu_config, mps_shares, ref, ts_shares


def test_a_failing_rollback_of_an_interrupted_prepare_is_the_claims_error(state_node: StateNode,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    mps_claim = claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")])
    state_node.state().prepare(mps_claim)
    cp = state_node.store.load()
    cp.claims["u1"].phase = ClaimPhase.PREPARE_STARTED  # what a crash before PrepareCompleted leaves
    state_node.store.save(cp)

    def stuck(record: MpsDaemonRecord, deadline: Deadline | None = None) -> None:
        raise MpsError(f"MPS control daemon {record.spec.daemon_id} still running after SIGKILL")

    monkeypatch.setattr(state_node.mps, "stop", stuck)
    with pytest.raises(PrepareError, match="still running after SIGKILL"):
        state_node.state().prepare(mps_claim)
    assert state_node.store.load().claims["u1"].phase == ClaimPhase.PREPARE_STARTED, "kept for the next rollback"


def test_unprepare_after_a_checkpoint_rebuilt_while_running_restores_the_compute_mode(state_node: StateNode) -> None:
    gpu = state_node.uuid(0)
    state = state_node.state()
    state.prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    assert state_node.modes.modes[gpu] == ComputeMode.EXCLUSIVE_PROCESS
    (state_node.paths.state_dir / "checkpoint.json").write_text("{garbage")  # found corrupt by the next read
    state.unprepare(ref("u1"))
    assert state_node.modes.modes[gpu] == ComputeMode.DEFAULT
    assert state_node.store.load().compute_modes == {}


def test_a_plan_time_slice_reset_left_to_a_later_rescan_keeps_a_claims_own(state_node: StateNode,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = state_node.uuid(2)
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {gpu: ts_shares(2)})
    real_reset = state_node.timeslicer.reset

    def refuse(gpu_uuids: Sequence[str]) -> None:
        raise TimeSliceError("simulated nvidia-smi exit 3")

    monkeypatch.setattr(state_node.timeslicer, "reset", refuse)
    state.apply_layout(make_view(state_node.inventory, {}), {})  # gpu-2 published whole; its reset failed
    assert state_node.store.load().plan_timeslices == {gpu: "Long"}
    monkeypatch.setattr(state_node.timeslicer, "reset", real_reset)
    state.prepare(claim("u1", "gpu-2", configs=[gpu_config(strategy="TimeSlicing",
                                                           timeSlicingConfig={"interval": "Short"})]))
    state.apply_layout(make_view(state_node.inventory, {}), {})  # the next rescan
    assert state_node.timeslicer.intervals == {gpu: "Short"}, "the claim's own time slice stays"
    assert state_node.store.load().plan_timeslices == {}


def test_a_rescan_does_not_revive_the_daemon_of_a_prepare_whose_rollback_is_pending(state_node: StateNode) -> None:
    state = state_node.state()
    state.prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    [daemon_id] = state_node.mps.started()
    cp = state_node.store.load()
    cp.claims["u1"].phase = ClaimPhase.PREPARE_STARTED  # a failed prepare whose rollback stopped half-way:
    state_node.store.save(cp)
    state_node.spec_path("u1").unlink()  # its spec removed, its daemon's stop failed and the daemon died since
    state_node.mps.running.pop(daemon_id)
    assert revive_daemons(state) == []
    assert state_node.mps.running == {} and state_node.cdi_files() == []


def test_a_gpu_held_whole_is_not_handed_out_again_as_a_share_by_a_stale_view(state_node: StateNode) -> None:
    state = state_node.state()
    state.prepare(claim("whole", "gpu-0"))
    # What the other plugin pod of a rolling update, with a new sharing plan, may have published.
    state.set_view(make_view(state_node.inventory, {state_node.uuid(0): mps_shares(2)}))
    with pytest.raises(PrepareError, match="already prepared for claim default/claim-whole"):
        state.prepare(claim("share", "gpu-0-mps-0"))
    assert [r.uid for r in state.prepared_claims()] == ["whole"] and state_node.mps.calls == []
