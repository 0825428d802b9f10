"""DeviceState: compute modes around MPS daemons, MIG with MPS, deadlines, and per-GPU locking.

Uses the simulated node and fakes of ``tests/support/statenode.py`` (gpu-0 H100 whole, gpu-1 H100 with MIG,
gpu-2 L4); the last tests run the nvidia-smi stand-in for real to make one GPU's calls hang, with compute
modes through the simulated NVML (which keeps them in the stand-in's state file).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.errors import PrepareError
from driver.gpu.mps.locallauncher import LocalLauncher
from driver.gpu.mps.manager import MpsManager
from driver.gpu.mps.model import MpsDaemonRecord, MpsDaemonSpec
from driver.gpu.published.devices import make_view
from driver.gpu.recovery import recover
from driver.gpu.runtime.computemode import NvmlComputeModes
from driver.gpu.runtime.timeslice import TimeSlicer
from driver.gpu.state import DeviceState
from driver.kubeletplugin.types import Deadline
from driver.simulation.nvmlcompute import SimulatedNvml
from tests.support.processes import install_standin
from tests.support.statenode import DRIVER, POOL, StateNode, claim, gpu_config, mps_shares, ref

MIG_A = "gpu-1-mig-1g10gb-6"
MIG_B = "gpu-1-mig-2g20gb-4"


def mig_mps_config(*requests: str) -> dict[str, Any]:
    return {"source": "FromClaim", "requests": list(requests), "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "MigDeviceConfig", "sharing": {"strategy": "MPS"}}}}


def nvml_modes(driver_root: Path) -> NvmlComputeModes:
    """Compute modes as the simulated node's driver has them (driver.nodelayout.open_compute_modes)."""
    return NvmlComputeModes(SimulatedNvml.for_driver_root(driver_root, os.environ))


def wait_for(event: threading.Event, what: str) -> None:
    assert event.wait(timeout=30), f"never happened: {what}"


# ----------------------------------------------------------------------------- compute mode


def test_mps_holds_exclusive_process_until_the_last_daemon_user_goes_then_restores_the_old_mode(
        state_node: StateNode) -> None:
    gpu = state_node.uuid(0)
    state_node.modes.modes[gpu] = ComputeMode.PROHIBITED  # what an operator set before
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {gpu: mps_shares(2)})
    state.prepare(claim("a", "gpu-0-mps-0"))
    assert state_node.modes.modes[gpu] == ComputeMode.EXCLUSIVE_PROCESS
    assert state_node.store.load().compute_modes == {gpu: ComputeMode.PROHIBITED}
    state.prepare(claim("b", "gpu-0-mps-1"))
    state.unprepare(ref("a"))
    assert state_node.modes.modes[gpu] == ComputeMode.EXCLUSIVE_PROCESS, "claim b's daemon still serves the GPU"
    state.unprepare(ref("b"))
    assert state_node.modes.modes[gpu] == ComputeMode.PROHIBITED
    assert state_node.modes.sets == [(gpu, ComputeMode.EXCLUSIVE_PROCESS), (gpu, ComputeMode.PROHIBITED)]
    assert state_node.store.load().compute_modes == {}


