"""The compute mode of whole GPUs, read and set through NVML in the driver's own process.

Why it matters for MPS: in the DEFAULT compute mode a CUDA client whose connection to the MPS control daemon fails
"continues to run as it normally would without MPS" (nvidia-cuda-mps-control(1)), that is outside every limit the
daemon enforces. In EXCLUSIVE_PROCESS only one context may exist on the GPU, the MPS server's, so such a client fails
instead. NVIDIA's DRA driver (``cmd/gpu-kubelet-plugin/sharing.go``, ``MpsControlDaemon.Start``) and device plugin
(``cmd/mps-control-daemon/mps/daemon.go``) set EXCLUSIVE_PROCESS while a daemon serves a GPU.

Why NVML and not ``nvidia-smi -c``: nvidia-smi initialises NVML on every run (hundreds of ms to seconds on a large
node), and a cold MPS share cost three runs (read, set, later restore). ``nvmlDeviceGetComputeMode`` and
``nvmlDeviceSetComputeMode`` do the same in this process, on one NVML session opened at first use (NVML counts
``nvmlInit`` calls, so discovery and the health source keep theirs). nvml.h: setting needs root, "is not persistent
across reboots" and the mode "always resets to Default"; values ``nvmlComputeMode_t``: DEFAULT 0,
EXCLUSIVE_THREAD 1 ("Support Removed"), PROHIBITED 2, EXCLUSIVE_PROCESS 3.

MIG: on MIG-enabled GPUs the compute mode is DEFAULT and cannot be changed (NVIDIA MIG User Guide; NVML answers
NOT_SUPPORTED). NVIDIA's DRA driver sets the mode only on full GPUs (``PreparedDevices.GpuUUIDs()`` leaves MIG
devices out); this driver does the same, see
:func:`driver.gpu.claim.claimplan.exclusive_gpus`. docs/sharing.md, "Compute mode".

A hung call: NVML calls cannot be interrupted, and on a GPU that fell off the bus or a wedged kernel driver one can
block for minutes inside the driver's ioctl. Each call therefore runs on a daemon thread of its own and the caller
waits at most ``timeout`` seconds, shortened by the prepare's :class:`Deadline`; a call that overruns fails the
claim (it is rolled back) and is left to finish in the background. Until it does, further calls for that GPU fail
at once, naming the stuck call, instead of piling up threads behind it; other GPUs go on. Unlike a hung
nvidia-smi, such a call cannot be killed: its thread ends with the driver process (a hung GPU needs a reset anyway).
The bounding and the session are ``nvmlbounded.py``'s, shared with the MIG partitioner.
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
