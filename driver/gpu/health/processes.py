"""The GPUs' processes on real nodes: NVML's per-process memory and SM use, and each process's pod.

Memory: ``nvmlDeviceGetComputeRunningProcesses`` and, for MPS clients (which the first lists only
as the MPS server), ``nvmlDeviceGetMPSComputeRunningProcesses`` (nvml.h); each entry carries the
pid, ``usedGpuMemory`` (pynvml gives None for NVML_VALUE_NOT_AVAILABLE) and, on a MIG-enabled
GPU, the GPU and compute instance it runs in. A pid in the MPS list is an MPS client, whichever
list also names it. SM use: ``nvmlDeviceGetProcessUtilization`` (the samples since a timestamp;
``smUtil`` in percent), not supported on every GPU: then None. Samples are passed on as NVML gives
them; whether one is a claim's own (not for MPS clients, whose work NVML gives to the server, nor
on MIG) is decided in ``usage.py``.
The pod: ``<host root>/proc/<pid>/cgroup``, the parent: ``<host root>/proc/<pid>/stat`` (NVML
answers host PIDs, so the plugin needs the host's /proc there: hostPID, or the host root mounted
with its /proc).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from driver.gpu.discovery.inventory import NodeInventory
from driver.gpu.health.nvmlsource import mig_uuid_for
from driver.gpu.health.usage import ProcessUsage, pod_uid_from_cgroup
from driver.gpu.mps.proc import read_proc_stat

log = logging.getLogger(__name__)

# Utilisation samples from the last few seconds: NVML keeps a short buffer of them per process.
_UTILISATION_WINDOW_S = 5.0


class ProcessSource(Protocol):
    def processes(self) -> list[ProcessUsage]:
        """Every process on the node's GPUs now, with its pod where it has one."""
        ...

    def describe(self) -> str: ...


def read_pod_uid(host_root: Path, pid: int) -> str | None:
    try:
        return pod_uid_from_cgroup((host_root / "proc" / str(pid) / "cgroup").read_text())
    except OSError:
        return None  # gone since NVML listed it, or not visible from here


def read_parent_pid(host_root: Path, pid: int) -> int | None:
    """The parent of ``pid`` as the host's /proc shows it, None when it is gone or not visible from here."""
    stat = read_proc_stat(pid, host_root / "proc")
    return None if stat is None else stat.ppid


class NvmlProcesses:
    """A :class:`ProcessSource` over NVML (``nvml``: the pynvml module, initialised by the health source)."""

    def __init__(self, nvml: Any, inventory: Callable[[], NodeInventory], host_root: Path,
                 clock: Callable[[], float] = time.time):
        self._nvml = nvml
        self._inventory = inventory
        self._host_root = host_root
        self._clock = clock

    def describe(self) -> str:
        return f"NVML processes, pods from {self._host_root / 'proc'}"

    def processes(self) -> list[ProcessUsage]:
        nvml = self._nvml
        found: list[ProcessUsage] = []
        for gpu in self._inventory().gpus:
            try:
                handle = nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            except nvml.NVMLError:
                continue
            sm = self._sm_by_pid(handle)
            running, mps = self._running(handle)
            clients = {int(entry.pid) for entry in mps}
            seen: set[tuple[int, str]] = set()
            for entry in [*running, *mps]:
                pid = int(entry.pid)
                uuid = mig_uuid_for(gpu, int(getattr(entry, "gpuInstanceId", 0xFFFFFFFF)),
                                    int(getattr(entry, "computeInstanceId", 0xFFFFFFFF))) or gpu.uuid
                if (pid, uuid) in seen:
                    continue
                seen.add((pid, uuid))
                memory = entry.usedGpuMemory
                found.append(ProcessUsage(pid=pid, uuid=uuid, memory_bytes=None if memory is None else int(memory),
                                          sm_percent=sm.get(pid), pod_uid=read_pod_uid(self._host_root, pid),
                                          mps_client=pid in clients,
                                          parent_pid=read_parent_pid(self._host_root, pid)))
        return found

    def _running(self, handle: Any) -> tuple[list[Any], list[Any]]:
        """(compute processes, MPS clients) on the GPU."""
        nvml = self._nvml
        # pynvml's unversioned calls are the _v3 ones behind a check that raises NVMLLibraryMismatchError
        # (a plain Exception, not an NVMLError) when the driver lacks the _v3 symbol; _v2 then still works.
        mismatch = getattr(nvml, "NVMLLibraryMismatchError", nvml.NVMLError)
        lists: tuple[list[Any], list[Any]] = ([], [])
        for name, entries in zip(("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses"),
                                 lists, strict=True):
            for call in (name, f"{name}_v2"):
                try:
                    entries.extend(getattr(nvml, call)(handle))
                    break
                except mismatch as err:
                    log.debug("this driver lacks a process call's newest version", extra={"call": call,
                                                                                          "reason": str(err)})
                except (nvml.NVMLError, AttributeError) as err:
                    log.debug("cannot list a GPU's processes", extra={"call": call, "reason": str(err)})
                    break
        return lists

    def _sm_by_pid(self, handle: Any) -> dict[int, float]:
        nvml = self._nvml
        since = int((self._clock() - _UTILISATION_WINDOW_S) * 1_000_000)  # NVML timestamps are in microseconds
        try:
            samples = nvml.nvmlDeviceGetProcessUtilization(handle, since)
        except (nvml.NVMLError, AttributeError):
            return {}  # not supported on this GPU, or no samples in the window
        latest: dict[int, tuple[int, float]] = {}
        for sample in samples:
            pid, stamp = int(sample.pid), int(sample.timeStamp)
            if pid not in latest or stamp > latest[pid][0]:
                latest[pid] = (stamp, float(sample.smUtil))
        return {pid: value for pid, (_stamp, value) in latest.items()}
