"""GPU discovery on real hardware through NVML (the ``pynvml`` module of nvidia-ml-py).

One NVML session per :class:`NvmlDiscovery` (opened on first use, ended by ``close``). Every
query that a GPU or driver may not support is optional: NotSupported, FunctionNotFound or any
other NVML error for that query leaves the field None (logged at debug), so a missing feature
becomes a missing attribute, never a crash. Only the identity of a GPU (handle, UUID, minor) is
required; a GPU without it is skipped with a warning.

Values are turned into published strings by ``nvmlvalues.py``; MIG devices, and the MIG profiles a GPU in
MIG mode can create (dynamic MIG), are read by ``migscan.py``.

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
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from driver.gpu.discovery.cudarun import CudaSmCounts, SmCountSource, fill_sm_counts
from driver.gpu.discovery.inventory import GpuInfo, NodeInventory, mig_memory_slices
from driver.gpu.discovery.migscan import MigScan
from driver.gpu.discovery.nvmlvalues import (
    addressing_mode_name,
    architecture_name,
    as_text,
    brand_name,
    cuda_version_string,
    normalise_pci_bus_id,
    pcie_root_from_link,
)
from driver.gpu.errors import DriverError
from driver.gpu.host.binaries import LIB_DIRS, find_driver_library

log = logging.getLogger(__name__)

T = TypeVar("T")

NVML_LIBRARY = "libnvidia-ml.so.1"

def end_nvml_session(nvml: Any) -> None:
    """``nvmlShutdown`` for one caller's session (NVML counts them); a failure is only logged."""
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError as err:
        log.warning("NVML shutdown failed", extra={"error": str(err)})


class NvmlDiscoveryError(DriverError, RuntimeError):
    """NVML cannot be used at all (not installed, driver not loaded, device count unavailable)."""


def load_library_globally(path: Path) -> None:
    """dlopen ``path`` with RTLD_GLOBAL, so a later dlopen of its soname finds it loaded."""
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


def load_nvml_from_driver_root(root: Path, load_library: Callable[[Path], None] = load_library_globally) -> None:
    """Make pynvml's load by soname find the driver root's ``libnvidia-ml.so.1`` (nothing to do for ``/``).

    Shared by discovery and the compute-mode control (``runtime/computemode.py``); loading twice is harmless.
    """
    if root.resolve() == Path("/"):
        return
    path = find_driver_library(root, NVML_LIBRARY)
    if path is None:
        looked_in = ", ".join(str(root / lib_dir) for lib_dir in LIB_DIRS)
        raise NvmlDiscoveryError(
            f"{NVML_LIBRARY} not found under driver root {root} (looked in {looked_in}); set the "
            "nvidiaDriverRoot Helm value (--driver-root flag) to where the NVIDIA driver is installed"
        )
    try:
        load_library(path)
    except OSError as err:
        raise NvmlDiscoveryError(
            f"cannot load {path} (found for {NVML_LIBRARY} under driver root {root}): {err}"
        ) from err
    log.info("loaded NVML from the driver root", extra={"library": str(path)})


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
        self._mig_gaps_logged: set[tuple[str, ...]] = set()  # MIG profile queries a GPU refused, logged once

    def close(self) -> None:
        if not self._initialised:
            return
        self._initialised = False
        end_nvml_session(self._nvml)

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
        if self._library_loaded:
            return
        load_nvml_from_driver_root(self._driver_root, self._load_library)
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
        mig_capable, mig_enabled, mig_mode_pending = self._mig_mode(index, handle)
        mig = MigScan(nvml, index, handle, memory_bytes, uuid, self._mig_gaps_logged) if mig_enabled else None
        mig_profiles = mig.profiles() if mig is not None else ()
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
            mig_mode_pending=mig_mode_pending,
            mig_instances=mig.instances() if mig is not None else (),
            mig_memory_slices=mig_memory_slices(mig_profiles),
            mig_profiles=mig_profiles,
        )

    def _mig_mode(self, index: int, handle: Any) -> tuple[bool, bool, Literal["enable", "disable"] | None]:
        """(capable, enabled, the pending mode where it differs). NotSupported is how NVML says a GPU has no MIG."""
        nvml = self._nvml
        try:
            current, pending = nvml.nvmlDeviceGetMigMode(handle)
        except nvml.NVMLError as err:
            log.debug(
                "MIG mode unavailable; treating the GPU as not MIG-capable",
                extra={"gpu_index": index, "error": str(err)},
            )
            return False, False, None
        enabled, to_enable = (int(mode) == int(nvml.NVML_DEVICE_MIG_ENABLE) for mode in (current, pending))
        if enabled == to_enable:
            return True, enabled, None
        return True, enabled, "enable" if to_enable else "disable"

    def _pcie_root(self, pci_bus_id: str) -> str | None:
        link = self._sysfs_root / "bus" / "pci" / "devices" / pci_bus_id
        try:
            target = os.readlink(link)
        except OSError as err:
            log.debug("PCIe root unresolvable", extra={"pci_bus_id": pci_bus_id, "error": str(err)})
            return None
        return pcie_root_from_link(target)
