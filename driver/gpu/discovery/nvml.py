"""GPU discovery on real hardware through NVML (the ``pynvml`` module of nvidia-ml-py).

One NVML session per :class:`NvmlDiscovery` (opened on first use, ended by ``close``). Every
query that a GPU or driver may not support is optional: NotSupported, FunctionNotFound or any
other NVML error for that query leaves the field None (logged at debug), so a missing feature
becomes a missing attribute, never a crash. Only the identity of a GPU (handle, UUID, minor) is
required; a GPU without it is skipped with a warning.

Mappings of NVML enums to strings follow NVIDIA's own driver, so user CEL selectors keep working:
an unknown brand is ``"Unknown"``; an unknown architecture or addressing mode is None (the
attribute is omitted) because there is no NVIDIA string to match against.

pynvml loads ``libnvidia-ml.so.1`` by soname, which the plugin container's loader cannot find when
the driver is mounted at a driver root. So, with a driver root other than ``/``, the library is
loaded from there first, globally: the loader then hands pynvml's later load by soname the same,
already loaded library.

A whole GPU's SM count does not come from NVML: ``nvmlDeviceGetAttributes`` "currently only
supports MIG device handles" (nvml.h). It comes from CUDA through ``sm_counts`` (by default
:class:`~driver.gpu.discovery.cudarun.CudaSmCounts`, a child process against the driver root's libcuda);
a GPU still without one carries the reason in ``GpuInfo.multiprocessors_missing``, logged once.
"""

from __future__ import annotations

import ctypes
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from driver.gpu.discovery.cudarun import CudaSmCounts, SmCountSource, fill_sm_counts
from driver.gpu.discovery.inventory import GpuInfo, MigInstance, NodeInventory
from driver.gpu.discovery.migprofiles import profile_name
from driver.gpu.runtime.binaries import LIB_DIRS, find_driver_library

log = logging.getLogger(__name__)

T = TypeVar("T")

NVML_LIBRARY = "libnvidia-ml.so.1"

BRAND_NAMES: dict[int, str] = {
    0: "Unknown",
    1: "Quadro",
    2: "Tesla",
    3: "NVS",
    4: "Grid",
    5: "GeForce",
    6: "Titan",
    7: "NvidiaVApps",
    8: "NvidiaVPC",
    9: "NvidiaVCS",
    10: "NvidiaVWS",
    11: "NvidiaCloudGaming",
    12: "QuadroRTX",
    13: "NvidiaRTX",
    14: "Nvidia",
    15: "GeForceRTX",
    16: "TitanRTX",
}

ARCHITECTURE_NAMES: dict[int, str] = {
    2: "Kepler",
    3: "Maxwell",
    4: "Pascal",
    5: "Volta",
    6: "Turing",
    7: "Ampere",
    8: "Ada Lovelace",
    9: "Hopper",
    10: "Blackwell",
    13: "Rubin",
}

ADDRESSING_MODE_NAMES: dict[int, str] = {0: "None", 1: "HMM", 2: "ATS"}

# Loop bounds for profile enumeration when the pynvml in use predates the COUNT constants.
_GI_PROFILE_COUNT_FALLBACK = 0x12
_CI_PROFILE_COUNT_FALLBACK = 9
_MIB = 1 << 20


class NvmlDiscoveryError(RuntimeError):
    """NVML cannot be used at all (not installed, driver not loaded, device count unavailable)."""


def brand_name(code: int) -> str:
    return BRAND_NAMES.get(code, "Unknown")


def architecture_name(code: int) -> str | None:
    return ARCHITECTURE_NAMES.get(code)


def addressing_mode_name(code: int) -> str | None:
    return ADDRESSING_MODE_NAMES.get(code)


def cuda_version_string(version: int) -> str:
    """NVML's integer CUDA driver version → ``major.minor`` (13000 → ``13.0``, 12040 → ``12.4``)."""
    return f"{version // 1000}.{(version % 1000) // 10}"


def as_text(value: str | bytes) -> str:
    """pynvml returns str from string functions but bytes from struct char arrays."""
    return value.decode(errors="replace") if isinstance(value, bytes) else value


_BUS_ID = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


