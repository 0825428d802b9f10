"""What an XID means for the device that reported it: the one table, with where it comes from.

Source: NVIDIA's XID catalog, "XID Errors" (docs.nvidia.com/deploy/xid-errors, the XID error
listing and its "Action" column, r580 edition), and NVML's recovery action
(``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``, nvml.h). Application XIDs are those the catalog
attributes to the user's program and clears by restarting it; NVIDIA's Kubernetes device plugin
ignores the same set (k8s-device-plugin ``internal/rm/health.go``, ``applicationErrorXids``).
An XID missing from the table is treated as making the GPU unhealthy, as NVIDIA's device plugin
does: a new hardware XID must not keep receiving work until someone classifies it.

Two XIDs announce a change of a state NVML reports, and that state decides (``conditions.py``):
XID 154 ("GPU Recovery Action Changed") is logged whenever the recovery action changes, also back
to none after a reset, so tainting on it would keep a reset GPU tainted; field 230
(``NVML_FI_DEV_GET_GPU_RECOVERY_ACTION``) is what says a reset is needed. XID 63 ("row remapping
recording event") says a remap was recorded, i.e. is pending until the next reset, which NVIDIA's
memory-error guide says is no fault; ``nvmlDeviceGetRemappedRows`` reports pending and failed,
and a failed remap taints. NVIDIA's device plugin marks a GPU unhealthy on both (it skips only the
application XIDs above); Tessera does not, on purpose.
Pure data and functions; no I/O.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from enum import StrEnum


class XidImpact(StrEnum):
    APPLICATION = "application"  # the failing program's problem; the device stays healthy
    DEVICE = "device"  # the device needs a reset (or more) before it takes work again
    STATE = "state"  # announces a change of a state NVML reports (recovery action, row remapping): that decides


@dataclass(frozen=True)
class XidInfo:
    xid: int
    name: str
    impact: XidImpact


_APP = XidImpact.APPLICATION
_DEV = XidImpact.DEVICE
_STATE = XidImpact.STATE

XID_TABLE: dict[int, XidInfo] = {info.xid: info for info in (
    XidInfo(13, "Graphics Engine Exception", _APP),
    XidInfo(31, "GPU memory page fault", _APP),
    XidInfo(43, "GPU stopped processing", _APP),
    XidInfo(45, "Preemptive cleanup, due to previous errors", _APP),
    XidInfo(68, "NVDEC0 Exception", _APP),
    XidInfo(109, "Context Switch Timeout Error", _APP),
    XidInfo(48, "Double Bit ECC Error", _DEV),
    XidInfo(61, "Internal micro-controller breakpoint/warning", _DEV),
    XidInfo(62, "Internal micro-controller halt", _DEV),
    XidInfo(63, "ECC page retirement or row remapping recording event", _STATE),
    XidInfo(64, "ECC page retirement or row remapper recording failure", _DEV),
    XidInfo(74, "NVLink Error", _DEV),
    XidInfo(79, "GPU has fallen off the bus", _DEV),
    XidInfo(92, "High single-bit ECC error rate", _DEV),
    XidInfo(94, "Contained ECC error", _DEV),
    XidInfo(95, "Uncontained ECC error", _DEV),
    XidInfo(119, "GSP RPC Timeout", _DEV),
    XidInfo(120, "GSP Error", _DEV),
    XidInfo(140, "Unrecovered ECC Error", _DEV),
    XidInfo(154, "GPU Recovery Action Changed", _STATE),
)}


# What NVML reports for the state a STATE XID announces a change of.
_STATE_READ = {63: "memory row remapping (nvmlDeviceGetRemappedRows: a pending remap is no fault, a failed one is)",
               154: "the recovery action (NVML_FI_DEV_GET_GPU_RECOVERY_ACTION)"}

# The XIDs after which the NVML source reads the state at once rather than at its next poll.
RECOVERY_ACTION_XID = 154
ROW_REMAP_XIDS = frozenset({63, 64})


@dataclass(frozen=True)
class XidVerdict:
    xid: int
    name: str
    makes_unhealthy: bool
    why: str  # for logs and the health message


def classify_xid(xid: int, ignored: Collection[int] = ()) -> XidVerdict:
    """What ``xid`` means for its device; ``ignored`` are the operator's XIDs to never act on."""
    info = XID_TABLE.get(xid)
    name = info.name if info is not None else "not in the XID table"
    if xid in ignored:
        return XidVerdict(xid, name, False, f"XID {xid} ({name}) is ignored by the operator's setting")
    if info is None:
        return XidVerdict(xid, name, True, f"XID {xid} is not a known application error; treated as a device error")
    if info.impact is XidImpact.APPLICATION:
        return XidVerdict(xid, name, False, f"XID {xid} ({name}) is an application error; the device stays healthy")
    if info.impact is XidImpact.STATE:
        return XidVerdict(xid, name, False, f"XID {xid} ({name}) announces a change of {_STATE_READ[xid]}, which "
                                            "decides the device's health")
    return XidVerdict(xid, name, True, f"XID {xid} ({name})")


def parse_ignored_xids(text: str) -> frozenset[int]:
    """``"13, 31,43"`` -> {13, 31, 43}; ValueError naming the bad entry."""
    values: set[int] = set()
    for position, part in enumerate(p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isascii() or not part.isdigit() or len(part) > 4:
            raise ValueError(f"ignored XIDs entry {position} {part[:16]!r} is not an XID number (e.g. 13,31,43)")
        values.add(int(part))
    return frozenset(values)
