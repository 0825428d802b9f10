"""Compute modes: parsing nvidia-smi's answer, which GPUs MPS makes exclusive, and the nvidia-smi stand-in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from driver.gpu.runtime.computemode import ComputeMode, ComputeModeError, ComputeModes, exclusive_gpus, parse_query
from driver.gpu.runtime.gpulocks import GpuBusy, GpuLocks
from driver.kubeletplugin.types import Deadline, DeadlineExceeded
from tests.support.processes import install_standin

GPU_A = "GPU-11111111-2222-3333-4444-555555555555"
MIG_A = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


@pytest.mark.parametrize(("printed", "mode"), [("Default", ComputeMode.DEFAULT),
                                               ("Exclusive_Process\n", ComputeMode.EXCLUSIVE_PROCESS),
                                               (" Prohibited ", ComputeMode.PROHIBITED)])
def test_the_query_answer_is_read_as_nvidia_smi_prints_it(printed: str, mode: ComputeMode) -> None:
    assert parse_query(printed, GPU_A) is mode


@pytest.mark.parametrize("printed", ["", "EXCLUSIVE_PROCESS", "Default\nDefault", "[N/A]"])
def test_an_unexpected_query_answer_is_an_error_naming_the_gpu(printed: str) -> None:
    with pytest.raises(ComputeModeError, match=GPU_A):
        parse_query(printed, GPU_A)


def test_only_whole_gpus_are_made_exclusive() -> None:
    assert exclusive_gpus([MIG_A, GPU_A, GPU_A]) == [GPU_A]
    assert exclusive_gpus([MIG_A]) == []


@pytest.fixture
def modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> ComputeModes:
    root = tmp_path / "root"
    (root / "usr" / "bin").mkdir(parents=True)
    install_standin("nvidia-smi", root / "usr" / "bin")
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_STATE", str(tmp_path / "state.json"))
    monkeypatch.delenv("TESSERA_SIM_NVIDIA_SMI_FAIL", raising=False)
    monkeypatch.delenv("TESSERA_SIM_NVIDIA_SMI_HANG", raising=False)
    return ComputeModes(root)


def test_the_stand_in_starts_in_default_and_keeps_what_was_set(modes: ComputeModes, tmp_path: Path) -> None:
    assert modes.get(GPU_A) is ComputeMode.DEFAULT
    modes.set(GPU_A, ComputeMode.EXCLUSIVE_PROCESS)
    assert modes.get(GPU_A) is ComputeMode.EXCLUSIVE_PROCESS
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls[0] == ["--query-gpu=compute_mode", "--format=csv,noheader", "-i", GPU_A]
    assert calls[1] == ["-i", GPU_A, "-c", "EXCLUSIVE_PROCESS"]


def test_a_mig_device_has_no_compute_mode_of_its_own(modes: ComputeModes) -> None:
    with pytest.raises(ComputeModeError, match="MIG devices keep compute mode DEFAULT"):
        modes.set(MIG_A, ComputeMode.EXCLUSIVE_PROCESS)


def test_a_failing_nvidia_smi_is_an_error_with_its_command(modes: ComputeModes,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_FAIL", "-c EXCLUSIVE_PROCESS")
    with pytest.raises(ComputeModeError, match=r"compute mode of GPU-.*-c EXCLUSIVE_PROCESS"):
        modes.set(GPU_A, ComputeMode.EXCLUSIVE_PROCESS)
    assert modes.get(GPU_A) is ComputeMode.DEFAULT


def test_no_nvidia_smi_runs_once_the_deadline_passed(modes: ComputeModes, tmp_path: Path) -> None:
    with pytest.raises(ComputeModeError, match="no time left"):
        modes.get(GPU_A, Deadline.after(0))
    assert not (tmp_path / "calls.jsonl").exists()


# ----------------------------------------------------------------------------- Deadline and GPU locks


def test_a_deadline_bounds_steps_and_tells_why_it_stopped() -> None:
    assert Deadline.after(100).bound(5) == 5
    assert Deadline.after(0).bound(5) == 0
    with pytest.raises(DeadlineExceeded, match="deadline passed before starting"):
        Deadline.after(0).check("starting")
    with pytest.raises(DeadlineExceeded, match="kubelet gave up"):
        Deadline.after(100, lambda: False).check("starting")
    Deadline.after(100).check("starting")


def test_a_gpu_lock_held_elsewhere_is_reported_busy_and_other_gpus_stay_free(tmp_path: Path) -> None:
    gpu_b = "GPU-99999999-2222-3333-4444-555555555555"
    locks, other_process = GpuLocks(tmp_path), GpuLocks(tmp_path)  # two plugin pods on one state directory
    with locks.held([GPU_A], 1, "preparing a"):
        with pytest.raises(GpuBusy, match=f"GPU {GPU_A} stayed busy.*gave up preparing b"), \
                other_process.held([gpu_b, GPU_A], 0, "preparing b"):
            pass
        with other_process.held([gpu_b], 0, "preparing c"):
            pass
    with other_process.held([GPU_A], 0, "preparing d"):
        pass


def test_gpu_lock_names_must_be_gpu_uuids(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="GPU-"), GpuLocks(tmp_path).held(["../escape"], 1, "x"):
        pass
