"""NvmlDiscovery against a fake pynvml module: an H100 with MIG enabled and an L4 without MIG.

The fake has pynvml's names (functions, constants, exception classes) and raises the same
exceptions a real driver does for unsupported queries, so degradation paths are exercised.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from driver.config import Settings
from driver.gpu.discovery.inventory import MigInstance
from driver.gpu.discovery.nvml import NvmlDiscovery, NvmlDiscoveryError
from driver.gpu.discovery.nvmlvalues import (
    addressing_mode_name,
    architecture_name,
    brand_name,
    cuda_version_string,
    normalise_pci_bus_id,
    pcie_root_from_link,
)
from driver.gpu.host.binaries import LIB_DIRS
from driver.gpu.published.devices import make_view
from driver.nodelayout import open_discovery
from driver.simulation.discovery import SimulatedDiscovery
from driver.units import MIB
from tests.support.ctypesfake import Struct

# --- the fake pynvml ---------------------------------------------------------------------------


# pynvml's own class names, so the code under test finds them where it would in pynvml.
class NVMLError(Exception):
    value = 999

    def __str__(self) -> str:
        return type(self).__name__


class NVMLError_NotSupported(NVMLError):
    value = 3


class NVMLError_InvalidArgument(NVMLError):
    value = 2


class NVMLError_NotFound(NVMLError):
    value = 6


class NVMLError_FunctionNotFound(NVMLError):
    value = 13


class NVMLError_DriverNotLoaded(NVMLError):
    value = 9


class NVMLError_GpuIsLost(NVMLError):
    value = 15


@dataclass
class ProfileInfoV1:
    """The v1 GPU/compute instance profile struct; field names are NVML's."""

    id: int
    sliceCount: int
    memorySizeMB: int
    multiprocessorCount: int
    copyEngineCount: int = 0
    decoderCount: int = 0
    encoderCount: int = 0
    jpegCount: int = 0
    ofaCount: int = 0


@dataclass
class ProfileInfo(ProfileInfoV1):
    """The v2 struct: v1's fields and the profile's name."""

    name: bytes = b""


@dataclass
class Placement:
    start: int
    size: int


@dataclass
class FakeCi:
    id: int
    profile_id: int


@dataclass
class FakeGi:
    id: int
    profile_id: int
    placement: Placement
    cis: dict[int, FakeCi]
    ci_profiles: dict[int, ProfileInfo]  # CI enum -> info


@dataclass
class FakeMig:
    uuid: str
    gi_id: int
    ci_id: int


@dataclass
class FakeGpu:
    uuid: str
    name: str
    minor: int
    brand: int
    architecture: int
    compute_capability: tuple[int, int]
    memory_total: int
    bus_id: bytes
    multiprocessors: int | None = None
    addressing_mode: int | None = None
    mig_mode: list[int] | None = None
    gi_profiles: dict[int, ProfileInfo] = field(default_factory=dict)  # GI enum -> info
    gis: dict[int, FakeGi] = field(default_factory=dict)
    mig_slots: list[FakeMig | None] = field(default_factory=list)
    failures: dict[str, NVMLError] = field(default_factory=dict)  # function name -> error to raise




