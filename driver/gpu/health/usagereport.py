"""The claim usage file the running driver keeps for ``python -m driver inspect`` (another process).

``<state dir>/claim-usage.json``, rewritten atomically at each usage sample:
``{"updated": <unix s>, "usage": [{"namespace", "claim", "device", "kind", "pids", "memory_bytes",
"memory_limit_bytes", "sm_percent", "sm_limit_percent", "enforced", "sm_unknown", "admin_access",
"over_entitlement"}]}``. ``memory_bytes`` and ``sm_percent`` are null where unknown (``sm_unknown``
says why NVML cannot attribute SM use on the device); files written before ``sm_unknown`` and
``admin_access`` existed lack them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from cdi.atomicfile import write_atomic
from driver.gpu.health.usage import ClaimDeviceUsage
from driver.units import MIB

USAGE_FILE = "claim-usage.json"


def write_usage_report(path: Path, usage: Sequence[ClaimDeviceUsage]) -> None:
    entries = [{**asdict(u), "pids": list(u.pids), "over_entitlement": u.over_entitlement} for u in usage]
    # Not durable: only informative, and rewritten at the next sample.
    write_atomic(path, json.dumps({"updated": time.time(), "usage": entries}, indent=1).encode(), mode=0o644,
                 durable=False)


def add_to_inspect(report: dict[str, Any], path: Path) -> None:
    """Put per-claim usage into an ``inspect`` report: on each prepared claim's devices, and per device."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return  # no driver with usage has run yet
    except (OSError, ValueError) as exc:
        report["problems"].append(f"claim usage file {path} cannot be read ({exc})")
        return
    if not isinstance(data, dict) or not isinstance(data.get("usage"), list):
        report["problems"].append(f"claim usage file {path} is not a usage report")
        return
    entries: list[dict[str, Any]] = data["usage"]
    report["claim_usage_updated"] = data.get("updated")
    by_key = {(f"{e['namespace']}/{e['claim']}", e["device"]): e for e in entries}
    per_device: dict[str, dict[str, Any]] = {}
    for claim in report.get("claims", []):
        for device in claim["devices"]:
            entry = by_key.get((claim["claim"], device["device"]))
            if entry is None:
                continue
            device["usage"] = {k: entry[k] for k in ("pids", "memory_bytes", "memory_limit_bytes", "sm_percent",
                                                     "sm_limit_percent", "enforced", "over_entitlement")}
            device["usage"].update(sm_unknown=entry.get("sm_unknown"), admin_access=entry.get("admin_access", False))
            total = per_device.setdefault(device["device"], {"claims": [], "pids": [], "memory_bytes": 0})
            total["claims"].append(claim["claim"])
            total["pids"].extend(entry["pids"])
            # One claim's unknown memory makes the device's total unknown: a partial sum would understate it.
            known = total["memory_bytes"] is not None and entry["memory_bytes"] is not None
            total["memory_bytes"] = total["memory_bytes"] + entry["memory_bytes"] if known else None
    report["device_usage"] = per_device


def _mib(value: int | None) -> str:
    return "?" if value is None else f"{value // MIB}MiB"


def render_usage(report: dict[str, Any]) -> list[str]:
    if "device_usage" not in report:
        return []
    updated = report.get("claim_usage_updated")
    when = f" (sampled at {time.strftime('%H:%M:%S', time.localtime(updated))})" if updated else ""
    lines = [f"GPU usage by claim{when}"]
    for claim in report.get("claims", []):
        for device in claim["devices"]:
            u = device.get("usage")
            if u is None:
                continue
            if u.get("sm_unknown"):
                sm = f"unknown ({u['sm_unknown']})"
            else:
                sm = "-" if u["sm_percent"] is None else f"{u['sm_percent']:g}%"
            if u.get("admin_access"):
                # An admin-access claim holds no share of the device: nothing to set its use against.
                lines.append(f"- {claim['claim']} {device['device']}: memory {_mib(u['memory_bytes'])}, SM {sm}, "
                             f"{len(u['pids'])} process(es), admin access: no entitlement")
                continue
            sm_limit = "?" if u["sm_limit_percent"] is None else f"{u['sm_limit_percent']:g}%"
            word = "limit" if u["enforced"] else "entitled"
            over = f"  OVER ENTITLEMENT ({', '.join(u['over_entitlement'])})" if u["over_entitlement"] else ""
            lines.append(f"- {claim['claim']} {device['device']}: memory {_mib(u['memory_bytes'])} of "
                         f"{_mib(u['memory_limit_bytes'])} {word}, SM {sm} of {sm_limit}, "
                         f"{len(u['pids'])} process(es){over}")
    for name, total in sorted(report["device_usage"].items()):
        lines.append(f"- device {name}: memory {_mib(total['memory_bytes'])}, {len(total['pids'])} process(es), "
                     f"claims {', '.join(total['claims'])}")
    return lines