def normalise_pci_bus_id(raw: str | bytes) -> str | None:
    """NVML's ``00000000:3B:00.0`` → ``0000:3b:00.0`` (the well-known attribute's form); None if unparsable."""
    match = _BUS_ID.match(as_text(raw).strip().rstrip("\x00"))
    if match is None:
        return None
    domain = int(match[1], 16)
    if domain > 0xFFFF:
        return None
    return f"{domain:04x}:{match[2].lower()}:{match[3].lower()}.{match[4]}"


_PCI_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")


def pcie_root_from_link(link_target: str) -> str | None:
    """The root complex (``pci0000:3a``) in a ``/sys/bus/pci/devices/<bdf>`` link target, if there is one."""
    return next((part for part in Path(link_target).parts if _PCI_ROOT.match(part)), None)


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


class _MigScan:
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
            memory_bytes=profile.memory_mib * _MIB,
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
        count = getattr(self._nvml, "NVML_GPU_INSTANCE_PROFILE_COUNT", _GI_PROFILE_COUNT_FALLBACK)
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
        count = getattr(nvml, "NVML_COMPUTE_INSTANCE_PROFILE_COUNT", _CI_PROFILE_COUNT_FALLBACK)
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


def load_library_globally(path: Path) -> None:
    """dlopen ``path`` with RTLD_GLOBAL, so a later dlopen of its soname finds it loaded."""
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


