"""Compute modes through NVML (a fake pynvml with nvml.h's names and values), which GPUs MPS makes exclusive,
the simulated node's NVML double, and the Deadline and GPU locks around them."""

from __future__ import annotations

import json
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.gpu.claim.claimplan import exclusive_gpus
from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.runtime.computemode import ComputeModeError, NvmlComputeModes
from driver.gpu.runtime.gpulocks import GpuBusy, GpuLocks
from driver.kubeletplugin.types import Deadline, DeadlineExceeded
from driver.simulation.nvmlcompute import SimulatedNvml
from tests.support.processes import install_standin

GPU_A = "GPU-11111111-2222-3333-4444-555555555555"
GPU_B = "GPU-99999999-2222-3333-4444-555555555555"
MIG_A = "MIG-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee"


class FakeNvmlError(Exception):
    """pynvml's NVMLError: ``value`` is nvml.h's nvmlReturn_t, ``str`` its nvmlErrorString."""

    STRINGS = {1: "Uninitialized", 2: "Invalid Argument", 3: "Not Supported", 4: "Insufficient Permissions",
               6: "Not Found", 15: "GPU is lost"}

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return self.STRINGS.get(self.value, f"NVML Error with code {self.value}")


class FakeNvml:
    """The pynvml calls the control makes, with nvml.h's rules: root to set, NOT_SUPPORTED on MIG-enabled GPUs."""

    NVMLError = FakeNvmlError

    def __init__(self, mig_enabled: tuple[str, ...] = (), root: bool = True) -> None:
        self.modes: dict[str, int] = {GPU_A: 0, GPU_B: 0}  # nvml.h: every GPU boots in DEFAULT (0)
        self.mig_enabled = mig_enabled
        self.root = root
        self.calls: list[tuple[Any, ...]] = []
        self.inits = 0
        self.block: threading.Event | None = None  # set: calls on GPU_A wait for it, as a hung GPU's do

    def nvmlInit(self) -> None:
        self.calls.append(("nvmlInit",))
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.calls.append(("nvmlShutdown",))
        self.inits -= 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        if self.inits <= 0:
            raise FakeNvmlError(1)
        if uuid not in self.modes:
            raise FakeNvmlError(6)
        if self.block is not None and uuid == GPU_A:
            self.block.wait()
        return f"handle:{uuid}"

    def nvmlDeviceGetComputeMode(self, handle: str) -> int:
        self.calls.append(("nvmlDeviceGetComputeMode", handle))
        return self.modes[handle.removeprefix("handle:")]

    def nvmlDeviceSetComputeMode(self, handle: str, mode: int) -> None:
        self.calls.append(("nvmlDeviceSetComputeMode", handle, mode))
        uuid = handle.removeprefix("handle:")
        if not self.root:
            raise FakeNvmlError(4)
        if uuid in self.mig_enabled:
            raise FakeNvmlError(3)
        self.modes[uuid] = mode


def test_modes_are_read_and_set_with_nvmls_values_on_one_session() -> None:
    nvml = FakeNvml()
    loaded: list[bool] = []
    modes = NvmlComputeModes(nvml, load_library=lambda: loaded.append(True))
    assert modes.get(GPU_A) is ComputeMode.DEFAULT
    modes.set(GPU_A, ComputeMode.EXCLUSIVE_PROCESS)
    modes.set(GPU_B, ComputeMode.PROHIBITED)
    assert nvml.modes == {GPU_A: 3, GPU_B: 2}  # nvml.h: EXCLUSIVE_PROCESS = 3, PROHIBITED = 2
    assert modes.get(GPU_A) is ComputeMode.EXCLUSIVE_PROCESS
    modes.set(GPU_A, ComputeMode.DEFAULT)
    assert nvml.modes[GPU_A] == 0
    assert loaded == [True] and [c for c in nvml.calls if c[0] == "nvmlInit"] == [("nvmlInit",)]
    modes.close()
    assert nvml.inits == 0


def test_exclusive_thread_whose_support_nvml_removed_is_an_error_naming_it() -> None:
    nvml = FakeNvml()
    nvml.modes[GPU_A] = 1
    with pytest.raises(ComputeModeError, match=f"compute mode 1 \\(EXCLUSIVE_THREAD.*for {GPU_A}"):
        NvmlComputeModes(nvml).get(GPU_A)


@pytest.mark.parametrize(("nvml", "expected"), [
    (FakeNvml(mig_enabled=(GPU_A,)), "NVML error 3: Not Supported; MIG-enabled GPUs keep compute mode DEFAULT"),
    (FakeNvml(root=False), "NVML error 4: Insufficient Permissions; setting a compute mode needs root"),
])
def test_a_change_nvml_refuses_is_one_line_with_the_gpu_the_call_and_nvmls_error(nvml: FakeNvml,
                                                                                 expected: str) -> None:
    with pytest.raises(ComputeModeError) as caught:
        NvmlComputeModes(nvml).set(GPU_A, ComputeMode.EXCLUSIVE_PROCESS)
    message = str(caught.value)
    assert message == f"nvmlDeviceSetComputeMode EXCLUSIVE_PROCESS for {GPU_A} failed: {expected}"
    assert "\n" not in message and nvml.modes[GPU_A] == 0


