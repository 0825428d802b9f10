"""The MIG devices of one GPU, read through NVML: GPU-instance and compute-instance profiles, placements.

Profile names come from ``migprofiles.profile_name`` (go-nvlib's rule), so they match what
NVIDIA's tools print; NVML's own profile name is only a fallback. A MIG device NVML cannot fully
describe is skipped with a warning rather than published with wrong capacities.

For dynamic MIG, :meth:`MigScan.profiles` also lists what the GPU can create: each GPU-instance profile
with its possible placements (``nvmlDeviceGetGpuInstancePossiblePlacements_v2``, which "returns all the
possible placements for the given profile regardless of whether MIG is enabled"; a NULL array asks for
the count only, nvml.h). A profile NVML will not describe or place is left out, logged once per GPU.
"""

from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

from driver.gpu.discovery.inventory import MigEngines, MigInstance, MigProfileInfo
from driver.gpu.discovery.migprofiles import profile_name
from driver.gpu.discovery.nvmlvalues import as_text
from driver.units import MIB

log = logging.getLogger(__name__)

# Loop bounds for profile enumeration: at least the highest profile enum known (nvml.h / pynvml
# 13.615: GI 0x12, CI 9), whatever the installed pynvml says. nvidia-ml-py 12.560 has a GI COUNT of
# 0xA, and looping to it would drop the +gfx, -me and +me.all profiles (0xA-0x11) the driver offers.
# An enum the driver does not know answers InvalidArgument/NotSupported and is skipped.
_GI_PROFILE_COUNT_KNOWN = 0x12
_CI_PROFILE_COUNT_KNOWN = 9
# NVML_COMPUTE_INSTANCE_PROFILE_<n>_SLICE by n (nvml.h; reference 3.2): the CI that spans a GI of n slices.
# Without a GPU instance NVML cannot be asked for CI profiles, so dynamic MIG names the enum by slice count,
# as NVIDIA's DynamicMIG does (it never uses 1_SLICE_REV1 or 7_SLICE_NVL for a whole-GI CI).
CI_PROFILE_ENUM_BY_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4, 8: 5, 6: 6}


@dataclass(frozen=True)
class _GiProfile:
    """One GPU-instance profile of one GPU, keyed by its device-specific id."""

    enum: int
    slice_count: int
    memory_mib: int
    multiprocessors: int
    engines: MigEngines
    nvml_name: str | None  # only the v2 struct has it; a fallback when the name cannot be computed


@dataclass(frozen=True)
class _CiShape:
    slice_count: int
    multiprocessors: int


