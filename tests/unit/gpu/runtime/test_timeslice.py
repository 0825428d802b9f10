"""TimeSlicer against the simulated nvidia-smi (time slices) and a compute-mode fake (NVML): which commands
and calls run, in what order, and rollback."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from driver.gpu.claimconfig.choices import TIMESLICE_VALUES, TimeSliceInterval
from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.runtime.computemode import ComputeModeError
from driver.gpu.runtime.timeslice import TimeSliceError, TimeSlicer
from driver.kubeletplugin.types import Deadline
from tests.support.processes import install_standin

GPU_A = "GPU-11111111-2222-3333-4444-555555555555"
GPU_B = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


class Modes:
    """The NVML compute-mode control as TimeSlicer uses it: each GPU's mode, every change recorded."""

    def __init__(self) -> None:
        self.modes: dict[str, ComputeMode] = {}
        self.sets: list[tuple[str, ComputeMode]] = []
        self.refuse: set[str] = set()

    def get(self, uuid: str, deadline: Deadline | None = None) -> ComputeMode:
        return self.modes.get(uuid, ComputeMode.DEFAULT)

    def set(self, uuid: str, mode: ComputeMode, deadline: Deadline | None = None) -> None:
        self.sets.append((uuid, mode))
        if uuid in self.refuse:
            raise ComputeModeError(f"nvmlDeviceSetComputeMode {mode.value} for {uuid} failed: NVML error 999")
        self.modes[uuid] = mode


@pytest.fixture
def modes() -> Modes:
    return Modes()


def slicer(root: Path, modes: Modes | None = None, timeout: float = 10.0) -> TimeSlicer:
    return TimeSlicer(root, modes if modes is not None else Modes(), timeout=timeout)


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    driver_root = tmp_path / "root"
    (driver_root / "usr" / "bin").mkdir(parents=True)
    install_standin("nvidia-smi", driver_root / "usr" / "bin")
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_STATE", str(tmp_path / "state.json"))
    monkeypatch.delenv("TESSERA_SIM_NVIDIA_SMI_FAIL", raising=False)
    return driver_root


def _calls(root: Path) -> list[list[str]]:
    path = root.parent / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _state(root: Path) -> dict[str, dict[str, object]]:
    result: dict[str, dict[str, object]] = json.loads((root.parent / "state.json").read_text())
    return result


def _fake_nvidia_smi(root: Path, body: str) -> None:
    exe = root / "usr" / "bin" / "nvidia-smi"
    exe.write_text(f"#!{sys.executable}\nimport os, sys, time\n{body}\n")
    exe.chmod(0o755)


def _apply_calls(uuid: str, value: int) -> list[list[str]]:
    return [["compute-policy", "-i", uuid, "--set-timeslice", str(value)]]


def _reset_calls(uuid: str) -> list[list[str]]:
    return [["compute-policy", "-i", uuid, "--set-timeslice", "0"]]


@pytest.mark.parametrize("interval", ["Default", "Short", "Medium", "Long"])
def test_apply_sets_compute_mode_then_time_slice_per_gpu(root: Path, modes: Modes, interval: TimeSliceInterval) -> None:
    modes.modes[GPU_B] = ComputeMode.EXCLUSIVE_PROCESS  # left by MPS: time slicing needs DEFAULT
    slicer(root, modes).apply([GPU_A, GPU_B], interval)
    value = TIMESLICE_VALUES[interval]
    # One nvidia-smi run per GPU: the compute mode goes through NVML, and only where it is not DEFAULT.
    assert _calls(root) == _apply_calls(GPU_A, value) + _apply_calls(GPU_B, value)
    assert modes.sets == [(GPU_B, ComputeMode.DEFAULT)]
    assert _state(root)[GPU_B]["timeslice"] == value
    assert not [c for c in _calls(root) if "-c" in c], "no nvidia-smi -c: NVML sets the compute mode"


def test_reset_sets_default_time_slice_and_compute_mode(root: Path, modes: Modes) -> None:
    timeslicer = slicer(root, modes)
    timeslicer.apply([GPU_A, GPU_B], "Long")
    modes.modes[GPU_A] = ComputeMode.PROHIBITED  # changed behind the driver's back meanwhile
    timeslicer.reset([GPU_A, GPU_B])
    assert _calls(root)[2:] == _reset_calls(GPU_A) + _reset_calls(GPU_B)
    assert modes.sets == [(GPU_A, ComputeMode.DEFAULT)] and modes.get(GPU_A) is ComputeMode.DEFAULT
    assert _state(root)[GPU_A]["timeslice"] == 0 and _state(root)[GPU_B]["timeslice"] == 0