def test_the_previous_mode_is_recorded_before_the_mode_changes_and_before_the_daemon_starts(
        state_node: StateNode, monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = state_node.uuid(0)
    seen: list[tuple[str, dict[str, ComputeMode]]] = []
    real_set, real_start = state_node.modes.set, state_node.mps.start

    def recording_set(uuid: str, mode: ComputeMode, deadline: Deadline | None = None) -> None:
        seen.append(("set", dict(state_node.store.load().compute_modes)))
        real_set(uuid, mode, deadline)

    def recording_start(spec: MpsDaemonSpec, deadline: Deadline | None = None) -> MpsDaemonRecord:
        seen.append(("start", dict(state_node.store.load().compute_modes)))
        return real_start(spec, deadline)

    monkeypatch.setattr(state_node.modes, "set", recording_set)
    monkeypatch.setattr(state_node.mps, "start", recording_start)
    state_node.state().prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    assert seen == [("set", {gpu: ComputeMode.DEFAULT}), ("start", {gpu: ComputeMode.DEFAULT})]
    [record] = state_node.store.load().claims.values()
    assert record.exclusive_gpus == [gpu]


def test_a_refused_compute_mode_fails_the_claim_and_leaves_nothing(state_node: StateNode) -> None:
    state_node.modes.fail_set = state_node.uuid(0)
    state = state_node.state()
    with pytest.raises(PrepareError, match=r"compute mode of GPU-.*exited 3"):
        state.prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    assert state_node.mps.started() == [], "no daemon without EXCLUSIVE_PROCESS"
    cp = state_node.store.load()
    assert cp.claims == {} and cp.compute_modes == {} and state_node.cdi_files() == []
    assert state_node.modes.modes == {}


def test_a_daemon_on_a_mig_device_leaves_the_compute_mode_alone(state_node: StateNode) -> None:
    state = state_node.state()
    state.prepare(claim("u1", MIG_A, configs=[mig_mps_config()]))
    assert len(state_node.mps.started()) == 1
    assert state_node.modes.sets == [], "MIG-enabled GPUs stay in DEFAULT (the only mode MIG allows)"
    [record] = state.prepared_claims()
    assert record.exclusive_gpus == []


def test_recovery_restores_a_mode_whose_last_daemon_went_during_a_crash(state_node: StateNode) -> None:
    gpu = state_node.uuid(0)
    state_node.state().prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    cp = state_node.store.load()
    cp.claims.clear()  # as if the crash came after the claim was forgotten, before the mode was restored
    state_node.store.save(cp)
    recover(state_node.state())
    assert state_node.modes.modes[gpu] == ComputeMode.DEFAULT
    assert state_node.store.load().compute_modes == {}


def test_after_a_reboot_exclusive_process_is_set_again(state_node: StateNode) -> None:
    gpu = state_node.uuid(0)
    state_node.modes.modes[gpu] = ComputeMode.PROHIBITED
    state_node.state().prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    cp = state_node.store.load()
    state_node.store.save(cp.model_copy(update={"boot_id": "an-earlier-boot"}))
    state_node.modes.modes.clear()  # a reboot resets every GPU to DEFAULT
    recover(state_node.state())
    assert state_node.modes.modes[gpu] == ComputeMode.EXCLUSIVE_PROCESS
    assert state_node.store.load().compute_modes == {gpu: ComputeMode.DEFAULT}, (
        "the pre-reboot mode is gone with the boot")


def test_a_rebuilt_checkpoint_still_restores_default_after_the_last_daemon(state_node: StateNode) -> None:
    gpu = state_node.uuid(0)
    state_node.state().prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    (state_node.paths.state_dir / "checkpoint.json").write_text("{garbage")
    restarted = state_node.state()
    assert recover(restarted).rebuilt_from_cdi
    assert state_node.store.load().compute_modes == {gpu: ComputeMode.DEFAULT}
    restarted.unprepare(ref("u1"))
    assert state_node.modes.modes[gpu] == ComputeMode.DEFAULT


# ----------------------------------------------------------------------------- MIG and MPS


def test_one_mps_daemon_for_two_mig_devices_is_refused_before_anything_happens(state_node: StateNode) -> None:
    state = state_node.state()
    with pytest.raises(PrepareError, match=f"{MIG_A}, {MIG_B}.*single CUDA process"):
        state.prepare(claim("two-migs", MIG_A, MIG_B, configs=[mig_mps_config()]))
    assert state_node.mps.calls == [] and state_node.modes.sets == [] and state_node.cdi_files() == []
    assert state_node.store.load().claims == {}


def test_a_mig_device_and_a_whole_gpu_under_mps_are_refused(state_node: StateNode) -> None:
    state = state_node.state()
    with pytest.raises(PrepareError, match="no MIG device next to a whole GPU"):
        state.prepare(claim("mixed", "gpu-0", MIG_A,
                            configs=[gpu_config(strategy="MPS"), mig_mps_config("r1")]))
    assert state_node.mps.calls == [] and state_node.store.load().claims == {}


def test_mig_devices_without_mps_can_share_a_claim(state_node: StateNode) -> None:
    state_node.state().prepare(claim("plain", MIG_A, MIG_B))
    assert state_node.mps.calls == []


# ----------------------------------------------------------------------------- deadlines


def test_work_the_kubelet_gave_up_on_is_rolled_back_not_completed(state_node: StateNode,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    kubelet_waiting = threading.Event()
    kubelet_waiting.set()
    real_start = state_node.mps.start

    def start_then_kubelet_gives_up(spec: MpsDaemonSpec, deadline: Deadline | None = None) -> MpsDaemonRecord:
        record = real_start(spec, deadline)
        kubelet_waiting.clear()  # the kubelet's call timed out while the daemon was starting
        return record

    monkeypatch.setattr(state_node.mps, "start", start_then_kubelet_gives_up)
    state = state_node.state()
    with pytest.raises(PrepareError, match=r"kubelet gave up.*rolled back"):
        state.prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]),
                      Deadline.after(30, kubelet_waiting.is_set))
    [daemon_id] = state_node.mps.started()
    assert state_node.mps.stopped_after_start(daemon_id)
    assert state_node.modes.modes[state_node.uuid(0)] == ComputeMode.DEFAULT
    cp = state_node.store.load()
    assert cp.claims == {} and cp.compute_modes == {} and cp.mps_daemons == {} and state_node.cdi_files() == []


