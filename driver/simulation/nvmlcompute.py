"""SIMULATION: the NVML compute-mode calls of a simulated node, a double with pynvml's names.

``driver.nodelayout`` hands it to :class:`driver.gpu.runtime.computemode.NvmlComputeModes` in place of the
pynvml module, so the production code path runs unchanged. It behaves as nvml.h documents
``nvmlDeviceGetComputeMode``/``nvmlDeviceSetComputeMode``:

* setting needs root (``NVML_ERROR_NO_PERMISSION`` otherwise); an unknown mode value, or EXCLUSIVE_THREAD (1,
  "Support Removed"), is ``NVML_ERROR_INVALID_ARGUMENT``. The caller's UID is the simulated plugin pod's, root
  as the chart runs it, not the UID the demo or the tests happen to run as (so the demo works for any user);
  TESSERA_SIM_NVML_UID makes it another (``1000``: a plugin that is not root);
* a MIG-enabled GPU answers ``NVML_ERROR_NOT_SUPPORTED`` to any change: its mode is DEFAULT and cannot be
  changed (MIG user guide; nvidia-gpu reference 1.7);
* the mode "is not persistent across reboots and always resets to Default": modes written in another boot
  (the boot ID is kept beside the state) read as DEFAULT;
* every call before ``nvmlInit`` is ``NVML_ERROR_UNINITIALIZED``; an unknown UUID is ``NVML_ERROR_NOT_FOUND``.

The modes live where the stand-ins read them: the nvidia-smi stand-in's state file (TESSERA_SIM_NVIDIA_SMI_STATE,
default ``<driver root>/var/lib/nvidia-smi-state.json``; the MPS control stand-in refuses a client that bypasses
its daemon on an EXCLUSIVE_PROCESS GPU from it). Changes are made under the same ``<state>.lock`` flock the
nvidia-smi stand-in takes and written atomically. Which GPUs exist and have MIG enabled comes from the simulated
node's GPU list (TESSERA_SIM_GPUS_FILE, default ``<driver root>/var/lib/tessera-sim-gpus.json``). Every call
with a GPU is appended as a JSON line ``{"call": ..., "uuid": ..., "mode": ...}`` to TESSERA_SIM_NVML_LOG
(default ``<driver root>/var/log/nvml-calls.jsonl``), so tests and the demo see what NVML was asked. Failure
injection: a call whose ``"<call> <uuid>"`` contains TESSERA_SIM_NVML_FAIL is logged, then answers
``NVML_ERROR_UNKNOWN``.
"""

from __future__ import annotations

import fcntl
import json
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml

from driver.simulation.hostroot import SIM_GPUS_FILE
from driver.simulation.migstate import real_boot_id

STATE_ENV = "TESSERA_SIM_NVIDIA_SMI_STATE"
GPUS_ENV = "TESSERA_SIM_GPUS_FILE"
LOG_ENV = "TESSERA_SIM_NVML_LOG"
FAIL_ENV = "TESSERA_SIM_NVML_FAIL"
UID_ENV = "TESSERA_SIM_NVML_UID"
DEFAULT_STATE = "var/lib/nvidia-smi-state.json"  # under the driver root, where the nvidia-smi stand-in keeps it
DEFAULT_LOG = "var/log/nvml-calls.jsonl"
# nvml.h nvmlComputeMode_t, by the names the stand-ins' state file uses.
MODE_NAMES = {pynvml.NVML_COMPUTEMODE_DEFAULT: "DEFAULT", pynvml.NVML_COMPUTEMODE_PROHIBITED: "PROHIBITED",
              pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS: "EXCLUSIVE_PROCESS"}
MODE_VALUES = {name: value for value, name in MODE_NAMES.items()}


@dataclass(frozen=True)
class SimulatedHandle:
    uuid: str


