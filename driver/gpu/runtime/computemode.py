"""The compute mode of whole GPUs, read and set through NVML in the driver's own process.

Why EXCLUSIVE_PROCESS while a daemon serves a GPU, why NVML rather than ``nvidia-smi -c``, why MIG-enabled GPUs
are left alone (:func:`driver.gpu.claim.claimplan.exclusive_gpus`) and how a hung call is bounded (each call on a
daemon thread of its own, ``nvmlbounded.py``'s, shared with the MIG partitioner): docs/sharing.md, "Compute mode".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.errors import DriverError
from driver.gpu.runtime.nvmlbounded import BoundedNvml, NvmlCallError, no_library_to_load
from driver.kubeletplugin.types import Deadline

# nvml.h nvmlComputeMode_t (nvidia-ml-py: NVML_COMPUTEMODE_*); EXCLUSIVE_THREAD (1) is "Support Removed".
NVML_COMPUTE_MODES = {ComputeMode.DEFAULT: 0, ComputeMode.PROHIBITED: 2, ComputeMode.EXCLUSIVE_PROCESS: 3}
_BY_NVML_VALUE = {value: mode for mode, value in NVML_COMPUTE_MODES.items()}
NVML_EXCLUSIVE_THREAD = 1
# nvml.h return codes whose cause the driver can name (nvidia-ml-py: NVML_ERROR_*).
_HINTS = {3: "; MIG-enabled GPUs keep compute mode DEFAULT", 4: "; setting a compute mode needs root",
          6: "; no GPU with this UUID (gone since discovery?)", 15: "; the GPU fell off the bus"}


class ComputeModeError(DriverError):
    """Reading or setting a compute mode failed; the message has the GPU, the NVML call and NVML's error."""


class NvmlComputeModes:
    """Reads and sets compute modes with ``nvmlDeviceGetComputeMode``/``nvmlDeviceSetComputeMode``.

    ``nvml`` is the pynvml module (the simulated node passes its NVML double, tests a fake, all with
    pynvml's names); ``load_library`` makes the driver root's ``libnvidia-ml.so.1`` loadable before
    the first ``nvmlInit`` (``driver.nodelayout`` passes it). ``timeout`` bounds one call.
    """

    def __init__(self, nvml: Any, load_library: Callable[[], None] = no_library_to_load,
                 timeout: float = 10.0) -> None:
        self._nvml = nvml
        self.timeout = timeout
        self._calls = BoundedNvml(nvml, "read or set compute modes", "nvml-compute-mode", load_library)

    def get(self, uuid: str, deadline: Deadline | None = None) -> ComputeMode:
        value = self._call(uuid, deadline, "nvmlDeviceGetComputeMode", self._nvml.nvmlDeviceGetComputeMode)
        mode = _BY_NVML_VALUE.get(int(value))
        if mode is None:
            name = "EXCLUSIVE_THREAD, whose support NVML removed" if value == NVML_EXCLUSIVE_THREAD else "unknown"
            raise ComputeModeError(f"NVML reports compute mode {value} ({name}) for {uuid}; set it to DEFAULT "
                                   f"(nvidia-smi -i {uuid} -c DEFAULT, as root)")
        return mode

    def set(self, uuid: str, mode: ComputeMode, deadline: Deadline | None = None) -> None:
        value = NVML_COMPUTE_MODES[mode]
        self._call(uuid, deadline, f"nvmlDeviceSetComputeMode {mode.value}",
                   lambda handle: self._nvml.nvmlDeviceSetComputeMode(handle, value))

    def close(self) -> None:
        """End this object's NVML session (the others' stay: NVML counts them)."""
        self._calls.close()

    def _call(self, uuid: str, deadline: Deadline | None, what: str, op: Callable[[Any], Any]) -> Any:
        if not uuid.startswith("GPU-"):
            raise ComputeModeError(f"{uuid} is not a whole GPU (GPU-... UUID); MIG devices keep compute mode DEFAULT")
        timeout = self.timeout if deadline is None else deadline.bound(self.timeout)
        try:
            return self._calls.run(uuid, what, lambda: op(self._nvml.nvmlDeviceGetHandleByUUID(uuid)), timeout)
        except NvmlCallError as exc:
            raise ComputeModeError(str(exc)) from exc
        except self._nvml.NVMLError as err:
            code = getattr(err, "value", None)
            hint = _HINTS.get(code, "") if isinstance(code, int) else ""
            raise ComputeModeError(f"{what} for {uuid} failed: NVML error {code}: {err}{hint}") from err
        except ComputeModeError:
            raise
        except Exception as exc:
            raise ComputeModeError(f"{what} for {uuid} failed: {type(exc).__name__}: {exc}") from exc