class NvmlDiscovery:
    """:class:`~driver.gpu.discovery.inventory.Discovery` backed by NVML.

    ``nvml`` is the pynvml module (tests pass a fake with the same names); ``sysfs_root`` is where
    ``/sys`` is mounted, for the PCIe root lookup; ``driver_root`` is where the NVIDIA driver is
    mounted, whose ``libnvidia-ml.so.1`` is loaded with ``load_library`` before NVML starts;
    ``sm_counts`` supplies whole GPUs' SM counts (default: CUDA under the driver root).
    """

    def __init__(
        self,
        nvml: Any = None,
        sysfs_root: Path = Path("/sys"),
        driver_root: Path = Path("/"),
        load_library: Callable[[Path], None] = load_library_globally,
        sm_counts: SmCountSource | None = None,
    ) -> None:
        if nvml is None:
            import pynvml

            nvml = pynvml
        self._nvml = nvml
        self._sysfs_root = sysfs_root
        self._driver_root = driver_root
        self._load_library = load_library
        self._library_loaded = False
        self._initialised = False
        self._sm_counts: SmCountSource = sm_counts if sm_counts is not None else CudaSmCounts(driver_root)
        self._sm_gaps_logged: set[tuple[str, str]] = set()

    def close(self) -> None:
        if not self._initialised:
            return
        self._initialised = False
        try:
            self._nvml.nvmlShutdown()
        except self._nvml.NVMLError as err:
            log.warning("NVML shutdown failed", extra={"error": str(err)})

    def discover(self) -> NodeInventory:
        self._ensure_initialised()
        nvml = self._nvml
        driver_version = self._optional("driver version", None, lambda: as_text(nvml.nvmlSystemGetDriverVersion()))
        cuda_version = self._optional(
            "CUDA driver version", None, lambda: cuda_version_string(int(nvml.nvmlSystemGetCudaDriverVersion()))
        )
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except nvml.NVMLError as err:
            raise NvmlDiscoveryError(f"NVML cannot count GPUs ({err}); is the NVIDIA driver loaded?") from err
        gpus = [gpu for gpu in (self._gpu(index) for index in range(count)) if gpu is not None]
        gpus = fill_sm_counts(gpus, self._sm_counts, self._sm_gaps_logged)
        return NodeInventory(driver_version=driver_version, cuda_driver_version=cuda_version, gpus=tuple(gpus))

    def _ensure_initialised(self) -> None:
        if self._initialised:
            return
        self._load_library_from_driver_root()
        nvml = self._nvml
        try:
            # NO_GPUS: a node whose GPUs are all gone (or not yet bound) still initialises.
            nvml.nvmlInitWithFlags(nvml.NVML_INIT_FLAG_NO_GPUS)
        except nvml.NVMLError as err:
            raise NvmlDiscoveryError(
                f"NVML initialisation failed ({err}); is the NVIDIA driver installed, loaded, and "
                "libnvidia-ml.so visible to this process (driver root mounted)?"
            ) from err
        self._initialised = True

    def _load_library_from_driver_root(self) -> None:
        root = self._driver_root
        if self._library_loaded or root.resolve() == Path("/"):
            return
        path = find_driver_library(root, NVML_LIBRARY)
        if path is None:
            looked_in = ", ".join(str(root / lib_dir) for lib_dir in LIB_DIRS)
            raise NvmlDiscoveryError(
                f"{NVML_LIBRARY} not found under driver root {root} (looked in {looked_in}); set the "
                "nvidiaDriverRoot Helm value (--driver-root flag) to where the NVIDIA driver is installed"
            )
        try:
            self._load_library(path)
        except OSError as err:
            raise NvmlDiscoveryError(
                f"cannot load {path} (found for {NVML_LIBRARY} under driver root {root}): {err}"
            ) from err
        log.info("loaded NVML from the driver root", extra={"library": str(path)})
        self._library_loaded = True

    def _optional(self, what: str, gpu_index: int | None, query: Callable[[], T]) -> T | None:
        try:
            return query()
        # AttributeError: a pynvml too old to have the function at all.
        except (self._nvml.NVMLError, AttributeError) as err:
            log.debug(
                "NVML query unavailable; leaving it out",
                extra={"query": what, "gpu_index": gpu_index, "error": str(err)},
            )
            return None

    def _gpu(self, index: int) -> GpuInfo | None:
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = as_text(nvml.nvmlDeviceGetUUID(handle))
            minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
        except nvml.NVMLError as err:
            log.warning("skipping a GPU NVML cannot identify", extra={"gpu_index": index, "error": str(err)})
            return None

        def optional(what: str, query: Callable[[], T]) -> T | None:
            return self._optional(what, index, query)

        product_name = optional("name", lambda: as_text(nvml.nvmlDeviceGetName(handle)))
        memory_bytes = optional("memory", lambda: int(nvml.nvmlDeviceGetMemoryInfo(handle).total))
        pci_bus_id = optional("PCI info", lambda: normalise_pci_bus_id(nvml.nvmlDeviceGetPciInfo(handle).busId))
        mig_capable, mig_enabled = self._mig_mode(index, handle)
        return GpuInfo(
            minor=minor,
            index=index,
            uuid=uuid,
            product_name=product_name or "Unknown",
            brand=optional("brand", lambda: brand_name(int(nvml.nvmlDeviceGetBrand(handle)))),
            architecture=optional(
                "architecture", lambda: architecture_name(int(nvml.nvmlDeviceGetArchitecture(handle)))
            ),
            cuda_compute_capability=optional(
                "compute capability", lambda: "{}.{}".format(*nvml.nvmlDeviceGetCudaComputeCapability(handle))
            ),
            memory_bytes=memory_bytes,
            # NVML answers only for MIG handles (nvml.h); kept for drivers that may answer, CUDA fills the gap.
            multiprocessors=optional(
                "multiprocessors", lambda: int(nvml.nvmlDeviceGetAttributes(handle).multiprocessorCount)
            ),
            pci_bus_id=pci_bus_id,
            pcie_root=self._pcie_root(pci_bus_id) if pci_bus_id else None,
            addressing_mode=optional(
                "addressing mode", lambda: addressing_mode_name(int(nvml.nvmlDeviceGetAddressingMode(handle)))
            ),
            mig_capable=mig_capable,
            mig_enabled=mig_enabled,
            mig_instances=_MigScan(nvml, index, handle, memory_bytes).instances() if mig_enabled else (),
        )

    def _mig_mode(self, index: int, handle: Any) -> tuple[bool, bool]:
        """(capable, enabled). NotSupported is how NVML says a GPU has no MIG."""
        nvml = self._nvml
        try:
            current, _pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError as err:
            log.debug(
                "MIG mode unavailable; treating the GPU as not MIG-capable",
                extra={"gpu_index": index, "error": str(err)},
            )
            return False, False
        return True, int(current) == int(nvml.NVML_DEVICE_MIG_ENABLE)

    def _pcie_root(self, pci_bus_id: str) -> str | None:
        link = self._sysfs_root / "bus" / "pci" / "devices" / pci_bus_id
        try:
            target = os.readlink(link)
        except OSError as err:
            log.debug("PCIe root unresolvable", extra={"pci_bus_id": pci_bus_id, "error": str(err)})
            return None
        return pcie_root_from_link(target)