class SimulatedNvml:
    """The part of pynvml the compute-mode control uses, over the simulated node's state file."""

    NVMLError = pynvml.NVMLError
    NVML_COMPUTEMODE_DEFAULT = pynvml.NVML_COMPUTEMODE_DEFAULT
    NVML_COMPUTEMODE_EXCLUSIVE_THREAD = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_THREAD
    NVML_COMPUTEMODE_PROHIBITED = pynvml.NVML_COMPUTEMODE_PROHIBITED
    NVML_COMPUTEMODE_EXCLUSIVE_PROCESS = pynvml.NVML_COMPUTEMODE_EXCLUSIVE_PROCESS

    def __init__(self, state: Path, gpus_file: Path, calls_log: Path, fail: str = "", euid: int = 0,
                 boot_id: Callable[[], str | None] = real_boot_id) -> None:
        self.state = state
        self.gpus_file = gpus_file
        self.calls_log = calls_log
        self.fail = fail
        self._euid = euid
        self._boot_id = boot_id
        self._sessions = 0
        self._mutex = threading.Lock()  # flock is per open file, so threads of this process also take this

    @classmethod
    def for_driver_root(cls, driver_root: Path, environ: Mapping[str, str]) -> SimulatedNvml:
        """The double for a simulated host tree, with the stand-ins' environment variables and defaults."""
        return cls(state=Path(environ.get(STATE_ENV) or driver_root / DEFAULT_STATE),
                   gpus_file=Path(environ.get(GPUS_ENV) or driver_root / SIM_GPUS_FILE),
                   calls_log=Path(environ.get(LOG_ENV) or driver_root / DEFAULT_LOG), fail=environ.get(FAIL_ENV, ""),
                   euid=int(environ.get(UID_ENV) or 0))

    # ----------------------------------------------------------------------------- pynvml's names (hence camelCase)

    def nvmlInit(self) -> None:
        with self._mutex:
            self._sessions += 1

    def nvmlShutdown(self) -> None:
        with self._mutex:
            if self._sessions == 0:
                raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
            self._sessions -= 1

    def nvmlDeviceGetHandleByUUID(self, uuid: str | bytes) -> SimulatedHandle:
        self._initialised()
        text = uuid.decode() if isinstance(uuid, bytes) else uuid
        gpus = self._gpus()
        if gpus is not None and text not in gpus:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return SimulatedHandle(text)

    def nvmlDeviceGetComputeMode(self, handle: SimulatedHandle) -> int:
        self._initialised()
        self._record("nvmlDeviceGetComputeMode", handle.uuid)
        with self._locked() as state:
            name = str(state.get(handle.uuid, {}).get("compute_mode", "DEFAULT"))
        return int(MODE_VALUES.get(name, pynvml.NVML_COMPUTEMODE_DEFAULT))

    def nvmlDeviceSetComputeMode(self, handle: SimulatedHandle, mode: int) -> None:
        self._initialised()
        self._record("nvmlDeviceSetComputeMode", handle.uuid, mode)
        if self._euid != 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        name = MODE_NAMES.get(int(mode))
        if name is None:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if (self._gpus() or {}).get(handle.uuid, {}).get("mig_enabled"):
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        with self._locked(write=True) as state:
            state.setdefault(handle.uuid, {"compute_mode": "DEFAULT", "timeslice": 0})["compute_mode"] = name

    # ----------------------------------------------------------------------------- the files

    def calls(self) -> list[dict[str, Any]]:
        """What was asked so far (for tests and the demo)."""
        if not self.calls_log.exists():
            return []
        return [json.loads(line) for line in self.calls_log.read_text().splitlines() if line.strip()]

    def _initialised(self) -> None:
        if self._sessions == 0:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _record(self, call: str, uuid: str, mode: int | None = None) -> None:
        entry: dict[str, Any] = {"call": call, "uuid": uuid}
        if mode is not None:
            entry["mode"] = MODE_NAMES.get(int(mode), int(mode))
        self.calls_log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.calls_log, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")
        if self.fail and self.fail in f"{call} {uuid}":
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)

    def _gpus(self) -> dict[str, dict[str, Any]] | None:
        """The simulated GPUs by UUID; None when no list was written (then every GPU-... UUID exists)."""
        try:
            gpus = json.loads(self.gpus_file.read_text()).get("gpus", [])
        except (OSError, ValueError, AttributeError):
            return None
        return {str(g["uuid"]): g for g in gpus if isinstance(g, dict) and "uuid" in g}

    @contextmanager
    def _locked(self, write: bool = False) -> Iterator[dict[str, dict[str, Any]]]:
        """The state under the stand-ins' lock; written back (atomically) if ``write`` or a reboot reset it."""
        self.state.parent.mkdir(parents=True, exist_ok=True)
        boot_file = self.state.with_name(self.state.name + ".boot_id")
        with self._mutex, open(self.state.with_name(self.state.name + ".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                state = _read_json(self.state)
                boot = self._boot_id()
                written_in = boot_file.read_text().strip() if boot_file.exists() else None
                if boot is not None and written_in is not None and written_in != boot:
                    for entry in state.values():
                        entry["compute_mode"] = "DEFAULT"  # "always resets to Default" (nvml.h)
                    write = True
                yield state
                if write:
                    _write_atomic(self.state, json.dumps(state, indent=1, sort_keys=True))
                    if boot is not None:
                        _write_atomic(boot_file, boot + "\n")
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)


def _read_json(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in data.items() if isinstance(v, dict)} if isinstance(data, dict) else {}


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)