class FakeNvml:
    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_GpuIsLost = NVMLError_GpuIsLost

    NVML_INIT_FLAG_NO_GPUS = 1
    NVML_DEVICE_MIG_DISABLE = 0
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 9
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0
    # The profile enums the driver knows (the library's constant above may be older than the driver).
    DRIVER_GI_PROFILE_COUNT = 0x12

    def __init__(
        self,
        gpus: list[FakeGpu],
        driver_version: str | bytes = "580.95.05",
        cuda_version: int = 13000,
        v2_profile_info: bool = True,
    ) -> None:
        self.gpus = gpus
        self.driver_version = driver_version
        self.cuda_version = cuda_version
        self.v2_profile_info = v2_profile_info
        self.calls: list[str] = []
        self.init_error: NVMLError | None = None

    def _call(self, name: str, gpu: FakeGpu | None = None) -> None:
        self.calls.append(name)
        if gpu is not None and name in gpu.failures:
            raise gpu.failures[name]

    # system
    def nvmlInitWithFlags(self, flags: int) -> None:
        self._call(f"nvmlInitWithFlags({flags})")
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self._call("nvmlShutdown")

    def nvmlSystemGetDriverVersion(self) -> str | bytes:
        self._call("nvmlSystemGetDriverVersion")
        return self.driver_version

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        self._call("nvmlSystemGetCudaDriverVersion")
        return self.cuda_version

    def nvmlDeviceGetCount(self) -> int:
        self._call("nvmlDeviceGetCount")
        return len(self.gpus)

    # whole GPU
    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        gpu = self.gpus[index]
        self._call("nvmlDeviceGetHandleByIndex", gpu)
        return gpu

    def nvmlDeviceGetUUID(self, handle: FakeGpu | FakeMig) -> str:
        if isinstance(handle, FakeMig):
            self._call("nvmlDeviceGetUUID(mig)")
            return handle.uuid
        self._call("nvmlDeviceGetUUID", handle)
        return handle.uuid

    def nvmlDeviceGetMinorNumber(self, gpu: FakeGpu) -> int:
        self._call("nvmlDeviceGetMinorNumber", gpu)
        return gpu.minor

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> str:
        self._call("nvmlDeviceGetName", gpu)
        return gpu.name

    def nvmlDeviceGetBrand(self, gpu: FakeGpu) -> int:
        self._call("nvmlDeviceGetBrand", gpu)
        return gpu.brand

    def nvmlDeviceGetArchitecture(self, gpu: FakeGpu) -> int:
        self._call("nvmlDeviceGetArchitecture", gpu)
        return gpu.architecture

    def nvmlDeviceGetCudaComputeCapability(self, gpu: FakeGpu) -> tuple[int, int]:
        self._call("nvmlDeviceGetCudaComputeCapability", gpu)
        return gpu.compute_capability

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> Struct:
        self._call("nvmlDeviceGetMemoryInfo", gpu)
        return Struct({"total": gpu.memory_total, "free": 0, "used": 0})

    def nvmlDeviceGetAttributes(self, gpu: FakeGpu) -> Struct:
        self._call("nvmlDeviceGetAttributes", gpu)
        if gpu.multiprocessors is None:
            raise NVMLError_NotSupported()
        return Struct({"multiprocessorCount": gpu.multiprocessors})

    def nvmlDeviceGetPciInfo(self, gpu: FakeGpu) -> Struct:
        self._call("nvmlDeviceGetPciInfo", gpu)
        return Struct({"busId": gpu.bus_id})

    def nvmlDeviceGetAddressingMode(self, gpu: FakeGpu) -> int:
        self._call("nvmlDeviceGetAddressingMode", gpu)
        if gpu.addressing_mode is None:
            raise NVMLError_NotSupported()
        return gpu.addressing_mode

    def nvmlDeviceGetMigMode(self, gpu: FakeGpu) -> list[int]:
        self._call("nvmlDeviceGetMigMode", gpu)
        if gpu.mig_mode is None:
            raise NVMLError_NotSupported()
        return gpu.mig_mode

    # MIG
    def nvmlDeviceGetGpuInstanceProfileInfo(self, gpu: FakeGpu, profile: int, version: int = 2) -> Any:
        self._call(f"nvmlDeviceGetGpuInstanceProfileInfo(v{version})", gpu)
        if version == 2 and not self.v2_profile_info:
            raise NVMLError_FunctionNotFound()
        if profile >= self.DRIVER_GI_PROFILE_COUNT:
            raise NVMLError_InvalidArgument()
        if profile not in gpu.gi_profiles:
            raise NVMLError_NotSupported()
        info = gpu.gi_profiles[profile]
        if version == 1:
            return ProfileInfoV1(**{k: v for k, v in vars(info).items() if k != "name"})
        return info

    def nvmlDeviceGetMaxMigDeviceCount(self, gpu: FakeGpu) -> int:
        self._call("nvmlDeviceGetMaxMigDeviceCount", gpu)
        return len(gpu.mig_slots)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, gpu: FakeGpu, index: int) -> FakeMig:
        self._call("nvmlDeviceGetMigDeviceHandleByIndex", gpu)
        mig = gpu.mig_slots[index]
        if mig is None:
            raise NVMLError_NotFound()
        return mig

    def nvmlDeviceGetGpuInstanceId(self, mig: FakeMig) -> int:
        self._call("nvmlDeviceGetGpuInstanceId")
        return mig.gi_id

    def nvmlDeviceGetComputeInstanceId(self, mig: FakeMig) -> int:
        self._call("nvmlDeviceGetComputeInstanceId")
        return mig.ci_id

    def nvmlDeviceGetGpuInstanceById(self, gpu: FakeGpu, gi_id: int) -> FakeGi:
        self._call("nvmlDeviceGetGpuInstanceById", gpu)
        if gi_id not in gpu.gis:
            raise NVMLError_NotFound()
        return gpu.gis[gi_id]

    def nvmlGpuInstanceGetInfo(self, gi: FakeGi) -> Struct:
        self._call("nvmlGpuInstanceGetInfo")
        return Struct({"id": gi.id, "profileId": gi.profile_id, "placement": gi.placement})

    def nvmlGpuInstanceGetComputeInstanceById(self, gi: FakeGi, ci_id: int) -> FakeCi:
        self._call("nvmlGpuInstanceGetComputeInstanceById")
        if ci_id not in gi.cis:
            raise NVMLError_NotFound()
        return gi.cis[ci_id]

    def nvmlComputeInstanceGetInfo(self, ci: FakeCi) -> Struct:
        self._call("nvmlComputeInstanceGetInfo")
        return Struct({"id": ci.id, "profileId": ci.profile_id})

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, gi: FakeGi, profile: int, eng_profile: int) -> ProfileInfo:
        self._call("nvmlGpuInstanceGetComputeInstanceProfileInfo")
        if profile not in gi.ci_profiles:
            raise NVMLError_NotSupported()
        return gi.ci_profiles[profile]


