#!/usr/bin/env python3
"""Read-only: every MIG GPU-instance profile and possible placement NVML reports, as JSON.

Run on a real GPU node to check ``driver/simulation/mig-profiles.json`` against the hardware and
driver at hand (dynamic MIG publishes these placements). It only reads: no MIG mode change, no
instance created. A profile NVML refuses is listed with the error it returned, so the output also
records how this driver answers for a GPU with MIG mode off.

    python scripts/mig-profile-probe.py > profiles.json
"""

from __future__ import annotations

import ctypes
import json
import sys
from typing import Any

import pynvml

GI_PROFILE_ENUMS = range(0x13)  # NVML_GPU_INSTANCE_PROFILE_1_SLICE .. 0x12 (nvml.h, R575+)


def _error(exc: pynvml.NVMLError) -> str:
    return f"{type(exc).__name__} ({exc.value}): {exc}"


def _profile(handle: Any, enum: int) -> dict[str, Any]:
    entry: dict[str, Any] = {"enum": enum}
    try:
        info = pynvml.nvmlDeviceGetGpuInstanceProfileInfoV(handle, enum)
    except pynvml.NVMLError as exc:
        return {**entry, "error": _error(exc)}
    for field in ("id", "isP2pSupported", "sliceCount", "instanceCount", "multiprocessorCount",
                  "copyEngineCount", "decoderCount", "encoderCount", "jpegCount", "ofaCount", "memorySizeMB", "name"):
        value = getattr(info, field, None)
        entry[field] = value.decode() if isinstance(value, bytes) else value
    try:
        # Version 2 takes a caller-sized array and its length, and sets the length to what it filled.
        array = (pynvml.c_nvmlGpuInstancePlacement_t * 32)()
        count = ctypes.c_uint(32)
        pynvml.nvmlDeviceGetGpuInstancePossiblePlacements(handle, info.id, array, ctypes.byref(count))
        entry["placements"] = [[array[i].start, array[i].size] for i in range(count.value)]
    except pynvml.NVMLError as exc:
        entry["placements_error"] = _error(exc)
    try:
        entry["remaining_capacity"] = pynvml.nvmlDeviceGetGpuInstanceRemainingCapacity(handle, info.id)
    except pynvml.NVMLError as exc:
        entry["remaining_capacity_error"] = _error(exc)
    return entry


def main() -> int:
    pynvml.nvmlInit()
    try:
        out: dict[str, Any] = {"driver": pynvml.nvmlSystemGetDriverVersion(), "gpus": []}
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpu: dict[str, Any] = {"index": index, "name": pynvml.nvmlDeviceGetName(handle),
                                   "memory_bytes": pynvml.nvmlDeviceGetMemoryInfo(handle).total}
            try:
                current, pending = pynvml.nvmlDeviceGetMigMode(handle)
                gpu["mig_mode"] = {"current": current, "pending": pending}
            except pynvml.NVMLError as exc:
                gpu["mig_mode_error"] = _error(exc)
            gpu["profiles"] = [_profile(handle, enum) for enum in GI_PROFILE_ENUMS]
            out["gpus"].append(gpu)
        json.dump(out, sys.stdout, indent=1)
        print()
    finally:
        pynvml.nvmlShutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
