"""NvmlMigPartitioner against a fake pynvml: create (GI then CI), undo on failure, NVML's refusals read, destroy
(CI then GI), listing, and calls bounded in time.

The fake has pynvml's names and calling conventions: structures arrive by ``ctypes.byref``, list calls fill the
arrays they are given, refusals are ``NVMLError`` with nvml.h's codes (23 for an occupied placement or a full GPU,
reference 3.5).
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

from driver.gpu.discovery.inventory import MigProfileInfo
from driver.gpu.runtime.mig import CreatedMig, MigCreateError, MigError, MigGpuInstance, MigPartitioner
from driver.gpu.runtime.nvmlmig import NvmlMigPartitioner
from driver.kubeletplugin.types import Deadline
from tests.support.ctypesfake import Struct

GPU = "GPU-11111111-2222-3333-4444-555555555555"
OTHER_GPU = "GPU-99999999-2222-3333-4444-555555555555"


class FakeNvmlError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {2: "Invalid Argument", 3: "Not Supported", 4: "Insufficient Permissions", 6: "Not Found",
                19: "In use by another client", 23: "Insufficient Resources"}.get(self.value, "Unknown Error")


class FakeNotSupported(FakeNvmlError):
    def __init__(self) -> None:
        super().__init__(3)




# An H100 80GB's GI profiles: enum -> (id, slices, memory slices, instance count, starts) (reference table).
H100 = {0: (19, 1, 1, 7, range(7)), 9: (15, 1, 2, 4, (0, 2, 4, 6)), 1: (14, 2, 2, 3, (0, 2, 4)),
        2: (9, 3, 4, 2, (0, 4)), 3: (5, 4, 4, 1, (0,)), 4: (0, 7, 8, 1, (0,))}
CI_ID_OFFSET = 100  # CI profile ids differ from their enums here, so passing the enum where the id goes shows


@dataclass
class Gi:
    id: int
    profile_id: int
    start: int
    size: int
    cis: dict[int, int] = field(default_factory=dict)  # CI id -> CI profile id


@dataclass
class FakeGpu:
    uuid: str
    mig_enabled: bool = True
    gis: dict[int, Gi] = field(default_factory=dict)


def profile(enum: int, name: str) -> MigProfileInfo:
    pid, slices, memory, _count, starts = H100[enum]
    return MigProfileInfo(name=name, gi_profile_id=pid, ci_profile_id={1: 0, 2: 1, 3: 2, 4: 3, 7: 4}[slices],
                          compute_slices=slices, memory_slices=memory, memory_bytes=memory * 10 << 30,
                          multiprocessors=16 * slices, placement_starts=tuple(starts))


ONE_G = profile(0, "1g.10gb")
THREE_G = profile(2, "3g.40gb")
FOUR_G = profile(3, "4g.40gb")


class FakeNvml:
    NVMLError = FakeNvmlError
    NVMLError_NotSupported = FakeNotSupported
    NVML_DEVICE_MIG_ENABLE = 1
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = 0
    NVML_GPU_INSTANCE_PROFILE_COUNT = 0x12
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT = 9
    c_nvmlGpuInstancePlacement_t = pynvml.c_nvmlGpuInstancePlacement_t
    c_nvmlGpuInstance_t = ctypes.c_void_p  # handles are small ints here
    c_nvmlComputeInstance_t = ctypes.c_void_p

    def __init__(self, *gpus: FakeGpu) -> None:
        self.gpus = {g.uuid: g for g in gpus}
        self.calls: list[tuple[Any, ...]] = []
        self.fail: dict[str, FakeNvmlError] = {}  # call name -> error, raised once
        self.block: threading.Event | None = None  # set: GI creation waits for it, as on a hung GPU
        self.inits = 0

    def _call(self, name: str, *args: Any) -> None:
        self.calls.append((name, *args))
        if name in self.fail:
            raise self.fail.pop(name)

    def _gi(self, handle: int) -> tuple[FakeGpu, Gi]:
        gpu = list(self.gpus.values())[handle // 1000]
        return gpu, gpu.gis[handle % 1000]

    def _gi_handle(self, gpu: FakeGpu, gi_id: int) -> int:
        return list(self.gpus).index(gpu.uuid) * 1000 + gi_id

    def nvmlInit(self) -> None:
        self.inits += 1

    def nvmlShutdown(self) -> None:
        self.inits -= 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        self._call("nvmlDeviceGetHandleByUUID", uuid)
        if uuid not in self.gpus:
            raise FakeNvmlError(6)
        return self.gpus[uuid]

    def nvmlDeviceGetMigMode(self, gpu: FakeGpu) -> list[int]:
        return [int(gpu.mig_enabled), int(gpu.mig_enabled)]

    def nvmlDeviceGetGpuInstanceProfileInfo(self, gpu: FakeGpu, enum: int, version: int = 2) -> Struct:
        if enum not in H100:
            raise FakeNvmlError(3)
        pid, slices, _memory, count, _starts = H100[enum]
        return Struct({"id": pid, "sliceCount": slices, "instanceCount": count})

    def nvmlDeviceCreateGpuInstanceWithPlacement(self, gpu: FakeGpu, profile_id: int, placement: Any) -> int:
        start, size = placement._obj.start, placement._obj.size  # byref, as pynvml needs
        self._call("nvmlDeviceCreateGpuInstanceWithPlacement", profile_id, start, size)
        if self.block is not None:
            self.block.wait(30)
        if not gpu.mig_enabled:
            raise FakeNvmlError(3)
        shape = next((v for v in H100.values() if v[0] == profile_id), None)
        if shape is None:
            raise FakeNvmlError(3)
        if start not in shape[4] or size != shape[2]:
            raise FakeNvmlError(2)
        if any(g.start < start + size and start < g.start + g.size for g in gpu.gis.values()):
            raise FakeNvmlError(23)
        gi_id = next(i for i in range(1, 20) if i not in gpu.gis)
        gpu.gis[gi_id] = Gi(gi_id, profile_id, start, size)
        return self._gi_handle(gpu, gi_id)

    def nvmlDeviceGetGpuInstanceRemainingCapacity(self, gpu: FakeGpu, profile_id: int) -> int:
        shape = next(v for v in H100.values() if v[0] == profile_id)
        free = [s for s in shape[4] if not any(g.start < s + shape[2] and s < g.start + g.size
                                                 for g in gpu.gis.values())]
        return min(len(free), shape[3] - sum(1 for g in gpu.gis.values() if g.profile_id == profile_id))

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(self, handle: int, enum: int, eng: int) -> Struct:
        self._call("nvmlGpuInstanceGetComputeInstanceProfileInfo", enum, eng)
        _gpu, gi = self._gi(handle)
        slices = {0: 1, 1: 2, 2: 3, 3: 4, 4: 7}.get(enum)
        gi_slices = next(v[1] for v in H100.values() if v[0] == gi.profile_id)
        if slices is None or slices > gi_slices:
            raise FakeNvmlError(3)
        return Struct({"id": enum + CI_ID_OFFSET, "sliceCount": slices, "instanceCount": gi_slices // slices})

    def nvmlGpuInstanceCreateComputeInstance(self, handle: int, ci_profile_id: int) -> int:
        self._call("nvmlGpuInstanceCreateComputeInstance", ci_profile_id)
        _gpu, gi = self._gi(handle)
        ci_id = len(gi.cis)
        gi.cis[ci_id] = ci_profile_id
        return handle * 100 + ci_id + 1

    def _ci(self, handle: int) -> tuple[FakeGpu, Gi, int]:
        gpu, gi = self._gi(handle // 100)
        return gpu, gi, handle % 100 - 1

    def nvmlComputeInstanceGetInfo(self, handle: int) -> Struct:
        gpu, gi, ci_id = self._ci(handle)
        return Struct({"id": ci_id, "device": ("mig", gpu.uuid, gi.id, ci_id)})

    def nvmlDeviceGetUUID(self, mig: tuple[str, str, int, int]) -> bytes:
        return f"MIG-{mig[1][4:12]}-gi{mig[2]}-ci{mig[3]}".encode()

    def nvmlGpuInstanceGetInfo(self, handle: int) -> Struct:
        _gpu, gi = self._gi(handle)
        return Struct({"id": gi.id, "profileId": gi.profile_id, "placement": Struct({"start": gi.start,
                                                                                      "size": gi.size})})

    def nvmlDeviceGetGpuInstanceById(self, gpu: FakeGpu, gi_id: int) -> int:
        self._call("nvmlDeviceGetGpuInstanceById", gi_id)
        if not gpu.mig_enabled:
            raise FakeNvmlError(3)
        if gi_id not in gpu.gis:
            raise FakeNvmlError(6)
        return self._gi_handle(gpu, gi_id)

    def nvmlGpuInstanceGetComputeInstanceById(self, handle: int, ci_id: int) -> int:
        _gpu, gi = self._gi(handle)
        if ci_id not in gi.cis:
            raise FakeNvmlError(6)
        return handle * 100 + ci_id + 1

    def nvmlComputeInstanceDestroy(self, handle: int) -> None:
        _gpu, gi, ci_id = self._ci(handle)
        self._call("nvmlComputeInstanceDestroy", gi.id, ci_id)
        del gi.cis[ci_id]

    def nvmlGpuInstanceDestroy(self, handle: int) -> None:
        gpu, gi = self._gi(handle)
        self._call("nvmlGpuInstanceDestroy", gi.id)
        if gi.cis:
            raise FakeNvmlError(19)
        del gpu.gis[gi.id]

    def nvmlDeviceGetGpuInstances(self, gpu: FakeGpu, profile_id: int, array: Any, count: Any) -> None:
        if not gpu.mig_enabled:
            raise FakeNvmlError(3)
        found = [g for g in gpu.gis.values() if g.profile_id == profile_id]
        for i, gi in enumerate(found):
            array[i] = self._gi_handle(gpu, gi.id)
        count._obj.value = len(found)

    def nvmlGpuInstanceGetComputeInstances(self, handle: int, ci_profile_id: int, array: Any, count: Any) -> None:
        _gpu, gi = self._gi(handle)
        found = [ci for ci, pid in gi.cis.items() if pid == ci_profile_id]
        for i, ci in enumerate(found):
            array[i] = handle * 100 + ci + 1
        count._obj.value = len(found)


@pytest.fixture
def nvml() -> FakeNvml:
    return FakeNvml(FakeGpu(GPU), FakeGpu(OTHER_GPU, mig_enabled=False))


@pytest.fixture
def mig(nvml: FakeNvml) -> NvmlMigPartitioner:
    return NvmlMigPartitioner(nvml, timeout=5)


def called(nvml: FakeNvml, name: str) -> list[tuple[Any, ...]]:
    return [c[1:] for c in nvml.calls if c[0] == name]


# ----------------------------------------------------------------------------------------------- create


def test_create_makes_the_gi_at_the_placement_then_a_ci_spanning_it(nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    partitioner: MigPartitioner = mig  # the production class satisfies the protocol
    created = partitioner.create(GPU, THREE_G, 4)
    assert created == CreatedMig(uuid="MIG-11111111-gi1-ci0", gi_id=1, ci_id=0, gi_profile_id=9,
                                 placement_start=4, placement_size=4)
    assert called(nvml, "nvmlDeviceCreateGpuInstanceWithPlacement") == [(9, 4, 4)]
    assert called(nvml, "nvmlGpuInstanceGetComputeInstanceProfileInfo") == [(2, 0)]  # 3-slice CI enum, SHARED
    assert called(nvml, "nvmlGpuInstanceCreateComputeInstance") == [(2 + CI_ID_OFFSET,)]  # the profile's id
    assert nvml.gpus[GPU].gis[1].cis == {0: 2 + CI_ID_OFFSET}


def test_a_failed_compute_instance_destroys_the_gpu_instance_before_the_error(
        nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    nvml.fail["nvmlGpuInstanceCreateComputeInstance"] = FakeNvmlError(999)
    with pytest.raises(MigCreateError, match=r"GPU instance was made, then NVML error 999.*destroyed again") as err:
        mig.create(GPU, ONE_G, 2)
    assert err.value.reason == "failed"
    assert nvml.gpus[GPU].gis == {}
    assert GPU in str(err.value) and "1g.10gb" in str(err.value) and "placement 2" in str(err.value)


def test_a_gi_that_cannot_be_destroyed_again_is_named_and_listed_as_bare(
        nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    nvml.fail["nvmlGpuInstanceCreateComputeInstance"] = FakeNvmlError(999)
    nvml.fail["nvmlGpuInstanceDestroy"] = FakeNvmlError(999)
    with pytest.raises(MigCreateError, match="holds its memory slices until removed"):
        mig.create(GPU, ONE_G, 2)
    assert mig.bare_gpu_instances(GPU) == [MigGpuInstance(gi_id=1, gi_profile_id=19, placement_start=2,
                                                          placement_size=1)]
    assert mig.instances(GPU) == []
    mig.destroy(GPU, 1, None)
    assert mig.bare_gpu_instances(GPU) == []


def test_a_placement_overlapping_a_gi_is_occupied(nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    mig.create(GPU, FOUR_G, 0)
    with pytest.raises(MigCreateError, match=r"overlaps an existing GPU instance \(GI 1 at 0:4\).*error 23") as err:
        mig.create(GPU, THREE_G, 0)  # a 3g still fits at 4: this placement is what is taken
    assert err.value.reason == "occupied"
    assert mig.create(GPU, THREE_G, 4).placement_start == 4


def test_no_room_left_for_the_profile_is_insufficient_resources(nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    for start in range(7):
        mig.create(GPU, ONE_G, start)
    with pytest.raises(MigCreateError) as err:
        mig.create(GPU, ONE_G, 3)
    assert err.value.reason == "insufficient-resources"
    assert "no room left" in str(err.value)


def test_insufficient_resources_with_room_counted_says_so_rather_than_no_room(nvml: FakeNvml,
                                                                            mig: NvmlMigPartitioner) -> None:
    # nvml.h gives INSUFFICIENT_RESOURCES no cause: where the GPU's state shows room and nothing in the way,
    # the message says what was seen instead of claiming the GPU is full.
    nvml.fail["nvmlDeviceCreateGpuInstanceWithPlacement"] = FakeNvmlError(23)
    with pytest.raises(MigCreateError) as err:
        mig.create(GPU, ONE_G, 3)
    assert err.value.reason == "insufficient-resources"
    assert "no room left" not in str(err.value) and "counts room for 7 more" in str(err.value)


def test_a_placement_the_profile_does_not_offer_is_refused_without_asking_nvml(
        nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    with pytest.raises(MigCreateError, match=r"not one of the profile's placements \(0, 4\)") as err:
        mig.create(GPU, THREE_G, 2)
    assert err.value.reason == "invalid"
    assert called(nvml, "nvmlDeviceCreateGpuInstanceWithPlacement") == []


def test_nvml_invalid_argument_is_invalid(nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    unchecked = THREE_G.model_copy(update={"placement_starts": ()})  # NVML is the judge
    with pytest.raises(MigCreateError, match="error 2") as err:
        mig.create(GPU, unchecked, 2)
    assert err.value.reason == "invalid"


def test_mig_off_is_not_mig_mode_and_an_unknown_profile_with_mig_on_is_invalid(
        nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    with pytest.raises(MigCreateError, match="MIG mode is not enabled") as off:
        mig.create(OTHER_GPU, ONE_G, 0)
    assert off.value.reason == "not-mig-mode"
    foreign = ONE_G.model_copy(update={"gi_profile_id": 42})
    with pytest.raises(MigCreateError) as unknown:
        mig.create(GPU, foreign, 0)
    assert unknown.value.reason == "invalid"


def test_other_nvml_errors_fail_with_the_code_and_a_hint(nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    nvml.fail["nvmlDeviceCreateGpuInstanceWithPlacement"] = FakeNvmlError(4)
    with pytest.raises(MigCreateError, match=r"error 4: Insufficient Permissions\); creating MIG devices needs root"
                       ) as err:
        mig.create(GPU, ONE_G, 0)
    assert err.value.reason == "failed"
    with pytest.raises(MigCreateError, match="error 6: Not Found") as gone:
        mig.create("GPU-00000000-0000-0000-0000-000000000000", ONE_G, 0)
    assert gone.value.reason == "failed"
    with pytest.raises(MigCreateError, match="not a whole GPU"):
        mig.create("MIG-11111111-2222-3333-4444-555555555555", ONE_G, 0)
    with pytest.raises(MigError, match="not a whole GPU"):
        mig.instances("MIG-11111111-2222-3333-4444-555555555555")


def test_no_nvml_call_once_the_deadline_passed(nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    with pytest.raises(MigCreateError, match="no time left") as err:
        mig.create(GPU, ONE_G, 0, Deadline.after(0))
    assert err.value.reason == "failed"
    assert nvml.calls == []


def test_a_hung_create_is_bounded_and_what_it_made_late_is_destroyed(nvml: FakeNvml) -> None:
    nvml.block = threading.Event()
    mig = NvmlMigPartitioner(nvml, timeout=0.2)
    with pytest.raises(MigCreateError, match=r"NVML did not return from create MIG 1g\.10gb") as err:
        mig.create(GPU, ONE_G, 0)
    assert err.value.reason == "failed"
    with pytest.raises(MigError, match="not tried"):
        mig.instances(GPU, Deadline.after(30))  # this GPU is fenced while the call hangs
    [stuck] = [t for t in threading.enumerate() if t.name == f"nvml-mig {GPU}"]
    nvml.block.set()
    stuck.join(timeout=30)
    # The create finished after its caller gave up: nobody records it, so it was destroyed again.
    assert nvml.gpus[GPU].gis == {}
    assert mig.instances(GPU) == []


# ----------------------------------------------------------------------------------------------- destroy


def test_destroy_takes_the_ci_then_the_gi(nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    created = mig.create(GPU, ONE_G, 5)
    nvml.calls.clear()
    mig.destroy(GPU, created.gi_id, created.ci_id)
    assert [c[0] for c in nvml.calls if c[0].endswith("Destroy")] == ["nvmlComputeInstanceDestroy",
                                                                      "nvmlGpuInstanceDestroy"]
    assert nvml.gpus[GPU].gis == {}


def test_destroying_what_is_gone_or_on_a_gpu_with_mig_off_is_done(nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    mig.destroy(GPU, 7, 0)  # no such GI: NOT_FOUND
    mig.destroy(OTHER_GPU, 1, 0)  # MIG off: NOT_SUPPORTED
    created = mig.create(GPU, ONE_G, 0)
    del nvml.gpus[GPU].gis[created.gi_id].cis[0]  # the CI went (another tool), the GI stayed
    mig.destroy(GPU, created.gi_id, created.ci_id)
    assert nvml.gpus[GPU].gis == {}


def test_a_gi_still_in_use_is_an_error_naming_it(nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    created = mig.create(GPU, ONE_G, 0)
    with pytest.raises(MigError, match=r"destroying GI 1 failed: NVML error 19.*still use it"):
        mig.destroy(GPU, created.gi_id, None)  # its CI is left inside
    assert created.gi_id in nvml.gpus[GPU].gis


# ----------------------------------------------------------------------------------------------- listing


def test_instances_lists_every_mig_device_by_placement(nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    b = mig.create(GPU, THREE_G, 4)
    a = mig.create(GPU, ONE_G, 0)
    assert mig.instances(GPU) == [a, b]
    assert mig.instances(OTHER_GPU) == []  # MIG off: none
    # A GI holding two CIs (made by another tool) lists both.
    nvml.gpus[GPU].gis[b.gi_id].cis[1] = 0 + CI_ID_OFFSET
    assert [(m.gi_id, m.ci_id) for m in mig.instances(GPU)] == [(a.gi_id, 0), (b.gi_id, 0), (b.gi_id, 1)]


def test_close_ends_only_its_own_session(nvml: FakeNvml, mig: NvmlMigPartitioner) -> None:
    mig.close()  # never opened: nothing to end
    assert nvml.inits == 0
    mig.instances(GPU)
    assert nvml.inits == 1
    mig.close()
    assert nvml.inits == 0
