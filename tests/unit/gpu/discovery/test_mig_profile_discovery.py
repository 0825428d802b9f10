"""Dynamic MIG: the profiles a GPU in MIG mode can create, read through NVML (a fake pynvml) and, for the
simulated node, from the profile tables; both give the same table for an H100 80GB."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pynvml
import pytest

from driver.gpu.discovery.inventory import GpuInfo, MigProfileInfo
from driver.gpu.discovery.nvml import NvmlDiscovery
from driver.simulation.discovery import SimulatedDiscovery
from driver.units import MIB
from tests.unit.gpu.discovery.test_nvml_discovery import FakeGpu, FakeNvml, NVMLError_NotSupported, h100_mig, l4

# GI profile id -> possible placement starts and their size, as an H100 80GB lists them (reference table).
H100_PLACEMENTS = {19: ((0, 1, 2, 3, 4, 5, 6), 1), 20: ((0, 1, 2, 3, 4, 5, 6), 1), 15: ((0, 2, 4, 6), 2),
                   14: ((0, 2, 4), 2), 9: ((0, 4), 4), 5: ((0,), 4), 0: ((0,), 8)}


class PlacingNvml(FakeNvml):
    """The fake pynvml, plus nvmlDeviceGetGpuInstancePossiblePlacements (v2) with pynvml's conventions:
    a NULL array asks for the count; otherwise the array the caller allocated is filled."""

    c_nvmlGpuInstancePlacement_t = pynvml.c_nvmlGpuInstancePlacement_t

    def __init__(self, gpus: list[FakeGpu]) -> None:
        super().__init__(gpus)
        self.refuse_placements: set[int] = set()  # GI profile ids whose placements NVML will not list

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, gpu: FakeGpu, profile_id: int, array: Any,
                                                   count: Any) -> None:
        self._call("nvmlDeviceGetGpuInstancePossiblePlacements", gpu)
        if profile_id in self.refuse_placements:
            raise NVMLError_NotSupported()
        starts, size = H100_PLACEMENTS[profile_id]
        if array is not None:
            assert count._obj.value >= len(starts)  # the caller sized the array from the first call
            for i, start in enumerate(starts):
                array[i].start, array[i].size = start, size
        count._obj.value = len(starts)


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    return tmp_path


def discover(fake: FakeNvml, sysfs: Path) -> tuple[GpuInfo, ...]:
    return NvmlDiscovery(nvml=fake, sysfs_root=sysfs).discover().gpus


def shape(profiles: tuple[MigProfileInfo, ...]) -> list[tuple[Any, ...]]:
    return [(p.name, p.gi_profile_id, p.ci_profile_id, p.compute_slices, p.memory_slices, p.memory_bytes,
             p.multiprocessors, p.placement_starts) for p in profiles]


def test_an_h100_in_mig_mode_lists_every_profile_and_its_placements(sysfs: Path) -> None:
    [h100] = discover(PlacingNvml([h100_mig()]), sysfs)
    assert h100.mig_memory_slices == 8
    assert shape(h100.mig_profiles) == [
        ("7g.80gb", 0, 4, 7, 8, 81152 * MIB, 132, (0,)),
        ("4g.40gb", 5, 3, 4, 4, 40448 * MIB, 64, (0,)),
        ("3g.40gb", 9, 2, 3, 4, 40448 * MIB, 60, (0, 4)),
        ("2g.20gb", 14, 1, 2, 2, 20096 * MIB, 32, (0, 2, 4)),
        ("1g.20gb", 15, 0, 1, 2, 20096 * MIB, 26, (0, 2, 4, 6)),
        ("1g.10gb", 19, 0, 1, 1, 9984 * MIB, 16, (0, 1, 2, 3, 4, 5, 6)),
        ("1g.10gb+me", 20, 0, 1, 1, 9984 * MIB, 16, (0, 1, 2, 3, 4, 5, 6)),
    ]
    me = next(p for p in h100.mig_profiles if p.name == "1g.10gb+me")
    assert (me.copy_engines, me.decoders, me.encoders, me.jpeg_engines, me.ofa_engines) == (1, 1, 0, 1, 1)


def test_the_simulated_h100_reports_the_same_table(sysfs: Path) -> None:
    [h100] = discover(PlacingNvml([h100_mig()]), sysfs)
    simulated = SimulatedDiscovery("dynamic-mig", "node-a").discover().gpus[0]
    # Engine counts are not in the profile tables: only the rest compares.
    assert shape(simulated.mig_profiles) == shape(h100.mig_profiles)
    assert simulated.mig_memory_slices == h100.mig_memory_slices


def test_a_profile_nvml_will_not_place_is_left_out_and_logged_once(
        sysfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    fake = PlacingNvml([h100_mig()])
    fake.refuse_placements = {9}
    discovery = NvmlDiscovery(nvml=fake, sysfs_root=sysfs)
    with caplog.at_level(logging.WARNING, logger="driver.gpu.discovery.migscan"):
        first = discovery.discover().gpus[0]
        second = discovery.discover().gpus[0]
    assert "3g.40gb" not in [p.name for p in first.mig_profiles]
    assert len(first.mig_profiles) == 6 and first.mig_profiles == second.mig_profiles
    assert [r.getMessage() for r in caplog.records].count("MIG placements unavailable; leaving the profile out") == 1
    assert [m.profile for m in first.mig_instances] == ["1g.10gb", "3g.40gb"]  # existing devices unaffected


def test_a_pynvml_without_the_placements_call_lists_no_profiles(sysfs: Path) -> None:
    [h100] = discover(FakeNvml([h100_mig()]), sysfs)  # the plain fake has no such function
    assert (h100.mig_profiles, h100.mig_memory_slices) == ((), 0)
    assert len(h100.mig_instances) == 2


def test_gpus_not_in_mig_mode_list_no_profiles(sysfs: Path) -> None:
    off = h100_mig()
    off.mig_mode = [0, 0]
    fake = PlacingNvml([off, l4()])
    assert [(g.mig_profiles, g.mig_memory_slices) for g in discover(fake, sysfs)] == [((), 0), ((), 0)]
    assert "nvmlDeviceGetGpuInstancePossiblePlacements" not in fake.calls


def test_a_profile_that_cannot_be_named_is_left_out(sysfs: Path) -> None:
    gpu = h100_mig()
    gpu.memory_total = 0  # no total memory: the name falls back to NVML's own, which this profile lacks
    gpu.gi_profiles[1].name = b""
    [h100] = discover(PlacingNvml([gpu]), sysfs)
    assert "2g.20gb" not in [p.name for p in h100.mig_profiles]
    assert "3g.40gb" in [p.name for p in h100.mig_profiles]  # named from NVML's "MIG 3g.40gb"