# --- fixtures ----------------------------------------------------------------------------------

H100_TOTAL = 81559 * MIB
# GI enum -> profile, as an H100 80GB reports them (ids and sizes from the MIG reference table).
H100_GI_PROFILES = {
    0: ProfileInfo(19, 1, 9984, 16, copyEngineCount=1, name=b"MIG 1g.10gb"),
    7: ProfileInfo(20, 1, 9984, 16, copyEngineCount=1, decoderCount=1, jpegCount=1, ofaCount=1, name=b"MIG 1g.10gb+me"),
    9: ProfileInfo(15, 1, 20096, 26, copyEngineCount=1, decoderCount=1, jpegCount=1, name=b"MIG 1g.20gb"),
    1: ProfileInfo(14, 2, 20096, 32, copyEngineCount=2, decoderCount=2, jpegCount=2, name=b"MIG 2g.20gb"),
    2: ProfileInfo(9, 3, 40448, 60, copyEngineCount=3, decoderCount=3, jpegCount=3, name=b"MIG 3g.40gb"),
    3: ProfileInfo(5, 4, 40448, 64, copyEngineCount=4, decoderCount=4, jpegCount=4, name=b"MIG 4g.40gb"),
    4: ProfileInfo(0, 7, 81152, 132, copyEngineCount=8, decoderCount=7, jpegCount=7, ofaCount=1, name=b"MIG 7g.80gb"),
}


def ci_profiles(*slice_counts_and_sms: tuple[int, int, int]) -> dict[int, ProfileInfo]:
    """CI enum -> info from (enum, slices, SMs); the CI profile id equals the enum here."""
    return {enum: ProfileInfo(enum, slices, 0, sms) for enum, slices, sms in slice_counts_and_sms}


def h100_mig() -> FakeGpu:
    one_g = FakeGi(9, 19, Placement(3, 1), {0: FakeCi(0, 0)}, ci_profiles((0, 1, 16)))
    three_g = FakeGi(2, 9, Placement(4, 4), {0: FakeCi(0, 2)}, ci_profiles((0, 1, 16), (1, 2, 32), (2, 3, 60)))
    return FakeGpu(
        uuid="GPU-aaaaaaaa-0000-0000-0000-000000000000",
        name="NVIDIA H100 80GB HBM3",
        minor=0,
        brand=14,
        architecture=9,
        compute_capability=(9, 0),
        memory_total=H100_TOTAL,
        bus_id=b"00000000:3B:00.0",
        addressing_mode=1,
        mig_mode=[1, 1],
        gi_profiles=dict(H100_GI_PROFILES),
        gis={9: one_g, 2: three_g},
        mig_slots=[None, FakeMig("MIG-one", 9, 0), None, FakeMig("MIG-three", 2, 0), None],
    )


