"""MIG devices created and destroyed through NVML in the driver's own process (dynamic MIG).

Create (nvidia-gpu reference 3.5, 3.10): ``nvmlDeviceCreateGpuInstanceWithPlacement(h, profileId,
byref(placement))``, then the compute-instance profile spanning the GI
(``nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, ciEnum, ENGINE_PROFILE_SHARED)``) and
``nvmlGpuInstanceCreateComputeInstance(gi, cip.id)``; the MIG UUID from the CI's info (``.device``), not from a
walk over all MIG handles, which NVIDIA saw take ~10 s under load. A failure after the GI exists destroys what
was made (CI, then GI) before the error is raised. Destroy: CI first, then GI; NOT_FOUND (gone) and, for the
GI lookup, NOT_SUPPORTED (MIG off) count as done, as in NVIDIA's driver.

Each public call runs as one unit through :class:`~driver.gpu.runtime.nvmlbounded.BoundedNvml`, bounded by
``timeout`` and the caller's deadline. A create that returns after its caller stopped waiting destroys what it
made, so no MIG device is left that no claim records.

pynvml sets no ctypes ``argtypes``: structures go by ``ctypes.byref``, and list calls fill arrays the caller
allocates (``nvmlDeviceGetGpuInstances``, ``nvmlGpuInstanceGetComputeInstances``), sized by the profile's
``instanceCount``.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from typing import Any, TypeVar

from driver.gpu.discovery.inventory import MigProfileInfo
from driver.gpu.discovery.nvmlvalues import as_text
from driver.gpu.runtime.mig import (
    NVML_ERROR_IN_USE,
    NVML_ERROR_INSUFFICIENT_RESOURCES,
    NVML_ERROR_NO_PERMISSION,
    NVML_ERROR_NOT_FOUND,
    NVML_ERROR_NOT_SUPPORTED,
    CreatedMig,
    MigCreateError,
    MigError,
    MigGpuInstance,
    create_refusal_reason,
    describe_refusal,
    overlaps,
)
from driver.gpu.runtime.nvmlbounded import BoundedNvml, NvmlCallError, no_library_to_load
from driver.kubeletplugin.types import Deadline

log = logging.getLogger(__name__)

T = TypeVar("T")

# Loop bounds for profile enumeration, as migscan's: the highest enums nvml.h knows, whatever pynvml says.
_GI_PROFILE_COUNT_KNOWN = 0x12
_CI_PROFILE_COUNT_KNOWN = 9
_MIN_ARRAY = 8  # no GPU has more MIG instances of one profile than memory slices (8)


@dataclass(frozen=True)
class _Profile:
    id: int
    instance_count: int


def _handles(element: Any, list_call: Callable[[Any, int, Any, Any], Any], parent: Any, profile: _Profile) -> list[Any]:
    """The handles a list call writes into an array it is given (pynvml leaves allocating it to the caller)."""
    count = ctypes.c_uint(max(profile.instance_count, _MIN_ARRAY))
    array = (element * count.value)()
    list_call(parent, profile.id, array, ctypes.byref(count))
    return [array[i] for i in range(count.value)]


def _code(err: BaseException) -> int | None:
    value = getattr(err, "value", None)
    return value if isinstance(value, int) else None


class NvmlMigPartitioner:
    """:class:`~driver.gpu.runtime.mig.MigPartitioner` through pynvml (or a double with its names).

    ``load_library`` makes the driver root's ``libnvidia-ml.so.1`` loadable before the first ``nvmlInit``;
    ``timeout`` bounds one operation (a create is several NVML calls; ``nvmlGpuInstanceDestroy`` alone can take
    about 1 s, reference 3.10), shortened by the caller's deadline.
    """

    def __init__(self, nvml: Any, load_library: Callable[[], None] = no_library_to_load,
                 timeout: float = 30.0) -> None:
        self._nvml = nvml
        self.timeout = timeout
        self._calls = BoundedNvml(nvml, "create or destroy MIG devices", "nvml-mig", load_library)
        # GPU UUID -> its GI profiles (ids are device specific but fixed), found once.
        self._gi_profiles: dict[str, list[_Profile]] = {}

    def close(self) -> None:
        self._calls.close()

    # ------------------------------------------------------------------------------------------ the protocol

    def create(self, gpu_uuid: str, profile: MigProfileInfo, placement_start: int,
               deadline: Deadline | None = None) -> CreatedMig:
        what = f"create MIG {profile.name} (GI profile {profile.gi_profile_id}) at placement {placement_start}"
        if profile.placement_starts and placement_start not in profile.placement_starts:
            starts = ", ".join(str(s) for s in profile.placement_starts)
            raise MigCreateError("invalid", f"{what} on {gpu_uuid}: not one of the profile's placements ({starts})")
        created = self._run(gpu_uuid, what, deadline, lambda: self._create(gpu_uuid, profile, placement_start, what),
                            on_late_result=lambda mig: self._undo_late_create(gpu_uuid, mig), error=MigCreateError)
        log.info("MIG device created", extra={"gpu_uuid": gpu_uuid, "mig_uuid": created.uuid,
                                              "profile": profile.name, "placement_start": placement_start,
                                              "gi_id": created.gi_id, "ci_id": created.ci_id})
        return created

    def destroy(self, gpu_uuid: str, gi_id: int, ci_id: int | None, deadline: Deadline | None = None) -> None:
        what = f"destroy MIG GI {gi_id}" + (f" CI {ci_id}" if ci_id is not None else "")
        self._run(gpu_uuid, what, deadline, lambda: self._destroy(gpu_uuid, gi_id, ci_id, what))

    def instances(self, gpu_uuid: str, deadline: Deadline | None = None) -> list[CreatedMig]:
        found = self._run(gpu_uuid, "list MIG devices", deadline, lambda: self._list(gpu_uuid))
        return sorted((m for m in found if isinstance(m, CreatedMig)), key=lambda m: (m.placement_start, m.ci_id))

    def bare_gpu_instances(self, gpu_uuid: str, deadline: Deadline | None = None) -> list[MigGpuInstance]:
        found = self._run(gpu_uuid, "list MIG GPU instances", deadline, lambda: self._list(gpu_uuid))
        return sorted((m for m in found if not isinstance(m, CreatedMig)), key=lambda m: m.placement_start)

    # ------------------------------------------------------------------------------------------ bounded runs

    def _run(self, gpu_uuid: str, what: str, deadline: Deadline | None, work: Callable[[], T],
             on_late_result: Callable[[T], None] | None = None, error: type[MigError] = MigError) -> T:
        """``work`` bounded in time; every failure a ``error`` (a create's: reason ``failed``) naming ``what``."""

        def failure(message: str) -> MigError:
            return MigCreateError("failed", message) if error is MigCreateError else MigError(message)

        if not gpu_uuid.startswith("GPU-"):
            raise failure(f"{what}: {gpu_uuid} is not a whole GPU (GPU-... UUID)")
        timeout = self.timeout if deadline is None else deadline.bound(self.timeout)
        try:
            return self._calls.run(gpu_uuid, what, work, timeout, on_late_result)
        except NvmlCallError as exc:
            raise failure(str(exc)) from exc
        except MigError:
            raise
        except self._nvml.NVMLError as err:
            raise failure(f"{what} on {gpu_uuid}: NVML error {_code(err)}: {err}") from err

    def _undo_late_create(self, gpu_uuid: str, mig: CreatedMig) -> None:
        """Runs on the worker thread of a create whose caller gave up: nobody will record this device."""
        log.warning("a MIG create returned after its caller gave up; destroying what it made",
                    extra={"gpu_uuid": gpu_uuid, "mig_uuid": mig.uuid, "gi_id": mig.gi_id, "ci_id": mig.ci_id})
        try:
            self._destroy(gpu_uuid, mig.gi_id, mig.ci_id, "destroy a MIG device created too late")
        except (MigError, self._nvml.NVMLError) as exc:
            log.error("a MIG device created too late could not be destroyed; it holds its slices until removed",
                      extra={"gpu_uuid": gpu_uuid, "mig_uuid": mig.uuid, "error": str(exc)})

    # ------------------------------------------------------------------------------------------ NVML work

    def _create(self, gpu_uuid: str, profile: MigProfileInfo, start: int, what: str) -> CreatedMig:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
        placement = nvml.c_nvmlGpuInstancePlacement_t()
        placement.start = start
        placement.size = profile.memory_slices
        try:
            gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(handle, profile.gi_profile_id, ctypes.byref(placement))
        except nvml.NVMLError as err:
            raise self._refusal(gpu_uuid, handle, profile, start, what, err) from err
        ci = None
        try:
            cip = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, profile.ci_profile_id, getattr(nvml, "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED", 0))
            ci = nvml.nvmlGpuInstanceCreateComputeInstance(gi, int(cip.id))
            ci_info = nvml.nvmlComputeInstanceGetInfo(ci)
            uuid = as_text(nvml.nvmlDeviceGetUUID(ci_info.device))
            gi_info = nvml.nvmlGpuInstanceGetInfo(gi)
            return CreatedMig(uuid=uuid, gi_id=int(gi_info.id), ci_id=int(ci_info.id),
                              gi_profile_id=profile.gi_profile_id, placement_start=int(gi_info.placement.start),
                              placement_size=int(gi_info.placement.size))
        except BaseException as exc:
            left = self._undo(gi, ci)
            detail = f"NVML error {_code(exc)}: {exc}" if isinstance(exc, nvml.NVMLError) else repr(exc)
            raise MigCreateError("failed", f"{what} on {gpu_uuid}: the GPU instance was made, then {detail}; "
                                           f"{left}") from exc

    def _undo(self, gi: Any, ci: Any) -> str:
        """Destroy a half-made device (CI, then GI); what is left, for the error message."""
        nvml = self._nvml
        if ci is not None:
            with suppress(nvml.NVMLError):
                nvml.nvmlComputeInstanceDestroy(ci)
        try:
            nvml.nvmlGpuInstanceDestroy(gi)
        except nvml.NVMLError as err:
            return (f"destroying the GPU instance again failed too (NVML error {_code(err)}: {err}): it holds its "
                    "memory slices until removed (bare_gpu_instances lists it)")
        return "it was destroyed again"

    def _refusal(self, gpu_uuid: str, handle: Any, profile: MigProfileInfo, start: int, what: str,
                 err: BaseException) -> MigCreateError:
        code = _code(err)
        mig_enabled = self._mig_enabled(handle) if code == NVML_ERROR_NOT_SUPPORTED else None
        capacity_left: int | None = None
        overlapping: list[MigGpuInstance] = []
        if code == NVML_ERROR_INSUFFICIENT_RESOURCES:
            # Best effort: the state only sharpens the reason; NVML's code stands if it cannot be read.
            with suppress(self._nvml.NVMLError, AttributeError):
                capacity_left = int(self._nvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, profile.gi_profile_id))
            with suppress(self._nvml.NVMLError, AttributeError):
                overlapping = overlaps(start, profile.memory_slices, self._list_gis(handle, gpu_uuid))
        reason = create_refusal_reason(code, mig_enabled, capacity_left, bool(overlapping))
        detail = describe_refusal(reason)
        if reason == "occupied":
            taken = ", ".join(f"GI {g.gi_id} at {g.placement_start}:{g.placement_size}" for g in overlapping)
            detail += f" ({taken})"
        elif reason == "insufficient-resources" and capacity_left is not None:
            # Say what the state showed: NVML's code alone does not tell "used up" from the unexplained.
            detail += (": no room left for another instance of this profile" if capacity_left == 0 else
                       f", though it counts room for {capacity_left} more of this profile and no instance overlaps "
                       "the placement")
        hint = "; creating MIG devices needs root" if code == NVML_ERROR_NO_PERMISSION else ""
        return MigCreateError(reason, f"{what} on {gpu_uuid} refused: {detail} (NVML error {code}: {err}){hint}")

    def _mig_enabled(self, handle: Any) -> bool | None:
        nvml = self._nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError_NotSupported:
            return False  # how NVML says a GPU has no MIG
        except nvml.NVMLError:
            return None
        return int(current) == int(getattr(nvml, "NVML_DEVICE_MIG_ENABLE", 1))

    def _destroy(self, gpu_uuid: str, gi_id: int, ci_id: int | None, what: str) -> None:
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
        try:
            gi = nvml.nvmlDeviceGetGpuInstanceById(handle, gi_id)
        except nvml.NVMLError as err:
            if _code(err) in (NVML_ERROR_NOT_FOUND, NVML_ERROR_NOT_SUPPORTED):  # gone, or MIG off: nothing left
                return
            raise MigError(f"{what} on {gpu_uuid}: NVML error {_code(err)}: {err}") from err
        if ci_id is not None:
            try:
                nvml.nvmlComputeInstanceDestroy(nvml.nvmlGpuInstanceGetComputeInstanceById(gi, ci_id))
            except nvml.NVMLError as err:
                if _code(err) != NVML_ERROR_NOT_FOUND:
                    raise MigError(f"{what} on {gpu_uuid}: destroying CI {ci_id} failed: NVML error "
                                   f"{_code(err)}: {err}{self._in_use_hint(err)}") from err
        try:
            nvml.nvmlGpuInstanceDestroy(gi)
        except nvml.NVMLError as err:
            if _code(err) != NVML_ERROR_NOT_FOUND:
                raise MigError(f"{what} on {gpu_uuid}: destroying GI {gi_id} failed: NVML error {_code(err)}: "
                               f"{err}{self._in_use_hint(err)}") from err

    @staticmethod
    def _in_use_hint(err: BaseException) -> str:
        return "; processes or other compute instances still use it" if _code(err) == NVML_ERROR_IN_USE else ""

    # ------------------------------------------------------------------------------------------ listing

    def _list(self, gpu_uuid: str) -> list[MigGpuInstance]:
        """Every GI on the GPU: a CreatedMig per CI, a bare MigGpuInstance for a GI without one."""
        nvml = self._nvml
        handle = nvml.nvmlDeviceGetHandleByUUID(gpu_uuid)
        found: list[MigGpuInstance] = []
        ci_profiles: dict[int, list[_Profile]] = {}  # GI profile id -> the CI profiles inside such a GI
        for gi in self._gi_handles(handle, gpu_uuid):
            info = nvml.nvmlGpuInstanceGetInfo(gi)
            bare = MigGpuInstance(gi_id=int(info.id), gi_profile_id=int(info.profileId),
                                  placement_start=int(info.placement.start), placement_size=int(info.placement.size))
            if bare.gi_profile_id not in ci_profiles:
                ci_profiles[bare.gi_profile_id] = self._ci_profiles(gi)
            cis = [ci for p in ci_profiles[bare.gi_profile_id]
                   for ci in _handles(nvml.c_nvmlComputeInstance_t, nvml.nvmlGpuInstanceGetComputeInstances, gi, p)]
            if not cis:
                found.append(bare)
            for ci in cis:
                ci_info = nvml.nvmlComputeInstanceGetInfo(ci)
                found.append(CreatedMig(**bare.model_dump(), uuid=as_text(nvml.nvmlDeviceGetUUID(ci_info.device)),
                                        ci_id=int(ci_info.id)))
        return found

    def _list_gis(self, handle: Any, gpu_uuid: str) -> list[MigGpuInstance]:
        return [MigGpuInstance(gi_id=int(info.id), gi_profile_id=int(info.profileId),
                               placement_start=int(info.placement.start), placement_size=int(info.placement.size))
                for info in map(self._nvml.nvmlGpuInstanceGetInfo, self._gi_handles(handle, gpu_uuid))]

    def _gi_handles(self, handle: Any, gpu_uuid: str) -> list[Any]:
        nvml = self._nvml
        try:
            return [gi for p in self._gpu_instance_profiles(handle, gpu_uuid)
                    for gi in _handles(nvml.c_nvmlGpuInstance_t, nvml.nvmlDeviceGetGpuInstances, handle, p)]
        except nvml.NVMLError as err:
            if _code(err) == NVML_ERROR_NOT_SUPPORTED:
                return []  # MIG is off: there are no GPU instances
            raise

    def _gpu_instance_profiles(self, handle: Any, gpu_uuid: str) -> list[_Profile]:
        if gpu_uuid in self._gi_profiles:
            return self._gi_profiles[gpu_uuid]
        nvml = self._nvml
        count = max(int(getattr(nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", 0)), _GI_PROFILE_COUNT_KNOWN)
        profiles: dict[int, _Profile] = {}
        for enum in range(count):
            try:
                info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(handle, enum, version=1)
            except nvml.NVMLError:
                continue  # not on this GPU (or MIG off): nothing of it can exist
            profiles.setdefault(int(info.id), _Profile(int(info.id), int(info.instanceCount)))
        found = sorted(profiles.values(), key=lambda p: p.id)
        if found:  # MIG off lists none; ask again once it may be on
            self._gi_profiles[gpu_uuid] = found
        return found

    def _ci_profiles(self, gi: Any) -> list[_Profile]:
        nvml = self._nvml
        count = max(int(getattr(nvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", 0)), _CI_PROFILE_COUNT_KNOWN)
        shared = getattr(nvml, "NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED", 0)
        profiles: dict[int, _Profile] = {}
        for enum in range(count):
            try:
                info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(gi, enum, shared)
            except nvml.NVMLError:
                continue
            profiles.setdefault(int(info.id), _Profile(int(info.id), int(info.instanceCount)))
        return list(profiles.values())
