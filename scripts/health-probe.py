#!/usr/bin/env python3
"""Read-only: what NVML and the kernel report on this node for Tessera's health and MIG checks, as JSON.

Per GPU: the MIG mode (current and pending), the NVML event types the driver reports (the
recovery-action 0x8000 and GPU-unavailable 0x4000 bits named), field 230 (the recovery action, with
its return code), remapped rows (or the error: nvml.h says NOT_SUPPORTED on a MIG GPU with
instances), and what Tessera's health source finds it cannot read there after one poll. Per node:
the driver's MIG capabilities under /proc and the capability nodes under /dev/nvidia-caps (the
kernel module does not create them). Nothing is changed: no event is waited for, no mode is set.

    python scripts/health-probe.py [HOST_ROOT] > health.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from driver.gpu.discovery.inventory import GpuInfo, NodeInventory  # noqa: E402
from driver.gpu.health.nvmlnames import (  # noqa: E402
    GPU_UNAVAILABLE_EVENT,
    RECOVERY_ACTION_EVENT,
    RECOVERY_ACTION_FIELD,
    missing_names,
    nvml_value,
)
from driver.gpu.health.nvmlsource import NvmlHealthSource  # noqa: E402

CAPABILITIES = "proc/driver/nvidia/capabilities"


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__} ({getattr(exc, 'value', '?')}): {exc}"


def _gpu(nvml: Any, handle: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {}
    try:
        current, pending = nvml.nvmlDeviceGetMigMode(handle)
        entry["mig_mode"] = {"current": int(current), "pending": int(pending)}
    except nvml.NVMLError as exc:
        entry["mig_mode_error"] = _error(exc)
    try:
        supported = int(nvml.nvmlDeviceGetSupportedEventTypes(handle))
        entry["event_types"] = {"mask": hex(supported),
                                "gpu_unavailable": bool(supported & nvml_value(nvml, GPU_UNAVAILABLE_EVENT)),
                                "recovery_action": bool(supported & nvml_value(nvml, RECOVERY_ACTION_EVENT))}
    except nvml.NVMLError as exc:
        entry["event_types_error"] = _error(exc)
    try:
        [value] = nvml.nvmlDeviceGetFieldValues(handle, [nvml_value(nvml, RECOVERY_ACTION_FIELD)])
        entry["field_230"] = {"nvmlReturn": int(value.nvmlReturn), "value": int(value.value.uiVal)}
    except nvml.NVMLError as exc:
        entry["field_230_error"] = _error(exc)
    try:
        entry["remapped_rows"] = [int(v) for v in nvml.nvmlDeviceGetRemappedRows(handle)]
    except (nvml.NVMLError, AttributeError) as exc:
        entry["remapped_rows_error"] = _error(exc)
    return entry


def _capabilities(host_root: Path) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for name in ("mig/config", "mig/monitor"):
        path = host_root / CAPABILITIES / name
        result[name] = path.read_text() if path.exists() else None
    caps = host_root / "dev" / "nvidia-caps"
    result["dev_nvidia_caps"] = sorted(p.name for p in caps.iterdir()) if caps.is_dir() else None
    return result


def probe(nvml: Any, host_root: Path) -> dict[str, Any]:
    """Everything above, for every GPU NVML lists (``nvml``: the pynvml module, already initialised)."""
    gpus: list[dict[str, Any]] = []
    infos: list[GpuInfo] = []
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        uuid = nvml.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        entry = {"index": index, "uuid": uuid, **_gpu(nvml, handle)}
        gpus.append(entry)
        mig = entry.get("mig_mode", {}).get("current") == 1
        infos.append(GpuInfo(minor=index, index=index, uuid=uuid, product_name="probed", mig_capable=mig,
                             mig_enabled=mig))
    # One poll of Tessera's own health source: what it would log as not watched on each GPU.
    inventory = NodeInventory(gpus=tuple(infos))
    source = NvmlHealthSource(nvml, lambda: inventory, poll_interval=3600)
    source.poll_once(lambda _event: None)
    return {"pynvml_lacks": missing_names(nvml), "gpus": gpus, "not_watched": source.not_watched(),
            "capabilities": _capabilities(host_root)}


def main() -> int:
    import pynvml

    host_root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/")
    pynvml.nvmlInit()
    try:
        report = probe(pynvml, host_root)
        report["driver"] = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    json.dump(report, sys.stdout, indent=1, default=str)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