def l4() -> FakeGpu:
    return FakeGpu(
        uuid="GPU-bbbbbbbb-0000-0000-0000-000000000000",
        name="NVIDIA L4",
        minor=1,
        brand=2,
        architecture=8,
        compute_capability=(8, 9),
        memory_total=23034 * MIB,
        bus_id=b"00000000:C1:00.0",
    )


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    devices = tmp_path / "bus" / "pci" / "devices"
    devices.mkdir(parents=True)
    os.symlink("../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0", devices / "0000:3b:00.0")
    return tmp_path


def discover(fake: FakeNvml, sysfs_root: Path) -> Any:
    return NvmlDiscovery(nvml=fake, sysfs_root=sysfs_root).discover()


# --- whole-GPU fields --------------------------------------------------------------------------


def test_h100_fields(sysfs: Path) -> None:
    inventory = discover(FakeNvml([h100_mig(), l4()]), sysfs)
    assert inventory.driver_version == "580.95.05"
    assert inventory.cuda_driver_version == "13.0"
    h100 = inventory.gpus[0]
    assert (h100.minor, h100.index, h100.uuid) == (0, 0, "GPU-aaaaaaaa-0000-0000-0000-000000000000")
    assert (h100.product_name, h100.brand, h100.architecture) == ("NVIDIA H100 80GB HBM3", "Nvidia", "Hopper")
    assert h100.cuda_compute_capability == "9.0"
    assert h100.memory_bytes == H100_TOTAL
    assert h100.pci_bus_id == "0000:3b:00.0"
    assert h100.pcie_root == "pci0000:3a"
    assert h100.addressing_mode == "HMM"
    assert (h100.mig_capable, h100.mig_enabled) == (True, True)


def test_l4_unsupported_queries_become_missing_fields(sysfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="driver.gpu.discovery.nvml"):
        inventory = discover(FakeNvml([l4()]), sysfs)
    [gpu] = inventory.gpus
    assert (gpu.mig_capable, gpu.mig_enabled, gpu.mig_instances) == (False, False, ())
    assert gpu.addressing_mode is None
    assert gpu.multiprocessors is None
    assert gpu.pci_bus_id == "0000:c1:00.0"
    assert gpu.pcie_root is None  # no sysfs entry for it
    assert (gpu.brand, gpu.architecture, gpu.cuda_compute_capability) == ("Tesla", "Ada Lovelace", "8.9")
    assert any(getattr(r, "query", None) == "addressing mode" for r in caplog.records)


def test_multiprocessors_when_nvml_reports_them(sysfs: Path) -> None:
    gpu = l4()
    gpu.multiprocessors = 58
    assert discover(FakeNvml([gpu]), sysfs).gpus[0].multiprocessors == 58


@pytest.mark.parametrize(
    "function",
    [
        "nvmlDeviceGetName",
        "nvmlDeviceGetBrand",
        "nvmlDeviceGetArchitecture",
        "nvmlDeviceGetCudaComputeCapability",
        "nvmlDeviceGetMemoryInfo",
        "nvmlDeviceGetPciInfo",
        "nvmlDeviceGetAddressingMode",
        "nvmlDeviceGetMigMode",
    ],
)
@pytest.mark.parametrize("error", [NVMLError_NotSupported, NVMLError_FunctionNotFound, NVMLError_GpuIsLost])
def test_any_optional_query_failure_degrades(sysfs: Path, function: str, error: type[NVMLError]) -> None:
    gpu = l4()
    gpu.failures[function] = error()
    [info] = discover(FakeNvml([gpu]), sysfs).gpus
    assert info.uuid == gpu.uuid
    assert info.minor == 1
    expected_missing = {
        "nvmlDeviceGetName": info.product_name == "Unknown",
        "nvmlDeviceGetBrand": info.brand is None,
        "nvmlDeviceGetArchitecture": info.architecture is None,
        "nvmlDeviceGetCudaComputeCapability": info.cuda_compute_capability is None,
        "nvmlDeviceGetMemoryInfo": info.memory_bytes is None,
        "nvmlDeviceGetPciInfo": info.pci_bus_id is None and info.pcie_root is None,
        "nvmlDeviceGetAddressingMode": info.addressing_mode is None,
        "nvmlDeviceGetMigMode": not info.mig_capable,
    }
    assert expected_missing[function]


def test_a_pynvml_without_the_function_degrades(sysfs: Path) -> None:
    class OlderNvml(FakeNvml):
        def __getattribute__(self, name: str) -> Any:
            if name == "nvmlDeviceGetAddressingMode":
                raise AttributeError(name)
            return super().__getattribute__(name)

    gpu = h100_mig()
    assert discover(OlderNvml([gpu]), sysfs).gpus[0].addressing_mode is None


