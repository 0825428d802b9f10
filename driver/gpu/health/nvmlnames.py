"""The NVML names the health source needs, with nvml.h's values where the installed pynvml lacks them.

The oldest nvidia-ml-py the project allows (12.560.30) has no name for the recovery-action field or the
recovery-action and GPU-unavailable event bits; 13.615.71 has all three. The numbers are nvml.h's (r570 and
later, the same in nvidia-ml-py 13.615.71): a driver that knows them answers them whatever pynvml says, and one
that does not says so (the field's ``nvmlReturn``, the supported event mask), which the health source logs.
Pure; no NVML calls.
"""

from __future__ import annotations

from typing import Any

# nvml.h: #define NVML_FI_DEV_GET_GPU_RECOVERY_ACTION 230 (values nvmlDeviceGpuRecoveryAction_t, 0 = none).
RECOVERY_ACTION_FIELD = "NVML_FI_DEV_GET_GPU_RECOVERY_ACTION"
# nvml.h: #define nvmlEventTypeGpuUnavailableError 0x0000000000004000LL, nvmlEventTypeGpuRecoveryAction 0x...8000LL.
GPU_UNAVAILABLE_EVENT = "nvmlEventTypeGpuUnavailableError"
RECOVERY_ACTION_EVENT = "nvmlEventTypeGpuRecoveryAction"

NVML_H_VALUES: dict[str, int] = {
    RECOVERY_ACTION_FIELD: 230,
    GPU_UNAVAILABLE_EVENT: 0x4000,
    RECOVERY_ACTION_EVENT: 0x8000,
}


def nvml_value(nvml: Any, name: str) -> int:
    """pynvml's value for ``name``, or nvml.h's when this pynvml is too old to have the name."""
    value = getattr(nvml, name, None)
    return int(value) if value is not None else NVML_H_VALUES[name]


def missing_names(nvml: Any) -> list[str]:
    """The names this pynvml lacks, for the one start-up line that says nvml.h's values are used instead."""
    return [name for name in NVML_H_VALUES if getattr(nvml, name, None) is None]
