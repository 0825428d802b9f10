"""The GPU code's expected failures share one base, DriverError, and the kubelet-facing code answers with it:
its message becomes the claim's error; anything else is a bug, left for the plugin to report as internal.

The node is ``tests/support/statenode.py`` (whole GPUs, recording fakes) or, for MIG,
``tests/support/dynamicmignode.py`` (the simulated MIG partitioner and its injected NVML refusals).
"""

from __future__ import annotations

import ast
import importlib
from collections.abc import Callable
from pathlib import Path

import pytest

from driver.gpu.claimconfig.api import ConfigError
from driver.gpu.driver import GpuDriver
from driver.gpu.errors import DriverError
from driver.gpu.host.binaries import BinaryFailed
from driver.gpu.host.capnodes import CapabilityNodeError
from driver.gpu.host.hostfs import HostFsError
from driver.gpu.mps.launch import MpsLaunchError
from driver.gpu.mps.model import MpsError
from driver.gpu.record.checkpoint import ClaimPhase
from driver.gpu.runtime.mig import MigError
from driver.gpu.runtime.multiuser import MultiUserPending
from driver.gpu.state import DeviceState
from driver.kubeletplugin.types import Deadline
from tests.support.dynamicmignode import DynamicMigNode
from tests.support.statenode import StateNode, claim, ref

GPU_PACKAGE = Path(__file__).resolve().parents[3] / "driver" / "gpu"

# Exceptions that never reach a user, each handled where it is raised.
NOT_FOR_THE_USER = {
    "driver.gpu.discovery.cudaprobe.CudaError": "a CUDA call's result code, reported as data by its probe",
    "driver.gpu.mps.hostclient._TryAgain": "the MPS host client's signal to send the request again",
    "driver.gpu.mps.hostclient.NothingSent": "the MPS host's signal that a peer closed before sending a request",
    "driver.gpu.record.checkpoint.CheckpointCorrupt": "the checkpoint is rebuilt from the CDI specs at once",
}
THREE_G = "gpu-0-dynmig-3g40gb-4"


def exception_classes() -> dict[str, type[BaseException]]:
    """Every exception class defined at the top of a module under driver/gpu, by qualified name."""
    found: dict[str, type[BaseException]] = {}
    for path in sorted(GPU_PACKAGE.rglob("*.py")):
        parts = path.relative_to(GPU_PACKAGE.parents[1]).with_suffix("").parts
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                cls = getattr(importlib.import_module(module), node.name)
                if isinstance(cls, type) and issubclass(cls, BaseException):
                    found[f"{module}.{node.name}"] = cls
    return found


def test_every_exception_of_the_gpu_code_is_a_driver_error_unless_listed_as_never_shown() -> None:
    classes = exception_classes()
    assert "driver.gpu.mps.launch.MpsLaunchError" in classes, "the walk finds the GPU code's classes"
    missing = sorted(name for name, cls in classes.items()
                     if not issubclass(cls, DriverError) and name not in NOT_FOR_THE_USER)
    assert missing == [], "derive these from DriverError (or their family's base), or list them with a reason"
    stale = sorted(name for name in NOT_FOR_THE_USER if name not in classes or issubclass(classes[name], DriverError))
    assert stale == [], "no longer defined, or a DriverError after all: drop them from the list"


def test_a_launch_failure_is_an_mps_error() -> None:
    assert issubclass(MpsLaunchError, MpsError)


def test_config_errors_stay_value_errors_for_the_validators_that_raise_them() -> None:
    assert issubclass(ConfigError, ValueError) and issubclass(ConfigError, DriverError)


def test_a_mig_destroy_refused_while_rolling_back_an_interrupted_prepare_is_the_claims_error(tmp_path: Path) -> None:
    mig_node = DynamicMigNode(tmp_path)
    state = mig_node.state()
    state.prepare(claim("u1", THREE_G))
    cp = mig_node.store.load()
    cp.claims["u1"].phase = ClaimPhase.PREPARE_STARTED  # what a crash before PrepareCompleted leaves
    mig_node.store.save(cp)
    mig_node.engine.inject_failure("destroy-ci", placement=4)
    driver = GpuDriver(state)
    result = driver.prepare_claim(claim("u1", THREE_G), Deadline.after(30))
    assert result.devices == [] and result.error is not None and "destroying CI 0 failed" in result.error
    retried = driver.prepare_claim(claim("u1", THREE_G), Deadline.after(30))  # the kubelet's retry
    assert retried.error is None and [d.device_name for d in retried.devices] == [THREE_G]


def test_an_unprepare_whose_mig_destroy_is_refused_answers_the_retry_message(tmp_path: Path) -> None:
    mig_node = DynamicMigNode(tmp_path)
    state = mig_node.state()
    state.prepare(claim("u1", THREE_G))
    mig_node.engine.inject_failure("destroy-ci", placement=4)
    driver = GpuDriver(state)
    error = driver.unprepare_claim(ref("u1"))
    assert error is not None and "will be retried by the kubelet" in error and "destroying CI 0 failed" in error
    assert driver.unprepare_claim(ref("u1")) is None and state.prepared_claims() == []


@pytest.mark.parametrize("failure", [MigError("MIG mode of GPU-0 changed"), CapabilityNodeError("gi4 unreadable"),
                                     BinaryFailed("nvidia-smi exited 3"), MultiUserPending("still being probed")],
                         ids=lambda e: type(e).__name__)
def test_a_prepare_whose_step_fails_with_an_expected_error_gets_its_message_as_the_claims_error(
        state_node: StateNode, monkeypatch: pytest.MonkeyPatch, failure: DriverError) -> None:
    state = state_node.state()
    monkeypatch.setattr(state.sharing, "start_for_claim", _raises(failure))
    result = GpuDriver(state).prepare_claim(claim("u1", "gpu-0"), Deadline.after(30))
    assert result.error == str(failure) and result.devices == []
    assert state.prepared_claims() == [] and state_node.cdi_files() == [], "rolled back"


@pytest.mark.parametrize("failure", [HostFsError("/proc/devices does not exist"), ConfigError("bad config"),
                                     CapabilityNodeError("gi4 unreadable")], ids=lambda e: type(e).__name__)
def test_an_unprepare_whose_step_fails_with_an_expected_error_answers_the_retry_message(
        state_node: StateNode, monkeypatch: pytest.MonkeyPatch, failure: DriverError) -> None:
    state = state_node.state()
    state.prepare(claim("u1", "gpu-0"))
    monkeypatch.setattr(state.sharing, "release_claim", _raises(failure))
    error = GpuDriver(state).unprepare_claim(ref("u1"))
    assert error == f"unprepare of {ref('u1')} failed and will be retried by the kubelet: {failure}"
    assert [r.uid for r in state.prepared_claims()] == ["u1"], "kept for the retry"


def test_an_unexpected_error_is_left_to_the_plugin_to_report_as_internal(state_node: StateNode,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    state: DeviceState = state_node.state()
    driver = GpuDriver(state)
    monkeypatch.setattr(state.sharing, "start_for_claim", _raises(KeyError("gpu-0")))
    with pytest.raises(KeyError):
        driver.prepare_claim(claim("u1", "gpu-0"), Deadline.after(30))
    monkeypatch.undo()
    state.prepare(claim("u2", "gpu-0"))
    monkeypatch.setattr(state.sharing, "release_claim", _raises(KeyError("gpu-0")))
    with pytest.raises(KeyError):
        driver.unprepare_claim(ref("u2"))


def _raises(failure: Exception) -> Callable[..., None]:
    def step(*args: object) -> None:
        raise failure
    return step

