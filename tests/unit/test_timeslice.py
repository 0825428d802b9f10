"""TimeSlicer against the simulated nvidia-smi: which commands run, in what order, and rollback."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from driver.gpu.runtime.timeslice import TimeSliceError, TimeSlicer
from driver.gpu.sharelayout import TIMESLICE_VALUES, TimeSliceInterval
from tests.support.processes import install_standin

GPU_A = "GPU-11111111-2222-3333-4444-555555555555"
GPU_B = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


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
    return [["-i", uuid, "-c", "DEFAULT"], ["compute-policy", "-i", uuid, "--set-timeslice", str(value)]]


def _reset_calls(uuid: str) -> list[list[str]]:
    return [["compute-policy", "-i", uuid, "--set-timeslice", "0"], ["-i", uuid, "-c", "DEFAULT"]]


@pytest.mark.parametrize("interval", ["Default", "Short", "Medium", "Long"])
def test_apply_sets_compute_mode_then_time_slice_per_gpu(root: Path, interval: TimeSliceInterval) -> None:
    TimeSlicer(root).apply([GPU_A, GPU_B], interval)
    value = TIMESLICE_VALUES[interval]
    assert _calls(root) == _apply_calls(GPU_A, value) + _apply_calls(GPU_B, value)
    assert _state(root)[GPU_B]["timeslice"] == value


def test_reset_sets_default_time_slice_and_compute_mode(root: Path) -> None:
    slicer = TimeSlicer(root)
    slicer.apply([GPU_A, GPU_B], "Long")
    slicer.reset([GPU_A, GPU_B])
    assert _calls(root)[4:] == _reset_calls(GPU_A) + _reset_calls(GPU_B)
    assert _state(root)[GPU_A] == {"compute_mode": "DEFAULT", "timeslice": 0}
    assert _state(root)[GPU_B] == {"compute_mode": "DEFAULT", "timeslice": 0}


def test_failure_on_second_gpu_rolls_back_the_first(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_FAIL", f"{GPU_B} --set-timeslice 2")
    with pytest.raises(TimeSliceError) as caught:
        TimeSlicer(root).apply([GPU_A, GPU_B], "Medium")
    message = str(caught.value)
    assert f"nvidia-smi compute-policy -i {GPU_B} --set-timeslice 2` failed with exit code 3" in message
    assert "injected failure" in message  # the stand-in's stderr
    assert f"rolled back {GPU_A} to Default" in message
    assert _calls(root) == _apply_calls(GPU_A, 2) + _apply_calls(GPU_B, 2) + _reset_calls(GPU_A)
    assert _state(root)[GPU_A]["timeslice"] == 0


def test_failure_on_first_gpu_touches_nothing_else(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_FAIL", f"-i {GPU_A} -c")
    with pytest.raises(TimeSliceError, match="exit code 3") as caught:
        TimeSlicer(root).apply([GPU_A, GPU_B], "Short")
    assert "rolled back" not in str(caught.value)
    assert _calls(root) == [["-i", GPU_A, "-c", "DEFAULT"]]


def test_failed_rollback_is_reported_too(root: Path) -> None:
    # Calls 1-3 succeed (GPU A fully, GPU B's compute mode); every later one fails, rollback included.
    counter = root.parent / "count"
    _fake_nvidia_smi(root, f"""
with open({str(counter)!r}, "a") as f:
    f.write("x")
if len(open({str(counter)!r}).read()) > 3:
    print("simulated failure", file=sys.stderr)
    sys.exit(9)
""")
    with pytest.raises(TimeSliceError) as caught:
        TimeSlicer(root).apply([GPU_A, GPU_B], "Short")
    message = str(caught.value)
    assert f"on {GPU_B} failed" in message
    assert f"rollback also failed: {GPU_A}:" in message
    assert len(counter.read_text()) == 6  # both rollback commands were tried


def test_reset_tries_every_gpu_before_reporting(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_FAIL", f"-i {GPU_A} --set-timeslice")
    with pytest.raises(TimeSliceError) as caught:
        TimeSlicer(root).reset([GPU_A, GPU_B])
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
        TimeSlicer(root).apply(uuids, "Short")
    assert _calls(root) == []


def test_unknown_interval_is_rejected(root: Path) -> None:
    with pytest.raises(TimeSliceError, match="'Longest' is not one of Default, Short, Medium, Long"):
        TimeSlicer(root).apply([GPU_A], "Longest")  # type: ignore[arg-type]
    assert _calls(root) == []


def test_missing_nvidia_smi_names_the_driver_root_setting(tmp_path: Path) -> None:
    with pytest.raises(TimeSliceError, match="nvidiaDriverRoot"):
        TimeSlicer(tmp_path).reset([GPU_A])


def test_hung_nvidia_smi_times_out(root: Path) -> None:
    _fake_nvidia_smi(root, "time.sleep(60)")
    with pytest.raises(TimeSliceError, match=r"did not finish within 0\.2s"):
        TimeSlicer(root, timeout=0.2).apply([GPU_A], "Short")


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
    TimeSlicer(root).apply([GPU_A], "Short")
    first = Path(seen.read_text().split(":")[0])
    assert first.parent == tmp_path / "tmp"
    assert sorted(entry.name for entry in first.iterdir()) == ["libnvidia-ml.so.1", "libnvidia-ml.so.580.95.05"]
    assert (first / "libnvidia-ml.so.1").read_text() == "nvml"


def test_default_timeout_keeps_a_prepare_inside_the_kubelet_deadline(tmp_path: Path) -> None:
    # apply() on one GPU runs two nvidia-smi calls and, on failure, two more to roll back; the
    # kubelet gives the whole prepare 45 s.
    assert 4 * TimeSlicer(tmp_path).timeout < 45
