"""The MIG devices of one GPU, read through NVML: GPU-instance and compute-instance profiles, placements.

Profile names come from ``migprofiles.profile_name`` (go-nvlib's rule), so they match what
NVIDIA's tools print; NVML's own profile name is only a fallback. A MIG device NVML cannot fully
describe is skipped with a warning rather than published with wrong capacities.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from driver.gpu.discovery.inventory import MigInstance
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


@dataclass(frozen=True)
class _GiProfile:
    """One GPU-instance profile of one GPU, keyed by its device-specific id."""

    enum: int
    slice_count: int
    memory_mib: int
    multiprocessors: int
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    nvml_name: str | None  # only the v2 struct has it; a fallback when the name cannot be computed


@dataclass(frozen=True)
class _CiShape:
    slice_count: int
    multiprocessors: int


class MigScan:
    """The MIG devices of one GPU. Lookups are cached for the duration of one discover()."""

    def __init__(self, nvml: Any, gpu_index: int, handle: Any, total_memory_bytes: int | None) -> None:
        self._nvml = nvml
        self._gpu_index = gpu_index
        self._handle = handle
        self._total_memory_bytes = total_memory_bytes
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
            copy_engines=profile.copy_engines,
            decoders=profile.decoders,
            encoders=profile.encoders,
            jpeg_engines=profile.jpeg_engines,
            ofa_engines=profile.ofa_engines,
        )

    def _profile_name(self, profile: _GiProfile, ci_slices: int) -> str | None:
        if self._total_memory_bytes is not None and profile.memory_mib > 0:
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
                    copy_engines=int(info.copyEngineCount),
                    decoders=int(info.decoderCount),
                    encoders=int(info.encoderCount),
                    jpeg_engines=int(info.jpegCount),
                    ofa_engines=int(info.ofaCount),
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