def test_gpu_that_cannot_be_identified_is_skipped(sysfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    broken = l4()
    broken.failures["nvmlDeviceGetMinorNumber"] = NVMLError_NotSupported()
    inventory = discover(FakeNvml([broken, h100_mig()]), sysfs)
    assert [g.uuid for g in inventory.gpus] == ["GPU-aaaaaaaa-0000-0000-0000-000000000000"]
    assert inventory.gpus[0].index == 1
    assert any("cannot identify" in r.getMessage() for r in caplog.records)


def test_driver_versions(sysfs: Path) -> None:
    inventory = discover(FakeNvml([], driver_version=b"535.104.12", cuda_version=12040), sysfs)
    assert (inventory.driver_version, inventory.cuda_driver_version, inventory.gpus) == ("535.104.12", "12.4", ())


def test_unknown_enum_values() -> None:
    assert brand_name(99) == "Unknown"
    assert brand_name(0) == "Unknown"
    assert brand_name(13) == "NvidiaRTX"
    assert architecture_name(0xFFFFFFFF) is None
    assert architecture_name(10) == "Blackwell"
    assert addressing_mode_name(2) == "ATS"
    assert addressing_mode_name(0) == "None"
    assert addressing_mode_name(7) is None
    assert cuda_version_string(13000) == "13.0"
    assert cuda_version_string(12090) == "12.9"


@pytest.mark.parametrize(
    ("raw", "normalised"),
    [
        (b"00000000:3B:00.0", "0000:3b:00.0"),
        ("00000000:3b:00.0", "0000:3b:00.0"),
        ("0000:3B:00.0", "0000:3b:00.0"),
        ("00000001:C1:1F.7", "0001:c1:1f.7"),
        (b"00000000:3B:00.0\x00", "0000:3b:00.0"),
        ("3b:00.0", None),
        ("00000000:3B:00", None),
        ("100000000:3B:00.0", None),
        ("000010000:3B:00.0", None),
        ("garbage", None),
    ],
)
def test_pci_bus_id_normalisation(raw: str | bytes, normalised: str | None) -> None:
    assert normalise_pci_bus_id(raw) == normalised


@pytest.mark.parametrize(
    ("link", "root"),
    [
        ("../../../devices/pci0000:3a/0000:3a:00.0/0000:3b:00.0", "pci0000:3a"),
        ("../../../devices/pci0001:c0/0001:c0:01.0/0001:c1:00.0/0001:c2:00.0", "pci0001:c0"),
        ("../../../devices/platform/soc/0000:3b:00.0", None),
    ],
)
def test_pcie_root_from_link(link: str, root: str | None) -> None:
    assert pcie_root_from_link(link) == root


# --- session -----------------------------------------------------------------------------------


def test_nvml_is_initialised_once_without_requiring_gpus_and_shut_down_on_close(sysfs: Path) -> None:
    fake = FakeNvml([l4()])
    discovery = NvmlDiscovery(nvml=fake, sysfs_root=sysfs)
    discovery.discover()
    discovery.discover()
    assert fake.calls.count("nvmlInitWithFlags(1)") == 1
    discovery.close()
    discovery.close()
    assert fake.calls.count("nvmlShutdown") == 1


def test_close_without_discover_does_not_touch_nvml() -> None:
    fake = FakeNvml([])
    NvmlDiscovery(nvml=fake).close()
    assert fake.calls == []


def test_init_failure_is_a_clear_error() -> None:
    fake = FakeNvml([])
    fake.init_error = NVMLError_DriverNotLoaded()
    with pytest.raises(NvmlDiscoveryError, match=r"NVML initialisation failed \(NVMLError_DriverNotLoaded\).*driver"):
        NvmlDiscovery(nvml=fake).discover()


# --- loading libnvidia-ml from the driver root -------------------------------------------------


def _recording_loader(fake: FakeNvml) -> Any:
    def load(path: Path) -> None:
        fake.calls.append(f"load({path})")

    return load


def test_nvml_library_is_loaded_from_the_driver_root_before_init(tmp_path: Path) -> None:
    lib64 = tmp_path / "usr" / "lib64"
    lib64.mkdir(parents=True)
    (lib64 / "libnvidia-ml.so.580.95.05").write_text("")
    # An absolute link, as some installers write: on the host it points inside the driver root.
    (lib64 / "libnvidia-ml.so.1").symlink_to("/usr/lib64/libnvidia-ml.so.580.95.05")
    fake = FakeNvml([l4()])
    discovery = NvmlDiscovery(nvml=fake, driver_root=tmp_path, load_library=_recording_loader(fake))
    discovery.discover()
    discovery.discover()
    assert fake.calls[:2] == [f"load({lib64 / 'libnvidia-ml.so.580.95.05'})", "nvmlInitWithFlags(1)"]
    assert sum(call.startswith("load(") for call in fake.calls) == 1


def test_missing_nvml_library_says_where_it_looked_and_what_to_set(tmp_path: Path) -> None:
    (tmp_path / "usr" / "lib").mkdir(parents=True)
    (tmp_path / "usr" / "lib" / "libc.so.6").write_text("")
    fake = FakeNvml([l4()])
    with pytest.raises(NvmlDiscoveryError) as caught:
        NvmlDiscovery(nvml=fake, driver_root=tmp_path, load_library=_recording_loader(fake)).discover()
    message = str(caught.value)
    assert f"libnvidia-ml.so.1 not found under driver root {tmp_path}" in message
    for lib_dir in LIB_DIRS:
        assert str(tmp_path / lib_dir) in message
    assert "nvidiaDriverRoot" in message
    assert "--driver-root" in message
    assert fake.calls == []  # NVML itself was never started


def test_unloadable_nvml_library_is_a_clear_error(tmp_path: Path) -> None:
    lib = tmp_path / "usr" / "lib" / "x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libnvidia-ml.so.1").write_text("not an ELF file")
    fake = FakeNvml([l4()])

    def refuse(path: Path) -> None:
        raise OSError(f"{path}: invalid ELF header")

    with pytest.raises(NvmlDiscoveryError, match=r"cannot load .*libnvidia-ml\.so\.1 .*invalid ELF header"):
        NvmlDiscovery(nvml=fake, driver_root=tmp_path, load_library=refuse).discover()
    assert fake.calls == []


