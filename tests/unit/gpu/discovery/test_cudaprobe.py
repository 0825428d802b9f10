"""The CUDA probes against a fake driver API, the SM-count source, and NVML discovery filling SM counts from it.

``FakeCuda`` has :class:`~driver.gpu.discovery.cudaprobe.CudaApi`'s methods and fails the way the driver
does (a CudaError with the CUresult name), the way ``test_nvml_discovery`` fakes pynvml.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from driver.gpu.discovery.cudaprobe import (
    CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
    CUDA_ERROR_NAMES,
    ClientReport,
    CudaError,
    SmCounts,
    bare_uuid,
    format_uuid,
    mps_client,
    sm_counts,
)
from driver.gpu.discovery.cudarun import CudaSmCounts, ProbeFailed, SmLookup, probe_env, run_probe
from driver.gpu.discovery.nvml import NvmlDiscovery
from driver.units import MIB
from tests.support.processes import processes_mentioning
from tests.unit.gpu.discovery.test_nvml_discovery import FakeNvml, h100_mig, l4

REPO = Path(__file__).resolve().parents[4]
H100_BYTES = bytes.fromhex("a338e955d4a55fe1a1d969aa948b59b7")
L4_BYTES = bytes.fromhex("bbbbbbbb000000000000000000000000")


@dataclass
class FakeCuda:
    """Devices as (uuid bytes, SM count); memory the context may still allocate; SMs its context may use."""

    devices: list[tuple[bytes, int]]
    free_bytes: int = 1 << 40
    affinity: int = 132
    fail: dict[str, int] = field(default_factory=dict)  # call name -> CUresult code
    held: dict[int, int] = field(default_factory=dict)
    calls: list[str] = field(default_factory=list)

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            code = self.fail[name]
            raise CudaError(name, code, CUDA_ERROR_NAMES[code])

    def init(self) -> None:
        self._call("cuInit")

    def device_count(self) -> int:
        self._call("cuDeviceGetCount")
        return len(self.devices)

    def device(self, ordinal: int) -> int:
        self._call("cuDeviceGet")
        return ordinal

    def device_uuid(self, device: int) -> bytes:
        self._call("cuDeviceGetUuid")
        return self.devices[device][0]

    def attribute(self, attribute: int, device: int) -> int:
        self._call("cuDeviceGetAttribute")
        assert attribute == CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
        return self.devices[device][1]

    def use_primary_context(self, device: int) -> None:
        self._call("cuDevicePrimaryCtxRetain")

    def exec_affinity_sm_count(self) -> int:
        self._call("cuCtxGetExecAffinity")
        return self.affinity

    def mem_alloc(self, size: int) -> int:
        self._call("cuMemAlloc_v2")
        if size > self.free_bytes:
            raise CudaError("cuMemAlloc_v2", 2, "CUDA_ERROR_OUT_OF_MEMORY")
        self.free_bytes -= size
        pointer = 0x1000 + len(self.held) * size
        self.held[pointer] = size
        return pointer

    def mem_free(self, pointer: int) -> None:
        self._call("cuMemFree_v2")
        self.free_bytes += self.held.pop(pointer)


# --- the probes -----------------------------------------------------------------------------------


def test_uuid_bytes_print_as_nvml_does_and_prefixes_are_ignored_when_comparing() -> None:
    assert format_uuid(H100_BYTES) == "a338e955-d4a5-5fe1-a1d9-69aa948b59b7"
    assert bare_uuid("GPU-A338E955-d4a5-5fe1-a1d9-69aa948b59b7") == format_uuid(H100_BYTES)
    assert bare_uuid("MIG-a338e955-d4a5-5fe1-a1d9-69aa948b59b7") == format_uuid(H100_BYTES)
    with pytest.raises(ValueError, match="16 bytes"):
        format_uuid(b"\x00" * 15)


def test_sm_counts_are_keyed_by_uuid() -> None:
    answer = sm_counts(FakeCuda([(H100_BYTES, 132), (L4_BYTES, 58)]))
    assert answer == SmCounts(counts={format_uuid(H100_BYTES): 132, format_uuid(L4_BYTES): 58})


def test_sm_counts_report_the_failing_call() -> None:
    answer = sm_counts(FakeCuda([], fail={"cuInit": 100}))
    assert answer.counts == {} and answer.error == "cuInit returned CUDA_ERROR_NO_DEVICE (100)"


def test_client_allocates_until_the_limit_and_frees_everything() -> None:
    cuda = FakeCuda([(H100_BYTES, 132)], free_bytes=2048 * MIB + 5 * MIB, affinity=34)
    report = mps_client(cuda, step_bytes=128 * MIB, cap_bytes=4096 * MIB)
    assert report.device_uuid == format_uuid(H100_BYTES)
    assert (report.multiprocessors, report.affinity_sm_count) == (132, 34)
    assert (report.allocated_bytes, report.allocation_error) == (2048 * MIB, "CUDA_ERROR_OUT_OF_MEMORY")
    assert cuda.held == {} and cuda.calls.count("cuMemFree_v2") == 16


def test_client_stops_at_the_cap_when_nothing_refuses() -> None:
    report = mps_client(FakeCuda([(H100_BYTES, 132)]), step_bytes=128 * MIB, cap_bytes=1024 * MIB)
    assert (report.allocated_bytes, report.allocation_error) == (1024 * MIB, None)


def test_client_that_cannot_connect_says_where_it_stopped() -> None:
    cuda = FakeCuda([(H100_BYTES, 132)], fail={"cuDevicePrimaryCtxRetain": 805})
    report = mps_client(cuda, step_bytes=128 * MIB, cap_bytes=1024 * MIB)
    assert report.error == "cuDevicePrimaryCtxRetain returned CUDA_ERROR_MPS_CONNECTION_FAILED (805)"
    assert report.device_uuid == format_uuid(H100_BYTES) and report.allocated_bytes == 0
    assert "cuMemAlloc_v2" not in cuda.calls


# --- the SM-count source ---------------------------------------------------------------------------


def _driver_root_with_libcuda(tmp_path: Path) -> Path:
    lib = tmp_path / "root" / "usr" / "lib64"
    lib.mkdir(parents=True)
    (lib / "libcuda.so.1").write_text("not a real library: the runner is faked\n")
    return tmp_path / "root"


class Runner:
    def __init__(self, answer: SmCounts | str) -> None:
        self.answer = answer
        self.calls: list[tuple[list[str], dict[str, str]]] = []

    def __call__(self, args: Sequence[str], env: Mapping[str, str], timeout: float) -> str:
        self.calls.append((list(args), dict(env)))
        return self.answer if isinstance(self.answer, str) else self.answer.model_dump_json()


def test_sm_source_probes_once_per_new_gpu_without_joining_an_mps_daemon(tmp_path: Path) -> None:
    root = _driver_root_with_libcuda(tmp_path)
    runner = Runner(SmCounts(counts={format_uuid(H100_BYTES): 132}))
    source = CudaSmCounts(root, run=runner)
    h100, l4_uuid = f"GPU-{format_uuid(H100_BYTES)}", f"GPU-{format_uuid(L4_BYTES)}"
    first = source.lookup([h100, l4_uuid])
    assert first.counts == {h100: 132}
    assert "matched none" in first.reasons[l4_uuid]
    assert source.lookup([h100, l4_uuid]) == first and len(runner.calls) == 1
    args, env = runner.calls[0]
    assert args == ["sm-counts", "--libcuda", str(root / "usr" / "lib64" / "libcuda.so.1")]
    pipe_dir = env["CUDA_MPS_PIPE_DIRECTORY"]
    assert "tessera-cuda-probe-" in pipe_dir and not Path(pipe_dir).exists(), "a private, now removed, empty dir"
    source.lookup([h100, "GPU-cccccccc-0000-0000-0000-000000000000"])
    assert len(runner.calls) == 2, "a GPU not asked about before is probed for"


def test_sm_source_without_libcuda_says_so_and_runs_nothing(tmp_path: Path) -> None:
    runner = Runner(SmCounts())
    found = CudaSmCounts(tmp_path, run=runner).lookup(["GPU-x"])
    assert found.counts == {} and found.reasons["GPU-x"].startswith(f"no libcuda.so.1 under driver root {tmp_path}")
    assert runner.calls == []


@pytest.mark.parametrize(("answer", "expected"), [
    (SmCounts(error="cuInit returned CUDA_ERROR_NO_DEVICE (100)"), "asking CUDA failed: cuInit returned"),
    ("not json", "asking CUDA failed:"),
])
def test_sm_source_failure_is_the_reason(tmp_path: Path, answer: SmCounts | str, expected: str) -> None:
    found = CudaSmCounts(_driver_root_with_libcuda(tmp_path), run=Runner(answer)).lookup(["GPU-x"])
    assert found.reasons["GPU-x"].startswith(expected)


# --- NVML discovery gets whole GPUs' SM counts from the source ----------------------------------------


class FixedSmCounts:
    def __init__(self, lookup: SmLookup) -> None:
        self.answer = lookup
        self.asked: list[list[str]] = []

    def lookup(self, uuids: Sequence[str]) -> SmLookup:
        self.asked.append(list(uuids))
        return self.answer


def test_whole_gpus_get_cuda_sm_counts_and_mig_gpus_are_not_asked(tmp_path: Path) -> None:
    mig_gpu, whole = h100_mig(), l4()
    source = FixedSmCounts(SmLookup(counts={whole.uuid: 58}))
    inventory = NvmlDiscovery(nvml=FakeNvml([mig_gpu, whole]), sysfs_root=tmp_path, sm_counts=source).discover()
    assert source.asked == [[whole.uuid]]
    assert [(g.uuid, g.multiprocessors, g.multiprocessors_missing) for g in inventory.gpus] == [
        (mig_gpu.uuid, None, None), (whole.uuid, 58, None)]


def test_a_gpu_without_sm_count_carries_the_reason_logged_once(tmp_path: Path,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    whole = l4()
    source = FixedSmCounts(SmLookup(reasons={whole.uuid: "no libcuda.so.1 under driver root /x"}))
    discovery = NvmlDiscovery(nvml=FakeNvml([whole]), sysfs_root=tmp_path, sm_counts=source)
    with caplog.at_level(logging.WARNING):
        [gpu] = discovery.discover().gpus
        discovery.discover()
    assert gpu.multiprocessors is None and gpu.multiprocessors_missing == "no libcuda.so.1 under driver root /x"
    warnings = [r for r in caplog.records if "without its SM count" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].__dict__["reason"] == "no libcuda.so.1 under driver root /x"


def test_nvml_sm_count_is_kept_when_nvml_gives_one(tmp_path: Path) -> None:
    whole = l4()
    whole.multiprocessors = 58
    source = FixedSmCounts(SmLookup())
    [gpu] = NvmlDiscovery(nvml=FakeNvml([whole]), sysfs_root=tmp_path, sm_counts=source).discover().gpus
    assert gpu.multiprocessors == 58 and source.asked == []


def test_the_probe_child_reports_an_unloadable_libcuda(tmp_path: Path) -> None:
    fake = tmp_path / "libcuda.so.1"
    fake.write_text("not an ELF file\n")
    line = run_probe(["sm-counts", "--libcuda", str(fake)], probe_env(tmp_path, {}), timeout=30)
    answer = SmCounts.model_validate(json.loads(line))
    assert answer.counts == {} and answer.error is not None and answer.error.startswith(f"cannot load {fake}")


# --- the ctypes client against a compiled stand-in for libcuda ----------------------------------------


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tests/support/fake_libcuda.c built as a shared object: the real calling convention, no GPU."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler to build the libcuda stand-in (the ctypes layouts are checked where one exists)")
    out = tmp_path_factory.mktemp("fake-libcuda") / "libcuda.so.1"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(out), str(REPO / "tests/support/fake_libcuda.c")],
                   check=True, capture_output=True, timeout=60)
    return out


def test_ctypes_client_marshals_the_driver_api(fake_libcuda: Path, tmp_path: Path) -> None:
    env = probe_env(tmp_path, {})
    line = run_probe(["mps-client", "--libcuda", str(fake_libcuda), "--step-mib", "128", "--cap-mib", "4096"],
                     env, timeout=30)
    report = ClientReport.model_validate(json.loads(line))
    assert report.device_uuid == "aa010203-0405-0607-0809-0a0b0c0d0e0f", "cuDeviceGetUuid_v2 is preferred"
    assert (report.multiprocessors, report.affinity_sm_count) == (132, 34)
    assert (report.allocated_bytes, report.allocation_error) == (2048 * MIB, "CUDA_ERROR_OUT_OF_MEMORY")
    counts = SmCounts.model_validate(json.loads(
        run_probe(["sm-counts", "--libcuda", str(fake_libcuda)], env, timeout=30)))
    assert counts.counts == {"aa010203-0405-0607-0809-0a0b0c0d0e0f": 132, "aa111213-1415-1617-1819-1a1b1c1d1e1f": 132}


def test_a_hanging_probe_is_killed_with_its_process_group(fake_libcuda: Path, tmp_path: Path) -> None:
    env = probe_env(tmp_path, {"FAKE_CUDA_HANG": "1", "TESSERA_TEST_MARK": str(tmp_path)})
    with pytest.raises(ProbeFailed, match="did not finish within 1s and was killed"):
        run_probe(["sm-counts", "--libcuda", str(fake_libcuda)], env, timeout=1)
    assert processes_mentioning(str(tmp_path), in_environment=True) == []
