"""The compute mode of whole GPUs, read and set with the driver root's ``nvidia-smi``.

Why it matters for MPS: in the DEFAULT compute mode a CUDA client whose connection to the MPS
control daemon fails "continues to run as it normally would without MPS" (nvidia-cuda-mps-control(1)),
that is outside every limit the daemon enforces. In EXCLUSIVE_PROCESS only one context may exist
on the GPU, the MPS server's, so such a client fails instead. NVIDIA's DRA driver
(``cmd/gpu-kubelet-plugin/sharing.go``, ``MpsControlDaemon.Start``) and device plugin
(``cmd/mps-control-daemon/mps/daemon.go``) set EXCLUSIVE_PROCESS while a daemon serves a GPU.

MIG: on MIG-enabled GPUs the compute mode is DEFAULT and cannot be changed (NVIDIA MIG User
Guide; NVML answers NOT_SUPPORTED). NVIDIA's DRA driver sets the mode only on full GPUs
(``PreparedDevices.GpuUUIDs()`` leaves MIG devices out); this driver does the same, see
:func:`exclusive_gpus`. Commands: ``nvidia-smi -i <uuid> -c EXCLUSIVE_PROCESS|DEFAULT`` (root, not
persistent across reboots); docs/sharing.md, "Compute mode".
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import StrEnum
from pathlib import Path

from driver.gpu.runtime.binaries import BinaryFailed, BinaryNotFound, driver_env, find_binary, run_binary
from driver.kubeletplugin.types import Deadline

NVIDIA_SMI = "nvidia-smi"


class ComputeMode(StrEnum):
    """The names ``nvidia-smi -c`` takes (nvidia-smi(1), "-c, --compute-mode")."""

    DEFAULT = "DEFAULT"
    EXCLUSIVE_PROCESS = "EXCLUSIVE_PROCESS"
    PROHIBITED = "PROHIBITED"


# What ``nvidia-smi --query-gpu=compute_mode --format=csv,noheader`` prints for each mode
# (nvidia-smi --help-query-gpu: "compute_mode ... Default, Exclusive_Process, Prohibited").
_QUERY_NAMES = {"Default": ComputeMode.DEFAULT, "Exclusive_Process": ComputeMode.EXCLUSIVE_PROCESS,
                "Prohibited": ComputeMode.PROHIBITED}


class ComputeModeError(Exception):
    """Reading or setting a compute mode failed; the message has the GPU, the command and its error."""


def parse_query(output: str, uuid: str) -> ComputeMode:
    """The mode in ``nvidia-smi --query-gpu=compute_mode --format=csv,noheader -i <uuid>`` output."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    if len(lines) != 1 or lines[0] not in _QUERY_NAMES:
        raise ComputeModeError(f"reading the compute mode of {uuid}: expected one of {', '.join(_QUERY_NAMES)} "
                               f"from nvidia-smi, got {output.strip()!r}")
    return _QUERY_NAMES[lines[0]]


def exclusive_gpus(cuda_uuids: Iterable[str]) -> list[str]:
    """The GPUs whose compute mode an MPS daemon serving ``cuda_uuids`` makes EXCLUSIVE_PROCESS.

    Whole GPUs only: a MIG device's parent stays in DEFAULT, the only mode MIG allows.
    """
    return sorted({u for u in cuda_uuids if u.startswith("GPU-")})


class ComputeModes:
    """Reads and sets compute modes through ``nvidia-smi`` (needs root on a real node)."""

    def __init__(self, driver_root: Path, timeout: float = 10.0) -> None:
        """``timeout`` bounds one nvidia-smi call; a :class:`Deadline` shortens it further."""
        self.driver_root = driver_root
        self.timeout = timeout

    def get(self, uuid: str, deadline: Deadline | None = None) -> ComputeMode:
        output = self._run(uuid, deadline, "--query-gpu=compute_mode", "--format=csv,noheader", "-i", uuid)
        return parse_query(output, uuid)

    def set(self, uuid: str, mode: ComputeMode, deadline: Deadline | None = None) -> None:
        self._run(uuid, deadline, "-i", uuid, "-c", mode.value)

    def _run(self, uuid: str, deadline: Deadline | None, *args: str) -> str:
        if not uuid.startswith("GPU-"):
            raise ComputeModeError(f"{uuid} is not a whole GPU (GPU-... UUID); MIG devices keep compute mode DEFAULT")
        timeout = self.timeout if deadline is None else deadline.bound(self.timeout)
        if timeout <= 0:
            raise ComputeModeError(f"no time left to run nvidia-smi {' '.join(args)} for {uuid}")
        try:
            binary = find_binary(self.driver_root, NVIDIA_SMI)
            return run_binary([str(binary), *args], env=driver_env(self.driver_root), timeout=timeout)
        except (BinaryNotFound, BinaryFailed) as exc:
            raise ComputeModeError(f"compute mode of {uuid}: {exc}") from exc
