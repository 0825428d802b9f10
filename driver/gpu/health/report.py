"""The health file the running driver keeps for ``python -m driver inspect`` (which runs in another process).

``<state dir>/device-health.json``, rewritten atomically whenever a published device's health
changes: ``{"updated": <unix s>, "devices": {<name>: {"health", "message", "since"}},
"not_watched": {<GPU UUID>: {<what>: <why>}}}`` (``not_watched``: what NVML cannot report on a GPU now,
such as remapped rows on a MIG GPU with instances; absent in files of older drivers).
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from cdi.atomicfile import write_atomic
from driver.kubeletplugin.healthservice import DeviceHealthStatus

HEALTH_FILE = "device-health.json"


def write_report(path: Path, entries: Sequence[DeviceHealthStatus],
                 not_watched: Mapping[str, Mapping[str, str]] | None = None) -> None:
    report = {"updated": time.time(),
              "devices": {e.device: {"health": e.health.value, "message": e.message, "since": e.updated_at}
                          for e in entries},
              "not_watched": not_watched or {}}
    # Not durable: the driver rewrites it at start, and a stale one after a crash is only informative.
    write_atomic(path, json.dumps(report, indent=1).encode(), mode=0o644, durable=False)


def read_report(path: Path) -> tuple[dict[str, Any] | None, str | None]:
    """(report, problem): (None, None) when there is none (no driver has run with health yet)."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None, None
    except (OSError, ValueError) as exc:
        return None, f"device health file {path} cannot be read ({exc})"
    if not isinstance(data, dict) or not isinstance(data.get("devices"), dict):
        return None, f"device health file {path} is not a health report"
    return data, None


def add_to_inspect(report: dict[str, Any], path: Path) -> None:
    """Put device health into an ``inspect`` report: per device, and on each prepared claim's devices."""
    health, problem = read_report(path)
    if problem is not None:
        report["problems"].append(problem)
    if health is None:
        return
    devices: dict[str, Any] = health["devices"]
    report["device_health"] = devices
    if health.get("not_watched"):
        report["health_not_watched"] = health["not_watched"]
    for claim in report.get("claims", []):
        for device in claim["devices"]:
            entry = devices.get(device["device"])
            device["health"] = entry["health"] if entry else "Unknown"
            if entry and entry["health"] == "Unhealthy":
                report["problems"].append(
                    f"claim {claim['claim']}: device {device['device']} is unhealthy ({entry['message']}); the claim "
                    "stays prepared, the taint's effect (NoExecute) or the operator decides about its pods")


def render_health(report: dict[str, Any]) -> list[str]:
    devices = report.get("device_health")
    if devices is None:
        return []
    unhealthy = {name: d for name, d in sorted(devices.items()) if d["health"] != "Healthy"}
    lines = [f"device health: {len(devices) - len(unhealthy)} healthy, {len(unhealthy)} not"]
    lines += [f"- {name}: {d['health']} {d['message']}" for name, d in unhealthy.items()]
    for uuid, gaps in sorted(report.get("health_not_watched", {}).items()):
        lines += [f"- not watched on {uuid}: {what}: {why}" for what, why in sorted(gaps.items())]
    return lines