def test_driver_at_root_leaves_loading_to_pynvml(sysfs: Path) -> None:
    fake = FakeNvml([l4()])

    def must_not_load(path: Path) -> None:
        raise AssertionError(f"loaded {path}")

    NvmlDiscovery(nvml=fake, sysfs_root=sysfs, load_library=must_not_load).discover()
    NvmlDiscovery(nvml=fake, sysfs_root=sysfs, driver_root=Path("/"), load_library=must_not_load).discover()


_SONAME_PROBE = """
import ctypes, sys
from pathlib import Path
from driver.gpu.discovery.nvml import NvmlDiscovery

class ProbeNvml:
    # pynvml does CDLL("libnvidia-ml.so.1") on init; do the same and call the probe library's function.
    class NVMLError(Exception):
        pass
    NVML_INIT_FLAG_NO_GPUS = 1
    def nvmlInitWithFlags(self, flags):
        print(ctypes.CDLL("libnvidia-ml.so.1").tessera_probe())
        sys.exit(0)

NvmlDiscovery(nvml=ProbeNvml(), driver_root=Path(sys.argv[1])).discover()
"""


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler to build a library with a soname")
def test_pynvmls_load_by_soname_gets_the_driver_roots_library(tmp_path: Path) -> None:
    # A separate process: the stand-in library must not become this process's libnvidia-ml.
    lib = tmp_path / "root" / "usr" / "lib" / "x86_64-linux-gnu"
    lib.mkdir(parents=True)
    source = tmp_path / "probe.c"
    source.write_text("int tessera_probe(void) { return 42; }\n")
    subprocess.run(
        ["cc", "-shared", "-fPIC", "-Wl,-soname,libnvidia-ml.so.1", "-o", str(lib / "libnvidia-ml.so.580.1"),
         str(source)],
        check=True,
        timeout=60,
    )
    (lib / "libnvidia-ml.so.1").symlink_to("libnvidia-ml.so.580.1")
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    done = subprocess.run(
        [sys.executable, "-c", _SONAME_PROBE, str(tmp_path / "root")],
        capture_output=True, text=True, timeout=60, check=False, env=env, cwd=Path(__file__).resolve().parents[4],
    )
    assert (done.returncode, done.stdout.strip()) == (0, "42"), done.stderr