def test_an_unknown_gpu_and_a_mig_device_are_errors_and_mig_never_reaches_nvml() -> None:
    nvml = FakeNvml()
    modes = NvmlComputeModes(nvml)
    with pytest.raises(ComputeModeError, match="NVML error 6: Not Found; no GPU with this UUID"):
        modes.get("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(ComputeModeError, match="MIG devices keep compute mode DEFAULT"):
        modes.set(MIG_A, ComputeMode.EXCLUSIVE_PROCESS)
    assert not any(MIG_A in str(c) for c in nvml.calls)


def test_nvml_that_cannot_start_is_an_error_and_is_tried_again_next_time() -> None:
    nvml = FakeNvml()
    attempts: list[int] = []

    def load() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise RuntimeError("libnvidia-ml.so.1 not found under driver root /run/nvidia/driver")

    modes = NvmlComputeModes(nvml, load_library=load)
    with pytest.raises(ComputeModeError, match=r"NVML cannot be loaded.*libnvidia-ml\.so\.1 not found"):
        modes.get(GPU_A)
    assert modes.get(GPU_A) is ComputeMode.DEFAULT and len(attempts) == 2


def test_no_nvml_call_once_the_deadline_passed() -> None:
    nvml = FakeNvml()
    with pytest.raises(ComputeModeError, match="no time left"):
        NvmlComputeModes(nvml).get(GPU_A, Deadline.after(0))
    assert nvml.calls == []


@pytest.fixture
def hung() -> Iterator[FakeNvml]:
    nvml = FakeNvml()
    nvml.block = threading.Event()
    yield nvml
    nvml.block.set()


def test_a_hung_nvml_call_is_bounded_then_fences_its_gpu_until_it_returns_and_spares_the_others(
        hung: FakeNvml) -> None:
    modes = NvmlComputeModes(hung, timeout=0.2)
    with pytest.raises(ComputeModeError, match=f"NVML did not return from nvmlDeviceSetComputeMode "
                                               f"EXCLUSIVE_PROCESS for {GPU_A} within 0.2 s"):
        modes.set(GPU_A, ComputeMode.EXCLUSIVE_PROCESS)
    with pytest.raises(ComputeModeError, match="not tried: NVML has not returned from nvmlDeviceSetComputeMode"):
        modes.get(GPU_A, Deadline.after(30))  # fails at once instead of waiting out another timeout
    modes.set(GPU_B, ComputeMode.EXCLUSIVE_PROCESS)  # another GPU goes on
    assert hung.modes[GPU_B] == 3
    assert hung.block is not None
    [stuck] = [t for t in threading.enumerate() if t.name == f"nvml-compute-mode {GPU_A}"]
    hung.block.set()  # the stuck call returns: the GPU is usable again and the late change is visible
    stuck.join(timeout=30)
    assert modes.get(GPU_A, Deadline.after(5)) is ComputeMode.EXCLUSIVE_PROCESS


def test_only_whole_gpus_are_made_exclusive() -> None:
    assert exclusive_gpus([MIG_A, GPU_A, GPU_A]) == [GPU_A]
    assert exclusive_gpus([MIG_A]) == []


# ----------------------------------------------------------------------------- the simulated node's NVML double


def _gpus_file(path: Path, mig: bool = False) -> Path:
    path.write_text(json.dumps({"gpus": [{"uuid": GPU_A, "minor": 0, "mig_enabled": mig},
                                         {"uuid": GPU_B, "minor": 1, "mig_enabled": False}]}))
    return path


def _double(tmp_path: Path, **kw: Any) -> SimulatedNvml:
    return SimulatedNvml(state=tmp_path / "state.json", gpus_file=kw.pop("gpus", _gpus_file(tmp_path / "gpus.json")),
                         calls_log=tmp_path / "nvml.jsonl", **kw)


def test_the_double_keeps_modes_where_the_stand_ins_read_them_and_records_each_call(tmp_path: Path) -> None:
    double = _double(tmp_path)
    modes = NvmlComputeModes(double)
    modes.set(GPU_A, ComputeMode.EXCLUSIVE_PROCESS)
    assert json.loads((tmp_path / "state.json").read_text()) == {
        GPU_A: {"compute_mode": "EXCLUSIVE_PROCESS", "timeslice": 0}}
    assert modes.get(GPU_A) is ComputeMode.EXCLUSIVE_PROCESS
    assert double.calls() == [{"call": "nvmlDeviceSetComputeMode", "uuid": GPU_A, "mode": "EXCLUSIVE_PROCESS"},
                              {"call": "nvmlDeviceGetComputeMode", "uuid": GPU_A}]


def test_the_double_answers_as_nvml_documents(tmp_path: Path) -> None:
    mig = _double(tmp_path, gpus=_gpus_file(tmp_path / "mig.json", mig=True))
    with pytest.raises(ComputeModeError, match="Not Supported; MIG-enabled GPUs keep compute mode DEFAULT"):
        NvmlComputeModes(mig).set(GPU_A, ComputeMode.EXCLUSIVE_PROCESS)
    with pytest.raises(ComputeModeError, match="Insufficient Permissions; setting a compute mode needs root"):
        NvmlComputeModes(_double(tmp_path, euid=1000)).set(GPU_B, ComputeMode.EXCLUSIVE_PROCESS)
    unprivileged = SimulatedNvml.for_driver_root(tmp_path, {"TESSERA_SIM_NVML_UID": "1000",
                                                            "TESSERA_SIM_GPUS_FILE": str(tmp_path / "gpus.json")})
    with pytest.raises(ComputeModeError, match="needs root"):  # the simulated plugin pod, not run as root
        NvmlComputeModes(unprivileged).set(GPU_B, ComputeMode.EXCLUSIVE_PROCESS)
    with pytest.raises(ComputeModeError, match="Not Found"):
        NvmlComputeModes(_double(tmp_path)).get("GPU-00000000-0000-0000-0000-000000000000")
    with pytest.raises(Exception, match="Uninitialized"):
        _double(tmp_path).nvmlDeviceGetHandleByUUID(GPU_A)  # before nvmlInit
    double = _double(tmp_path)
    double.nvmlInit()
    with pytest.raises(Exception, match="Invalid Argument"):
        double.nvmlDeviceSetComputeMode(double.nvmlDeviceGetHandleByUUID(GPU_B), 1)  # EXCLUSIVE_THREAD: removed
    assert NvmlComputeModes(_double(tmp_path)).get(GPU_A) is ComputeMode.DEFAULT


def test_the_doubles_modes_reset_to_default_with_a_reboot(tmp_path: Path) -> None:
    boot = ["boot-1"]
    modes = NvmlComputeModes(_double(tmp_path, boot_id=lambda: boot[0]))
    modes.set(GPU_A, ComputeMode.EXCLUSIVE_PROCESS)
    assert modes.get(GPU_A) is ComputeMode.EXCLUSIVE_PROCESS
    boot[0] = "boot-2"  # nvml.h: "not persistent across reboots and always resets to Default"
    assert modes.get(GPU_A) is ComputeMode.DEFAULT
    assert json.loads((tmp_path / "state.json").read_text())[GPU_A]["compute_mode"] == "DEFAULT"


def test_the_double_and_the_nvidia_smi_stand_in_share_the_state_under_one_lock(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "root"
    (root / "usr" / "bin").mkdir(parents=True)
    install_standin("nvidia-smi", root / "usr" / "bin")
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_STATE", str(tmp_path / "state.json"))
    monkeypatch.setenv("TESSERA_SIM_NVIDIA_SMI_LOG", str(tmp_path / "smi.jsonl"))
    modes = NvmlComputeModes(_double(tmp_path))
    setters = [threading.Thread(target=modes.set, args=(GPU_A, ComputeMode.EXCLUSIVE_PROCESS)) for _ in range(5)]
    for t in setters:
        t.start()
    subprocess.run([str(root / "usr" / "bin" / "nvidia-smi"), "compute-policy", "-i", GPU_B, "--set-timeslice", "3"],
                   check=True, capture_output=True, timeout=30)
    for t in setters:
        t.join()
    state = json.loads((tmp_path / "state.json").read_text())
    assert state[GPU_A]["compute_mode"] == "EXCLUSIVE_PROCESS" and state[GPU_B]["timeslice"] == 3, "no lost update"
    query = subprocess.run([str(root / "usr" / "bin" / "nvidia-smi"), "--query-gpu=compute_mode",
                            "--format=csv,noheader", "-i", GPU_A], check=True, capture_output=True, text=True,
                           timeout=30)
    assert query.stdout.strip() == "Exclusive_Process"


# ----------------------------------------------------------------------------- Deadline and GPU locks


def test_a_deadline_bounds_steps_and_tells_why_it_stopped() -> None:
    assert Deadline.after(100).bound(5) == 5
    assert Deadline.after(0).bound(5) == 0
    with pytest.raises(DeadlineExceeded, match="deadline passed before starting"):
        Deadline.after(0).check("starting")
    with pytest.raises(DeadlineExceeded, match="kubelet gave up"):
        Deadline.after(100, lambda: False).check("starting")
    Deadline.after(100).check("starting")


def test_a_passed_deadline_has_nothing_left_and_a_step_inside_it_ends_no_later() -> None:
    passed = Deadline.after(-5, purpose="start")
    assert passed.remaining() == 0 and passed.expired()
    assert passed.capped(10).at == passed.at, "a step's share never outlasts the deadline it is part of"
    with pytest.raises(DeadlineExceeded, match="the -5s start deadline passed before starting"):
        passed.capped(10).check("starting")
    wide = Deadline.after(100, purpose="start")
    step = wide.capped(2)
    assert 0 < step.remaining() <= 2 and step.what == "the 100s start deadline"


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