def test_failure_on_second_gpu_rolls_back_the_first(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_FAIL", f"{GPU_B} --set-timeslice 2")
    with pytest.raises(TimeSliceError) as caught:
        slicer(root).apply([GPU_A, GPU_B], "Medium")
    message = str(caught.value)
    assert f"nvidia-smi compute-policy -i {GPU_B} --set-timeslice 2` failed with exit code 3" in message
    assert "injected failure" in message  # the stand-in's stderr
    assert f"rolled back {GPU_A} to Default" in message
    assert _calls(root) == _apply_calls(GPU_A, 2) + _apply_calls(GPU_B, 2) + _reset_calls(GPU_A)
    assert _state(root)[GPU_A]["timeslice"] == 0


def test_failure_on_first_gpu_touches_nothing_else(root: Path, modes: Modes) -> None:
    modes.modes[GPU_A] = ComputeMode.EXCLUSIVE_PROCESS
    modes.refuse.add(GPU_A)
    with pytest.raises(TimeSliceError, match="NVML error 999") as caught:
        slicer(root, modes).apply([GPU_A, GPU_B], "Short")
    assert "rolled back" not in str(caught.value)
    assert _calls(root) == [] and modes.sets == [(GPU_A, ComputeMode.DEFAULT)]


def test_failed_rollback_is_reported_too(root: Path) -> None:
    # Call 1 succeeds (GPU A's slice); every later one fails: GPU B's slice, then A's rollback.
    counter = root.parent / "count"
    _fake_nvidia_smi(root, f"""
with open({str(counter)!r}, "a") as f:
    f.write("x")
if len(open({str(counter)!r}).read()) > 1:
    print("simulated failure", file=sys.stderr)
    sys.exit(9)
""")
    with pytest.raises(TimeSliceError) as caught:
        slicer(root).apply([GPU_A, GPU_B], "Short")
    message = str(caught.value)
    assert f"on {GPU_B} failed" in message
    assert f"rollback also failed: {GPU_A}:" in message
    assert len(counter.read_text()) == 3  # the rollback's nvidia-smi was tried


def test_reset_tries_every_gpu_before_reporting(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_FAIL", f"-i {GPU_A} --set-timeslice")
    with pytest.raises(TimeSliceError) as caught:
        slicer(root).reset([GPU_A, GPU_B])
    assert GPU_A in str(caught.value)
    assert GPU_B not in str(caught.value)
    assert _calls(root) == _reset_calls(GPU_A) + _reset_calls(GPU_B)


@pytest.mark.parametrize(
    ("uuids", "complaint"),
    [
        ([], "empty"),
        (["MIG-99999999-8888-7777-6666-555555555555"], "MIG device"),
        (["0"], "not a GPU-... UUID"),
        ([GPU_A, GPU_A], "more than once"),
        (GPU_A, "got the string"),
    ],
)
def test_bad_gpu_list_is_rejected_before_any_command(root: Path, uuids: list[str], complaint: str) -> None:
    with pytest.raises(TimeSliceError, match=complaint.replace(".", r"\.")):
        slicer(root).apply(uuids, "Short")
    assert _calls(root) == []


def test_unknown_interval_is_rejected(root: Path) -> None:
    with pytest.raises(TimeSliceError, match="'Longest' is not one of Default, Short, Medium, Long"):
        slicer(root).apply([GPU_A], "Longest")  # type: ignore[arg-type]
    assert _calls(root) == []


def test_missing_nvidia_smi_names_the_driver_root_setting(tmp_path: Path) -> None:
    with pytest.raises(TimeSliceError, match="nvidiaDriverRoot"):
        slicer(tmp_path).reset([GPU_A])


def test_hung_nvidia_smi_times_out(root: Path) -> None:
    _fake_nvidia_smi(root, "time.sleep(60)")
    with pytest.raises(TimeSliceError, match=r"did not finish within 0\.2s"):
        slicer(root, timeout=0.2).apply([GPU_A], "Short")


def test_nvidia_smi_sees_only_the_driver_roots_nvidia_libraries(
    root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    lib64 = root / "usr" / "lib64"
    lib64.mkdir(parents=True)
    (lib64 / "libnvidia-ml.so.580.95.05").write_text("nvml")
    (lib64 / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.580.95.05")
    (lib64 / "libc.so.6").write_text("the host's libc")
    seen = root.parent / "ld_library_path"
    _fake_nvidia_smi(root, f"open({str(seen)!r}, 'w').write(os.environ.get('LD_LIBRARY_PATH', ''))")
    slicer(root).apply([GPU_A], "Short")
    first = Path(seen.read_text().split(":")[0])
    assert first.parent == tmp_path / "tmp"
    assert sorted(entry.name for entry in first.iterdir()) == ["libnvidia-ml.so.1", "libnvidia-ml.so.580.95.05"]
    assert (first / "libnvidia-ml.so.1").read_text() == "nvml"


def test_default_timeout_keeps_a_prepare_inside_the_kubelet_deadline(tmp_path: Path) -> None:
    # apply() on one GPU runs one nvidia-smi call and two NVML calls and, on failure, the same again
    # to roll back, each bounded alike; the kubelet gives the whole prepare 45 s.
    assert 4 * slicer(tmp_path).timeout < 45