def test_open_discovery_looks_for_nvml_under_the_driver_root(tmp_path: Path) -> None:
    discovery = open_discovery(Settings(driver_root=tmp_path), "node-a")
    assert isinstance(discovery, NvmlDiscovery)
    with pytest.raises(NvmlDiscoveryError, match=f"not found under driver root {tmp_path}"):
        discovery.discover()
    assert isinstance(open_discovery(Settings(), "node-a"), NvmlDiscovery)


def test_open_discovery_simulates_only_when_asked(tmp_path: Path) -> None:
    discovery = open_discovery(Settings(simulate="demo", driver_root=tmp_path), "node-a")
    assert isinstance(discovery, SimulatedDiscovery)
    assert [g.uuid for g in discovery.discover().gpus] == [
        g.uuid for g in SimulatedDiscovery("demo", "node-a").discover().gpus]


# --- MIG ---------------------------------------------------------------------------------------


def test_mig_instances_are_enumerated(sysfs: Path) -> None:
    h100 = discover(FakeNvml([h100_mig()]), sysfs).gpus[0]
    # One line each for identity, placement and capacity, so the two devices compare line by line.
    assert h100.mig_instances == (
        MigInstance(
            uuid="MIG-one", profile="1g.10gb", gi_profile_id=19,
            placement_start=3, placement_size=1, gi_id=9, ci_id=0,
            memory_bytes=9984 * MIB, multiprocessors=16,
            copy_engines=1, decoders=0, encoders=0, jpeg_engines=0, ofa_engines=0,
        ),
        MigInstance(
            uuid="MIG-three", profile="3g.40gb", gi_profile_id=9,
            placement_start=4, placement_size=4, gi_id=2, ci_id=0,
            memory_bytes=40448 * MIB, multiprocessors=60,
            copy_engines=3, decoders=3, encoders=0, jpeg_engines=3, ofa_engines=0,
        ),
    )


def test_mig_devices_published_from_nvml(sysfs: Path) -> None:
    inventory = discover(FakeNvml([h100_mig(), l4()]), sysfs)
    names = [d.name for d in make_view(inventory, {}).devices]
    assert names == ["gpu-0-mig-1g10gb-3", "gpu-0-mig-3g40gb-4", "gpu-1"]


def test_mig_capable_but_disabled(sysfs: Path) -> None:
    gpu = h100_mig()
    gpu.mig_mode = [0, 1]  # enabling is pending: still disabled now
    [info] = discover(FakeNvml([gpu]), sysfs).gpus
    assert (info.mig_capable, info.mig_enabled, info.mig_instances) == (True, False, ())
    assert info.mig_mode_pending == "enable"


def test_a_pending_mig_disable_is_discovered_and_a_settled_mode_has_none_pending(sysfs: Path) -> None:
    disabling, settled = h100_mig(), h100_mig()
    disabling.mig_mode = [1, 0]
    [first, second] = discover(FakeNvml([disabling, settled]), sysfs).gpus
    assert (first.mig_enabled, first.mig_mode_pending) == (True, "disable")
    assert (second.mig_enabled, second.mig_mode_pending) == (True, None)


def test_compute_instance_smaller_than_its_gpu_instance(sysfs: Path) -> None:
    gpu = h100_mig()
    gpu.gis[2].cis = {0: FakeCi(0, 0), 1: FakeCi(1, 1)}  # a 1-slice and a 2-slice CI inside the 3g GI
    gpu.mig_slots = [FakeMig("MIG-a", 2, 0), FakeMig("MIG-b", 2, 1)]
    fake = FakeNvml([gpu])
    [info] = discover(fake, sysfs).gpus
    assert [(m.profile, m.multiprocessors, m.ci_id) for m in info.mig_instances] == [
        ("1c.3g.40gb", 16, 0),
        ("2c.3g.40gb", 32, 1),
    ]
    # Looked up once per GPU instance, not once per MIG device.
    assert fake.calls.count("nvmlDeviceGetGpuInstanceById") == 1
    assert (
        fake.calls.count("nvmlGpuInstanceGetComputeInstanceProfileInfo") == FakeNvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT
    )


def test_profiles_are_enumerated_once_per_gpu_per_discover(sysfs: Path) -> None:
    fake = FakeNvml([h100_mig()])
    discovery = NvmlDiscovery(nvml=fake, sysfs_root=sysfs)
    discovery.discover()
    assert fake.calls.count("nvmlDeviceGetGpuInstanceProfileInfo(v2)") == FakeNvml.NVML_GPU_INSTANCE_PROFILE_COUNT
    discovery.discover()  # a new discover sees MIG changes: it asks again
    assert fake.calls.count("nvmlDeviceGetGpuInstanceProfileInfo(v2)") == 2 * FakeNvml.NVML_GPU_INSTANCE_PROFILE_COUNT


