"""Compute time-slice settings of whole GPUs, set with ``nvidia-smi`` (NVML has no call for them).

Callers apply a setting only when a user configured one and reset it on unprepare: NVIDIA's DRA
driver once set a default time slice on every prepare, two nvidia-smi calls per claim that nobody
asked for (removed in k8s-dra-driver-gpu PR #1183). Command: ``nvidia-smi compute-policy -i
<GPU-UUID[,...]> --set-timeslice <0-3>`` (``nvidia-smi compute-policy --help``; whole GPUs only).
The compute mode DEFAULT that NVIDIA's driver sets before the slice (``nvidia-smi -c DEFAULT`` there)
goes through NVML in this process (:mod:`driver.gpu.runtime.computemode`), and only where the GPU is
not already in DEFAULT: one nvidia-smi run per GPU, not two.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from driver.gpu.claimconfig.choices import TIMESLICE_VALUES, TimeSliceInterval
from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.errors import DriverError
from driver.gpu.host.binaries import BinaryFailed, BinaryNotFound, driver_env, find_binary, run_binary
from driver.gpu.runtime.computemode import ComputeModeError
from driver.gpu.runtime.interfaces import ComputeModeControl
from driver.kubeletplugin.types import Deadline

log = logging.getLogger(__name__)

NVIDIA_SMI = "nvidia-smi"
_GPU_UUID = re.compile(r"^GPU-[A-Za-z0-9-]+$")


class TimeSliceError(DriverError):
    """A time-slice or compute-mode change failed; the message has the command, exit code and stderr."""


class TimeSlicer:
    """Sets and resets the compute time slice of full GPUs through the driver root's nvidia-smi."""

    def __init__(self, driver_root: Path, compute_modes: ComputeModeControl, timeout: float = 10.0) -> None:
        """``timeout`` bounds each nvidia-smi call (``compute_modes`` bounds its own); a prepare makes one
        per GPU plus the compute mode's, and must fit the kubelet's 45 s."""
        self.driver_root = driver_root
        self.compute_modes = compute_modes
        self.timeout = timeout

    def apply(self, gpu_uuids: Sequence[str], interval: TimeSliceInterval, deadline: Deadline | None = None) -> None:
        """Set compute mode DEFAULT (NVML) and the time slice on every GPU, or on none of them.

        ``deadline`` shortens each call's timeout to the time left; the rollback is not shortened.
        """
        if interval not in TIMESLICE_VALUES:
            raise TimeSliceError(f"time-slice interval {interval!r} is not one of {', '.join(TIMESLICE_VALUES)}")
        uuids = _checked_gpu_uuids(gpu_uuids)
        applied: list[str] = []
        for uuid in uuids:
            try:
                # NVIDIA's driver does the same: EXCLUSIVE_PROCESS (left by MPS) would defeat sharing.
                self._default_compute_mode(uuid, deadline)
                self._run(deadline, "compute-policy", "-i", uuid, "--set-timeslice", str(TIMESLICE_VALUES[interval]))
            except TimeSliceError as exc:
                rollback = self._reset_each(applied)
                note = f"; rolled back {', '.join(applied)} to Default" if applied else ""
                if rollback:
                    note += "; rollback also failed: " + "; ".join(rollback)
                raise TimeSliceError(f"setting time slice {interval} on {uuid} failed: {exc}{note}") from exc
            applied.append(uuid)
        log.info("time slice applied", extra={"gpu_uuids": list(uuids), "interval": interval})

    def reset(self, gpu_uuids: Sequence[str]) -> None:
        """Set time slice Default (0) and compute mode DEFAULT (NVML) on every GPU, trying all before reporting."""
        uuids = _checked_gpu_uuids(gpu_uuids)
        problems = self._reset_each(uuids)
        if problems:
            raise TimeSliceError("resetting time slice failed: " + "; ".join(problems))
        log.info("time slice reset", extra={"gpu_uuids": list(uuids)})

    def _reset_each(self, uuids: Sequence[str]) -> list[str]:
        problems: list[str] = []
        for uuid in uuids:
            for step in (partial(self._run, None, "compute-policy", "-i", uuid, "--set-timeslice",
                                 str(TIMESLICE_VALUES["Default"])),
                         partial(self._default_compute_mode, uuid, None)):
                try:
                    step()
                except TimeSliceError as exc:
                    problems.append(f"{uuid}: {exc}")
        return problems

    def _default_compute_mode(self, uuid: str, deadline: Deadline | None) -> None:
        """Compute mode DEFAULT through NVML; a GPU already in DEFAULT (a MIG-enabled one always is) is left alone."""
        try:
            if self.compute_modes.get(uuid, deadline) is not ComputeMode.DEFAULT:
                self.compute_modes.set(uuid, ComputeMode.DEFAULT, deadline)
        except ComputeModeError as exc:
            raise TimeSliceError(str(exc)) from exc

    def _run(self, deadline: Deadline | None, *args: str) -> None:
        timeout = self.timeout if deadline is None else deadline.bound(self.timeout)
        if timeout <= 0:
            raise TimeSliceError(f"no time left to run nvidia-smi {' '.join(args)}")
        try:
            binary = find_binary(self.driver_root, NVIDIA_SMI)
            run_binary([str(binary), *args], env=driver_env(self.driver_root), timeout=timeout)
        except (BinaryNotFound, BinaryFailed) as exc:
            raise TimeSliceError(str(exc)) from exc


def _checked_gpu_uuids(gpu_uuids: Sequence[str]) -> list[str]:
    if isinstance(gpu_uuids, str):
        raise TimeSliceError(f"gpu_uuids must be a list of UUIDs, got the string {gpu_uuids!r}")
    uuids = list(gpu_uuids)
    if not uuids:
        raise TimeSliceError("gpu_uuids is empty: name at least one GPU-... UUID")
    for uuid in uuids:
        if uuid.startswith("MIG-"):
            raise TimeSliceError(f"{uuid} is a MIG device; time slices can only be set on full GPUs (GPU-... UUIDs)")
        if not _GPU_UUID.fullmatch(uuid):
            raise TimeSliceError(f"gpu_uuids entry {uuid!r} is not a GPU-... UUID")
    if len(set(uuids)) != len(uuids):
        raise TimeSliceError(f"gpu_uuids {uuids} lists a GPU more than once")
    return uuids