class MigScan:
    """The MIG devices of one GPU. Lookups are cached for the duration of one discover()."""

    def __init__(self, nvml: Any, gpu_index: int, handle: Any, total_memory_bytes: int | None,
                 gpu_uuid: str = "", logged: set[tuple[str, ...]] | None = None) -> None:
        self._nvml = nvml
        self._gpu_index = gpu_index
        self._gpu_uuid = gpu_uuid
        self._handle = handle
        self._total_memory_bytes = total_memory_bytes
        # (GPU UUID, what, detail) already logged: the caller keeps it across discover() calls, so a GPU
        # that always refuses one query is logged once, not at every rescan.
        self._logged: set[tuple[str, ...]] = set() if logged is None else logged
        self._gpu_instances: dict[int, Any] = {}
        self._ci_shapes: dict[int, dict[int, _CiShape]] = {}
        self._gi_profiles = self._enumerate_gi_profiles()

    def instances(self) -> tuple[MigInstance, ...]:
        nvml = self._nvml
        try:
            slots = int(nvml.nvmlDeviceGetMaxMigDeviceCount(self._handle))
        except nvml.NVMLError as err:
            log.warning("cannot count MIG devices", extra={"gpu_index": self._gpu_index, "error": str(err)})
            return ()
        found: list[MigInstance] = []
        for slot in range(slots):
            try:
                mig_handle = nvml.nvmlDeviceGetMigDeviceHandleByIndex(self._handle, slot)
            except nvml.NVMLError_NotFound:
                continue  # an empty slot
            except nvml.NVMLError as err:
                log.warning(
                    "cannot open MIG device", extra={"gpu_index": self._gpu_index, "slot": slot, "error": str(err)}
                )
                continue
            instance = self._instance(slot, mig_handle)
            if instance is not None:
                found.append(instance)
        return tuple(sorted(found, key=lambda m: (m.placement_start, m.ci_id)))

    def profiles(self) -> tuple[MigProfileInfo, ...]:
        """Every GPU-instance profile this GPU can create, with its placements, by GI profile id."""
        found: list[MigProfileInfo] = []
        for gi_profile_id, profile in sorted(self._gi_profiles.items()):
            info = self._profile_info(gi_profile_id, profile)
            if info is not None:
                found.append(info)
        return tuple(found)

    def _profile_info(self, gi_profile_id: int, profile: _GiProfile) -> MigProfileInfo | None:
        ci_enum = CI_PROFILE_ENUM_BY_SLICES.get(profile.slice_count)
        name = self._profile_name(profile, profile.slice_count)
        if ci_enum is None or name is None:
            self._log_once("skipping a MIG profile that cannot be named or has no whole-GI compute instance",
                           "profile", str(gi_profile_id), slices=profile.slice_count)
            return None
        placements = self._placements(gi_profile_id)
        if not placements:
            return None
        sizes = {size for _start, size in placements}
        if len(sizes) != 1:
            self._log_once("skipping a MIG profile whose placements differ in size", "placement sizes",
                           str(gi_profile_id), sizes=sorted(sizes))
            return None
        return MigProfileInfo(
            name=name,
            gi_profile_id=gi_profile_id,
            ci_profile_id=ci_enum,
            compute_slices=profile.slice_count,
            memory_slices=sizes.pop(),
            **profile.engines.model_dump(),
            memory_bytes=profile.memory_mib * MIB,
            multiprocessors=profile.multiprocessors,
            placement_starts=tuple(sorted(start for start, _size in placements)),
        )

    def _placements(self, gi_profile_id: int) -> list[tuple[int, int]]:
        """(start, size) of each possible placement; empty (logged once) if NVML cannot list them."""
        nvml = self._nvml
        try:
            count = ctypes.c_uint(0)
            nvml.nvmlDeviceGetGpuInstancePossiblePlacements(self._handle, gi_profile_id, None, ctypes.byref(count))
            array = (nvml.c_nvmlGpuInstancePlacement_t * count.value)()
            nvml.nvmlDeviceGetGpuInstancePossiblePlacements(self._handle, gi_profile_id, array, ctypes.byref(count))
            return [(int(p.start), int(p.size)) for p in array[: count.value]]
        # AttributeError: a pynvml too old to have the function at all.
        except (nvml.NVMLError, AttributeError) as err:
            self._log_once("MIG placements unavailable; leaving the profile out", "placements",
                           str(gi_profile_id), error=str(err))
            return []

    def _log_once(self, message: str, what: str, detail: str, **extra: Any) -> None:
        key = (self._gpu_uuid or str(self._gpu_index), what, detail)
        if key in self._logged:
            return
        self._logged.add(key)
        log.warning(message, extra={"gpu_index": self._gpu_index, "gpu_uuid": self._gpu_uuid,
                                    "gi_profile_id": detail, **extra})

    def _instance(self, slot: int, mig_handle: Any) -> MigInstance | None:
        nvml = self._nvml
        context = {"gpu_index": self._gpu_index, "slot": slot}
        try:
            uuid = as_text(nvml.nvmlDeviceGetUUID(mig_handle))
            gi_id = int(nvml.nvmlDeviceGetGpuInstanceId(mig_handle))
            ci_id = int(nvml.nvmlDeviceGetComputeInstanceId(mig_handle))
            gpu_instance = self._gpu_instance(gi_id)
            gi_info = nvml.nvmlGpuInstanceGetInfo(gpu_instance)
        except nvml.NVMLError as err:
            log.warning("skipping a MIG device NVML cannot describe", extra={**context, "error": str(err)})
            return None
        gi_profile_id = int(gi_info.profileId)
        profile = self._gi_profiles.get(gi_profile_id)
        if profile is None:
            log.warning(
                "skipping a MIG device of an unknown profile", extra={**context, "gi_profile_id": gi_profile_id}
            )
            return None
        ci_shape = self._ci_shape(gpu_instance, gi_profile_id, profile, ci_id)
        name = self._profile_name(profile, ci_shape.slice_count)
        if name is None:
            log.warning("skipping a MIG device whose profile cannot be named", extra={**context, "mig_uuid": uuid})
            return None
        return MigInstance(
            uuid=uuid,
            profile=name,
            gi_profile_id=gi_profile_id,
            placement_start=int(gi_info.placement.start),
            placement_size=int(gi_info.placement.size),
            gi_id=gi_id,
            ci_id=ci_id,
            memory_bytes=profile.memory_mib * MIB,
            multiprocessors=ci_shape.multiprocessors,
            **profile.engines.model_dump(),
        )

    def _profile_name(self, profile: _GiProfile, ci_slices: int) -> str | None:
        # A GPU reporting no memory (None, or 0) cannot scale the name: NVML's own is all there is.
        if self._total_memory_bytes and profile.memory_mib > 0:
            return profile_name(
                ci_slices, profile.slice_count, profile.memory_mib, self._total_memory_bytes, profile.enum
            )
        if profile.nvml_name:
            return profile.nvml_name.removeprefix("MIG ").strip() or None
        return None

    def _gpu_instance(self, gi_id: int) -> Any:
        if gi_id not in self._gpu_instances:
            self._gpu_instances[gi_id] = self._nvml.nvmlDeviceGetGpuInstanceById(self._handle, gi_id)
        return self._gpu_instances[gi_id]

    def _enumerate_gi_profiles(self) -> dict[int, _GiProfile]:
        count = max(int(getattr(self._nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0)), _GI_PROFILE_COUNT_KNOWN)
        profiles: dict[int, _GiProfile] = {}
        for enum in range(count):
            info = self._gi_profile_info(enum)
            if info is None:
                continue
            name = getattr(info, "name", None)  # absent from the v1 struct
            profiles.setdefault(
                int(info.id),
                _GiProfile(
                    enum=enum,
                    slice_count=int(info.sliceCount),
                    memory_mib=int(info.memorySizeMB),
                    multiprocessors=int(info.multiprocessorCount),
                    engines=MigEngines(copy_engines=int(info.copyEngineCount), decoders=int(info.decoderCount),
                                       encoders=int(info.encoderCount), jpeg_engines=int(info.jpegCount),
                                       ofa_engines=int(info.ofaCount)),
                    nvml_name=as_text(name) if name else None,
                ),
            )
        return profiles

    def _gi_profile_info(self, enum: int) -> Any:
        nvml = self._nvml
        for version in (2, 1):
            try:
                return nvml.nvmlDeviceGetGpuInstanceProfileInfo(self._handle, enum, version=version)
            except nvml.NVMLError_FunctionNotFound:
                continue  # a driver without the V variant: try the plain one
            except nvml.NVMLError as err:
                # NotSupported / InvalidArgument: this GPU has no such profile.
                log.debug(
                    "no GPU instance profile", extra={"gpu_index": self._gpu_index, "enum": enum, "error": str(err)}
                )
                return None
        return None

    def _ci_shape(self, gpu_instance: Any, gi_profile_id: int, profile: _GiProfile, ci_id: int) -> _CiShape:
        """The compute instance's slice and SM count; a whole-GI CI is assumed if NVML cannot say."""
        whole = _CiShape(slice_count=profile.slice_count, multiprocessors=profile.multiprocessors)
        nvml = self._nvml
        try:
            ci_profile_id = int(
                nvml.nvmlComputeInstanceGetInfo(
                    nvml.nvmlGpuInstanceGetComputeInstanceById(gpu_instance, ci_id)
                ).profileId
            )
        except nvml.NVMLError as err:
            log.debug("compute instance info unavailable", extra={"gpu_index": self._gpu_index, "error": str(err)})
            return whole
        if gi_profile_id not in self._ci_shapes:
            self._ci_shapes[gi_profile_id] = self._enumerate_ci_profiles(gpu_instance)
        return self._ci_shapes[gi_profile_id].get(ci_profile_id, whole)

    def _enumerate_ci_profiles(self, gpu_instance: Any) -> dict[int, _CiShape]:
        nvml = self._nvml
        count = max(int(getattr(nvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 0)), _CI_PROFILE_COUNT_KNOWN)
        shared = getattr(nvml, "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED", 0)
        shapes: dict[int, _CiShape] = {}
        for enum in range(count):
            try:
                info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gpu_instance, enum, shared)
            except nvml.NVMLError:
                continue  # not offered inside this GPU instance
            shapes.setdefault(
                int(info.id), _CiShape(slice_count=int(info.sliceCount), multiprocessors=int(info.multiprocessorCount))
            )
        return shapes