class OldPynvml(FakeNvml):
    """nvidia-ml-py 12.560: its COUNT constant stops before the +gfx/-me/+me.all profiles (0xA-0x11),
    while the driver still answers for them."""

    NVML_GPU_INSTANCE_PROFILE_COUNT = 0xA


def test_profiles_past_an_old_pynvml_count_are_enumerated(sysfs: Path) -> None:
    gpu = h100_mig()
    # A 1-slice +gfx GPU instance (enum 0xA, 1_SLICE_GFX) where the 1g.10gb one was.
    gpu.gi_profiles[0xA] = dataclasses.replace(gpu.gi_profiles[0], id=29, name=b"MIG 1g.10gb+gfx")
    gpu.gis[9].profile_id = 29
    [info] = discover(OldPynvml([gpu]), sysfs).gpus
    assert [m.profile for m in info.mig_instances] == ["1g.10gb+gfx", "3g.40gb"]


def test_profile_info_falls_back_to_v1(sysfs: Path) -> None:
    fake = FakeNvml([h100_mig()], v2_profile_info=False)
    [info] = discover(fake, sysfs).gpus
    assert [m.profile for m in info.mig_instances] == ["1g.10gb", "3g.40gb"]
    assert "nvmlDeviceGetGpuInstanceProfileInfo(v1)" in fake.calls


def test_suffixed_profile_is_named_by_its_enum(sysfs: Path) -> None:
    gpu = h100_mig()
    gpu.gis[9].profile_id = 20  # the +me profile (enum 7)
    [info] = discover(FakeNvml([gpu]), sysfs).gpus
    assert info.mig_instances[0].profile == "1g.10gb+me"
    assert info.mig_instances[0].ofa_engines == 1


def test_profile_name_from_nvml_when_total_memory_is_unknown(sysfs: Path) -> None:
    gpu = h100_mig()
    gpu.failures["nvmlDeviceGetMemoryInfo"] = NVMLError_NotSupported()
    [info] = discover(FakeNvml([gpu]), sysfs).gpus
    assert [m.profile for m in info.mig_instances] == ["1g.10gb", "3g.40gb"]


def test_unnameable_mig_device_is_skipped(sysfs: Path) -> None:
    gpu = h100_mig()
    gpu.failures["nvmlDeviceGetMemoryInfo"] = NVMLError_NotSupported()
    [info] = discover(FakeNvml([gpu], v2_profile_info=False), sysfs).gpus  # v1 structs carry no name
    assert info.mig_instances == ()


def test_mig_device_of_unknown_profile_is_skipped_others_kept(sysfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    gpu = h100_mig()
    gpu.gis[9].profile_id = 77
    # The level is set here: a test in the same worker may have left the root logger at CRITICAL.
    with caplog.at_level(logging.WARNING, logger="driver.gpu.discovery.migscan"):
        [info] = discover(FakeNvml([gpu]), sysfs).gpus
    assert [m.uuid for m in info.mig_instances] == ["MIG-three"]
    assert any("unknown profile" in r.getMessage() for r in caplog.records)


def test_mig_device_whose_gpu_instance_vanished_is_skipped(sysfs: Path) -> None:
    gpu = h100_mig()
    del gpu.gis[2]
    [info] = discover(FakeNvml([gpu]), sysfs).gpus
    assert [m.uuid for m in info.mig_instances] == ["MIG-one"]


def test_compute_instance_info_unavailable_assumes_whole_gpu_instance(sysfs: Path) -> None:
    gpu = h100_mig()
    gpu.gis[2].cis = {}
    [info] = discover(FakeNvml([gpu]), sysfs).gpus
    assert info.mig_instances[1].profile == "3g.40gb"
    assert info.mig_instances[1].multiprocessors == 60


def test_mig_count_failure_gives_no_instances(sysfs: Path) -> None:
    gpu = h100_mig()
    gpu.failures["nvmlDeviceGetMaxMigDeviceCount"] = NVMLError_GpuIsLost()
    [info] = discover(FakeNvml([gpu]), sysfs).gpus
    assert (info.mig_enabled, info.mig_instances) == (True, ())
