"""Running the CUDA probes of ``driver/gpu/discovery/cudaprobe.py`` as child processes, bounded in time.

A probe gets the driver root's libraries (``driver_env``), its own process group (killed whole
on timeout, so an MPS client stuck in the driver cannot outlive the check) and prints one JSON
line. :class:`CudaSmCounts` is the SM-count source NVML discovery uses for whole GPUs, whose
count NVML does not give (``nvmlDeviceGetAttributes`` "currently only supports MIG device
handles", nvml.h).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import driver
from driver.gpu.discovery.cudaprobe import SmCounts, bare_uuid
from driver.gpu.discovery.inventory import GpuInfo
from driver.gpu.errors import DriverError
from driver.gpu.host.binaries import BinaryFailed, driver_env, find_driver_library

log = logging.getLogger(__name__)

LIBCUDA = "libcuda.so.1"
# Variables an inherited environment may carry that would change what a probe sees.
_CLIENT_VARIABLES = ("CUDA_VISIBLE_DEVICES", "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY",
                     "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")

ProbeRunner = Callable[[Sequence[str], Mapping[str, str], float], str]


class ProbeFailed(DriverError):
    """A probe could not run, crashed, timed out or printed no JSON; the message says which."""


def find_libcuda(driver_root: Path) -> Path | None:
    return find_driver_library(driver_root, LIBCUDA)


def probe_env(driver_root: Path, extra: Mapping[str, str]) -> dict[str, str]:
    """Our environment without CUDA client variables, with the driver root's libraries, plus ``extra``."""
    try:
        env = driver_env(driver_root)
    except BinaryFailed as exc:
        raise ProbeFailed(str(exc)) from exc
    for name in _CLIENT_VARIABLES:
        env.pop(name, None)
    # The child imports this package; make it findable from any working directory.
    package_parent = str(Path(driver.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH", "")) if p)
    env.update(extra)
    return env


def run_probe(args: Sequence[str], env: Mapping[str, str], timeout: float) -> str:
    """Run ``python -m driver.gpu.discovery.cudaprobe <args>`` and return its last stdout line."""
    command = [sys.executable, "-m", "driver.gpu.discovery.cudaprobe", *args]
    label = f"the CUDA probe `{' '.join(args[:1])}`"
    try:
        proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env=dict(env), text=True, start_new_session=True)
    except OSError as exc:
        raise ProbeFailed(f"{label} could not start: {exc}") from exc
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        raise ProbeFailed(f"{label} did not finish within {timeout:g}s and was killed "
                          "(a CUDA call hung: is the GPU healthy, the MPS server reachable?)") from None
    except BaseException:  # SIGTERM/SIGINT of the caller: the probe must not outlive it
        _kill_group(proc)
        raise
    if proc.returncode != 0:
        how = (f"was killed by signal {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exited with status {proc.returncode}")
        tail = err.strip().splitlines()[-3:]
        raise ProbeFailed(f"{label} {how}" + (f": {' | '.join(tail)}" if tail else ""))
    lines = out.strip().splitlines()
    if not lines:
        raise ProbeFailed(f"{label} printed nothing")
    return lines[-1]


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


@dataclass(frozen=True)
class SmLookup:
    """SM counts found, by the UUID asked for, and for each UUID not found, why."""

    counts: dict[str, int] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)


class CudaSmCounts:
    """SM counts of whole GPUs from CUDA (``cuDeviceGetAttribute(CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)``
    keyed by ``cuDeviceGetUuid``), probed in a child process.

    A GPU's SM count never changes, so the probe runs only when a GPU appears that was not asked
    about before: at start, and after a GPU is added. Without ``libcuda.so.1`` under the driver
    root no probe runs and every lookup says so.
    """

    def __init__(self, driver_root: Path, timeout: float = 20.0, run: ProbeRunner = run_probe) -> None:
        self._driver_root = driver_root
        self._timeout = timeout
        self._run = run
        self._asked: set[str] = set()
        self._counts: dict[str, int] = {}
        self._problem: str | None = None

    def lookup(self, uuids: Sequence[str]) -> SmLookup:
        if any(uuid not in self._asked for uuid in uuids):
            self._asked.update(uuids)
            self._probe()
        found: dict[str, int] = {}
        reasons: dict[str, str] = {}
        for uuid in uuids:
            count = self._counts.get(bare_uuid(uuid))
            if count is not None:
                found[uuid] = count
            else:
                reasons[uuid] = self._problem or "CUDA does not enumerate this GPU (cuDeviceGetUuid matched none)"
        return SmLookup(found, reasons)

    def _probe(self) -> None:
        libcuda = find_libcuda(self._driver_root)
        if libcuda is None:
            self._problem = f"no {LIBCUDA} under driver root {self._driver_root} to ask CUDA"
            return
        # An empty pipe directory: cuInit must not join some MPS daemon (nvidia-cuda-mps-control(1)).
        with tempfile.TemporaryDirectory(prefix="tessera-cuda-probe-") as no_mps:
            try:
                env = probe_env(self._driver_root, {"CUDA_MPS_PIPE_DIRECTORY": no_mps})
                answer = SmCounts.model_validate(json.loads(
                    self._run(["sm-counts", "--libcuda", str(libcuda)], env, self._timeout)))
            except (ProbeFailed, ValueError) as exc:
                self._problem = f"asking CUDA failed: {exc}"
                return
        if answer.error is not None:
            self._problem = f"asking CUDA failed: {answer.error}"
            return
        self._problem = None
        self._counts.update(answer.counts)


class SmCountSource(Protocol):
    def lookup(self, uuids: Sequence[str]) -> SmLookup:
        """SM counts of these whole GPUs, and why each one not found is missing."""
        ...


def fill_sm_counts(gpus: Sequence[GpuInfo], source: SmCountSource, logged: set[tuple[str, str]]) -> list[GpuInfo]:
    """Whole GPUs without an SM count get the source's, or the reason why not, logged once per
    (GPU, reason) in ``logged``. A MIG-enabled GPU is left alone: it is published as its MIG
    devices, which have their own count from NVML."""
    lacking = [g.uuid for g in gpus if g.multiprocessors is None and not g.mig_enabled]
    if not lacking:
        return list(gpus)
    found = source.lookup(lacking)
    filled: list[GpuInfo] = []
    for gpu in gpus:
        if gpu.uuid in found.counts:
            gpu = gpu.model_copy(update={"multiprocessors": found.counts[gpu.uuid]})
        elif gpu.uuid in found.reasons:
            reason = found.reasons[gpu.uuid]
            gpu = gpu.model_copy(update={"multiprocessors_missing": reason})
            if (gpu.uuid, reason) not in logged:
                logged.add((gpu.uuid, reason))
                log.warning("publishing a GPU without its SM count (capacity 'multiprocessors')",
                            extra={"gpu_uuid": gpu.uuid, "gpu_index": gpu.index, "reason": reason})
        filled.append(gpu)
    return filled