def test_a_passed_deadline_prepares_nothing(state_node: StateNode) -> None:
    with pytest.raises(PrepareError, match="deadline passed"):
        state_node.state().prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]), Deadline.after(0))
    assert state_node.mps.calls == [] and state_node.store.load().claims == {} and state_node.cdi_files() == []


# ----------------------------------------------------------------------------- per-GPU locks


class BlockingStart:
    """Makes the fake MPS start of the GPUs in ``blocked`` wait until ``release`` is set."""

    def __init__(self, state_node: StateNode, blocked: set[str]) -> None:
        self.node, self.blocked = state_node, blocked
        self.entered, self.release = threading.Event(), threading.Event()
        self.real_start = state_node.mps.start

    def __call__(self, spec: MpsDaemonSpec, deadline: Deadline | None = None) -> MpsDaemonRecord:
        if set(spec.gpu_uuids) & self.blocked:
            self.entered.set()
            wait_for(self.release, "the test releasing the blocked daemon start")
        return self.real_start(spec, deadline)


def prepare_in_thread(state: DeviceState, c: Any) -> tuple[threading.Thread, list[object]]:
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(state.prepare(c))
        except Exception as exc:
            outcome.append(exc)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def test_a_hanging_daemon_start_on_one_gpu_does_not_hold_up_a_claim_on_another(
        state_node: StateNode, monkeypatch: pytest.MonkeyPatch) -> None:
    blocking = BlockingStart(state_node, {state_node.uuid(0)})
    monkeypatch.setattr(state_node.mps, "start", blocking)
    state = state_node.state()
    thread, outcome = prepare_in_thread(state, claim("slow", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    try:
        wait_for(blocking.entered, "the daemon start on gpu-0")
        devices = state.prepare(claim("fast", "gpu-2", configs=[gpu_config(strategy="MPS")]))
        assert [d.device_name for d in devices] == ["gpu-2"]
        assert state.prepared_claims()[-1].uid == "fast" and outcome == [], "gpu-0's claim is still starting"
    finally:
        blocking.release.set()
        thread.join()
    assert not isinstance(outcome[0], Exception)
    assert {r.uid for r in state.prepared_claims()} == {"slow", "fast"}


def test_two_claims_on_one_gpu_take_turns_and_share_one_plan_daemon(state_node: StateNode,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    gpu = state_node.uuid(0)
    blocking = BlockingStart(state_node, {gpu})
    monkeypatch.setattr(state_node.mps, "start", blocking)
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {gpu: mps_shares(2)})
    first, first_outcome = prepare_in_thread(state, claim("a", "gpu-0-mps-0"))
    wait_for(blocking.entered, "the plan daemon start for claim a")
    second, second_outcome = prepare_in_thread(state, claim("b", "gpu-0-mps-1"))
    blocking.release.set()
    first.join()
    second.join()
    assert [o for o in (*first_outcome, *second_outcome) if isinstance(o, Exception)] == []
    assert len(state_node.mps.started()) == 1, "the second claim adopted the daemon the first one started"
    assert state_node.modes.sets == [(gpu, ComputeMode.EXCLUSIVE_PROCESS)]


# ----------------------------------------------------------------------------- the nvidia-smi stand-in, hanging


@pytest.fixture
def smi_node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[StateNode, DeviceState, Path]:
    """A node whose time slices go through the real nvidia-smi stand-in, its compute modes through the
    simulated NVML, both in the stand-in's state file."""
    state_node = StateNode(tmp_path)
    root = tmp_path / "driver-root"
    (root / "usr" / "bin").mkdir(parents=True)
    install_standin("nvidia-smi", root / "usr" / "bin")
    calls = tmp_path / "nvidia-smi-calls.jsonl"
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_LOG", str(calls))
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_STATE", str(tmp_path / "nvidia-smi-state.json"))
    monkeypatch.delenv("TESSERA_SIM_NVIDIA_SMI_FAIL", raising=False)
    monkeypatch.setenv("TESSERA_SIM_NVML_LOG", str(tmp_path / "nvml-calls.jsonl"))
    monkeypatch.delenv("TESSERA_SIM_NVML_FAIL", raising=False)
    modes = nvml_modes(root)
    state = DeviceState(driver_name=DRIVER, pool_name=POOL, paths=state_node.paths, toolkit=state_node.toolkit,
                        mps=state_node.mps, timeslicer=TimeSlicer(root, modes, timeout=2.0),
                        view=make_view(state_node.inventory, {}), lock_timeout=5, compute_modes=modes)
    return state_node, state, calls


def test_a_hanging_nvidia_smi_on_one_gpu_does_not_hold_up_a_claim_on_another(
        smi_node: tuple[StateNode, DeviceState, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    state_node, state, calls = smi_node
    slow_gpu, fast_gpu = state_node.uuid(0), state_node.uuid(2)
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_HANG", f"-i {slow_gpu} --set-timeslice 3")
    timeslicing = [gpu_config(strategy="TimeSlicing", timeSlicingConfig={"interval": "Long"})]
    thread, outcome = prepare_in_thread(state, claim("slow", "gpu-0", configs=timeslicing))
    hanging = threading.Event()

    def watch() -> None:
        while thread.is_alive() and not hanging.is_set():
            if calls.exists() and f'"{slow_gpu}", "--set-timeslice"' in calls.read_text():
                hanging.set()
            hanging.wait(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        wait_for(hanging, "nvidia-smi hanging on gpu-0")
        state.prepare(claim("fast", "gpu-2", configs=timeslicing))
        assert outcome == [], "gpu-0's claim is still waiting for its nvidia-smi"
        assert ["compute-policy", "-i", fast_gpu, "--set-timeslice", "3"] in [
            json.loads(line) for line in calls.read_text().splitlines()]
    finally:
        thread.join()
        watcher.join()
    assert isinstance(outcome[0], PrepareError) and "did not finish within" in str(outcome[0])
    assert [r.uid for r in state.prepared_claims()] == ["fast"], "the timed-out claim was rolled back"
    assert state_node.cdi_files() == ["k8s.gpu.tessera.dev-claim_fast.json"]


def test_compute_mode_through_the_simulated_nvml_is_read_set_and_restored(
        smi_node: tuple[StateNode, DeviceState, Path], tmp_path: Path) -> None:
    state_node, state, calls = smi_node
    gpu = state_node.uuid(0)
    modes = nvml_modes(state_node.root / "driver-root")
    modes.set(gpu, ComputeMode.PROHIBITED)
    state.prepare(claim("u1", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    assert modes.get(gpu) == ComputeMode.EXCLUSIVE_PROCESS
    state.unprepare(ref("u1"))
    assert modes.get(gpu) == ComputeMode.PROHIBITED
    sets = [c["mode"] for c in SimulatedNvml.for_driver_root(tmp_path, os.environ).calls()
            if c["call"] == "nvmlDeviceSetComputeMode"]
    assert sets == ["PROHIBITED", "EXCLUSIVE_PROCESS", "PROHIBITED"]
    assert not calls.exists(), "no nvidia-smi ran: compute modes go through NVML in the driver's process"


def test_turning_on_multi_user_mode_does_not_restart_a_shared_daemon_under_its_claims(state_node: StateNode) -> None:
    gpu = state_node.uuid(0)
    state = state_node.state()
    state.apply_layout(make_view(state_node.inventory, {}), {gpu: mps_shares(2)})
    state.prepare(claim("a", "gpu-0-mps-0"))
    upgraded = state_node.state()
    upgraded.mps_multi_user = True  # a newer driver on a node whose MPS has multi-user mode
    recover(upgraded)
    upgraded.prepare(claim("b", "gpu-0-mps-1"))
    [daemon_id] = state_node.mps.started()
    assert not state_node.mps.stopped_after_start(daemon_id)


def test_a_hanging_mps_daemon_on_one_gpu_does_not_hold_up_a_claim_on_another(
        smi_node: tuple[StateNode, DeviceState, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        request: pytest.FixtureRequest) -> None:
    state_node, fake_state, _ = smi_node
    root = state_node.root / "driver-root"  # the smi_node fixture's driver root
    install_standin("nvidia-cuda-mps-control", root / "usr" / "bin")
    journal = tmp_path / "mps-journal.jsonl"
    monkeypatch.setenv("TESSERA_SIM_MPS_JOURNAL", str(journal))
    monkeypatch.setenv("TESSERA_SIM_MPS_FAIL", "hang")  # daemons listen but never answer
    # A short base dir: under pytest-xdist tmp_path is too long for the daemon's Unix socket paths.
    short = Path(tempfile.mkdtemp(prefix="tsl-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(short, ignore_errors=True))
    mps = MpsManager(root, short / "mps", LocalLauncher(root), shm_dir=short / "mps-shm",
                     ready_timeout=2.0, stop_timeout=0.5)
    state = DeviceState(driver_name=DRIVER, pool_name=POOL, paths=state_node.paths, toolkit=state_node.toolkit, mps=mps,
                        timeslicer=fake_state.sharing.timeslicer, view=make_view(state_node.inventory,
                                                                                 {}), lock_timeout=5,
                        compute_modes=nvml_modes(root))
    modes = nvml_modes(root)
    thread, outcome = prepare_in_thread(state, claim("slow", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    started = threading.Event()

    def watch() -> None:
        while thread.is_alive() and not started.is_set():
            if journal.exists() and '"start"' in journal.read_text():
                started.set()
            started.wait(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        wait_for(started, "the MPS daemon for gpu-0 starting")
        state.prepare(claim("fast", "gpu-2", configs=[gpu_config(strategy="TimeSlicing")]))
        assert outcome == [], "gpu-0's daemon is still not answering"
    finally:
        thread.join()
        watcher.join()
    assert isinstance(outcome[0], PrepareError) and "MPS" in str(outcome[0])
    assert [r.uid for r in state.prepared_claims()] == ["fast"]
    assert modes.get(state_node.uuid(0)) == ComputeMode.DEFAULT, "the failed claim's compute mode was rolled back"
    assert mps.daemon_ids_on_disk() == []


def test_a_starting_pod_never_rolls_back_a_prepare_the_other_pod_is_still_doing(
        state_node: StateNode, monkeypatch: pytest.MonkeyPatch) -> None:
    blocking = BlockingStart(state_node, {state_node.uuid(0)})
    monkeypatch.setattr(state_node.mps, "start", blocking)
    old_pod, new_pod = state_node.state(), state_node.state()  # a rolling update: two plugin pods, one state directory
    thread, outcome = prepare_in_thread(old_pod, claim("busy", "gpu-0", configs=[gpu_config(strategy="MPS")]))
    wait_for(blocking.entered, "the old pod starting the claim's daemon")
    assert state_node.store.load().claims["busy"].phase == "PrepareStarted"
    real_held = new_pod.gpu_locks.held

    def held_once_the_old_pod_may_go_on(gpus: Any, timeout: float, purpose: str) -> Any:
        blocking.release.set()  # the old pod finishes only once recovery is at the GPU locks
        return real_held(gpus, timeout, purpose)

    monkeypatch.setattr(new_pod.gpu_locks, "held", held_once_the_old_pod_may_go_on)
    reports: list[Any] = []
    recovering = threading.Thread(target=lambda: reports.append(recover(new_pod)))
    recovering.start()
    thread.join()
    recovering.join()
    assert not isinstance(outcome[0], Exception)
    assert reports[0].rolled_back == [], "recovery waited for the GPU instead of undoing a live prepare"
    [record] = new_pod.prepared_claims()
    assert record.phase == "PrepareCompleted" and state_node.cdi_files() == ["k8s.gpu.tessera.dev-claim_busy.json"]
    [daemon_id] = state_node.mps.started()
    assert not state_node.mps.stopped_after_start(daemon_id)
