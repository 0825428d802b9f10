"""Per-claim GPU usage: the GPU's processes attributed to the claims prepared for their pods.

Pure logic. A process belongs to a claim when its pod (from its cgroup) is one the claim was
reserved for at prepare and it runs on one of the claim's devices (the GPU, or the MIG device by
its UUID). Each claim device's usage is set against what it is entitled to: the whole GPU or MIG
device's memory, an MPS share's pinned memory limit and active thread percentage, a consumable
share's consumed memory, or a time-slice share's equal part of the GPU (1/count of its memory
and SMs), which nothing enforces: time slicing only shares the GPU's time, every process still
sees all of its memory (NVIDIA GPU sharing docs, "Time-Slicing": "no memory or fault-isolation").

What NVML cannot attribute (SM use on a MIG device or under MPS, memory it gave no figure for) stays unknown
(None), never zero, and never makes an entitlement exceeded: docs/operations.md, "What is measured, and what cannot
be". The MPS servers of the driver's own daemons serve every claim of their GPU, so none of them is any claim's; an
admin-access device holds no share, so it is reported without an entitlement.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass

from driver.gpu.claimconfig.choices import DeviceKind
from driver.gpu.published.sharelayout import Enforcement, GpuForm
from driver.gpu.published.targets import DeviceTarget
from driver.gpu.record.checkpoint import ClaimRecord, PreparedDeviceRecord

# A pod's cgroup path names its UID: cgroupfs "/kubepods/burstable/pod<uid>/<container>", the systemd
# driver "kubepods-burstable-pod<uid with '_' for '-'>.slice" (kubelet cgroup_manager_linux.go naming).
_POD_UID = re.compile(r"pod([0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12})")


@dataclass(frozen=True)
class ProcessUsage:
    """One process on one GPU or MIG device (``uuid``), as NVML reports it."""

    pid: int
    uuid: str  # the GPU's UUID, or the MIG device's for a process inside a GPU instance
    memory_bytes: int | None = None  # None: NVML cannot tell (e.g. without permission on Windows/WSL)
    sm_percent: float | None = None  # None: no utilisation sample for it
    pod_uid: str | None = None  # None: not a pod's process (or its cgroup could not be read)
    # Listed by nvmlDeviceGetMPSComputeRunningProcesses: an MPS client, whose SM use NVML gives to the server.
    mps_client: bool = False
    # Its parent (/proc/<pid>/stat): an MPS server is the child of the control daemon that started it.
    parent_pid: int | None = None


# Why a claim device's SM utilisation is unknown (shown by inspect; docs/operations.md, "Per-claim GPU usage").
SM_UNKNOWN_MIG = "MIG device: NVML has no per-process utilisation on MIG"
SM_UNKNOWN_MPS = "MPS: NVML attributes MPS clients' SM use to the MPS server"


@dataclass(frozen=True)
class ClaimDeviceUsage:
    namespace: str
    claim: str
    device: str
    kind: str
    pids: tuple[int, ...]
    memory_bytes: int | None  # None when NVML gave no figure for one of the processes
    memory_limit_bytes: int | None  # the limit (enforced) or entitlement (not), None when unknown or none
    sm_percent: float | None  # None when no process had a sample, or NVML cannot attribute it (sm_unknown)
    sm_limit_percent: float | None
    # Whether something holds the processes to the limit whatever they do (MIG, mps-per-process), or only
    # their agreement (mps-advisory, entitlements).
    enforced: bool
    sm_unknown: str | None = None  # why the SM utilisation cannot be known on this device (SM_UNKNOWN_*)
    # An admin-access device: shared for monitoring, it holds no share, so it has no limit or entitlement.
    admin_access: bool = False

    @property
    def over_memory(self) -> bool:
        return (self.memory_bytes is not None and self.memory_limit_bytes is not None
                and self.memory_bytes > self.memory_limit_bytes)

    @property
    def over_sm(self) -> bool:
        return (self.sm_percent is not None and self.sm_limit_percent is not None
                and self.sm_percent > self.sm_limit_percent)

    @property
    def over_entitlement(self) -> list[str]:
        """What the processes use beyond an entitlement nothing enforces ("memory", "sm")."""
        if self.enforced:
            return []
        return [what for what, over in (("memory", self.over_memory), ("sm", self.over_sm)) if over]

    @property
    def judged(self) -> list[str]:
        """The resources whose use can be set against a limit: both known ("memory", "sm").

        Only these get an over-entitlement value: an unknown use is neither over nor within, and an
        admin-access device has nothing to be over.
        """
        known = (("memory", self.memory_bytes is not None and self.memory_limit_bytes is not None),
                 ("sm", self.sm_percent is not None and self.sm_limit_percent is not None))
        return [what for what, ok in known if ok and not self.admin_access]


def pod_uid_from_cgroup(text: str) -> str | None:
    """The pod UID in a ``/proc/<pid>/cgroup`` file, None for a process outside any pod."""
    for line in text.splitlines():
        match = _POD_UID.search(line.rsplit(":", 1)[-1])
        if match:
            return match.group(1).replace("_", "-")
    return None


def _entitlement(claim: ClaimRecord, record: PreparedDeviceRecord, target: DeviceTarget | None,
                 shares: GpuForm | None) -> tuple[int | None, float | None, bool]:
    """(memory bytes, SM percent, enforced) a claim's device is entitled to.

    Enforced means it holds against the clients the share admitted: a whole GPU or MIG device, or an
    MPS share whose daemon none of them can retune or bypass (``mps-per-process``, recorded at
    prepare by claim/tenancy.py). An advisory MPS limit (clients any, a driver branch whose daemon takes
    settings from any UID, a consumable share's GPU in DEFAULT mode) and an entitlement are not.
    An admin-access device has none: its claim holds no share of the device (docs/sharing.md).
    """
    if record.admin_access:
        return None, None, False
    whole = target.memory_bytes if target is not None else None
    if record.kind in (DeviceKind.GPU, DeviceKind.MIG):
        return whole, 100.0, True
    if record.kind == DeviceKind.CONSUMABLE:
        gpu = target.gpu if target is not None else None
        sm = None
        if record.consumed_multiprocessors is not None and gpu is not None and gpu.multiprocessors:
            sm = 100.0 * record.consumed_multiprocessors / gpu.multiprocessors
        return record.consumed_memory_bytes, sm, False
    per_process = record.kind == DeviceKind.MPS and claim.mps_enforcement == Enforcement.MPS_PER_PROCESS
    if shares is None:
        return None, None, per_process
    if record.kind == DeviceKind.MPS:
        sm_limit = float(shares.active_thread_percentage) if shares.active_thread_percentage else None
        return shares.memory_bytes_per_share, sm_limit, per_process
    return shares.memory_bytes_per_share, 100.0 / shares.count, False


def _sm_unknown(record: PreparedDeviceRecord, found: Iterable[ProcessUsage]) -> str | None:
    """Why NVML cannot give the SM utilisation of a claim's processes on this device, None if it can."""
    if record.kind == DeviceKind.MIG or record.mig_uuid is not None:
        return SM_UNKNOWN_MIG
    # Shares are served by an MPS daemon (an admin-access device is not: its processes are no clients);
    # a process NVML lists as an MPS client says so too (a claim running MPS of its own on its GPU).
    served = not record.admin_access and (record.kind in (DeviceKind.MPS, DeviceKind.CONSUMABLE)
                                          or record.mps_daemon_id is not None)
    if served or any(p.mps_client for p in found):
        return SM_UNKNOWN_MPS
    return None


def claim_usage(claims: Iterable[ClaimRecord], processes: Iterable[ProcessUsage],
                targets: Mapping[str, DeviceTarget], layout: Mapping[str, GpuForm],
                mps_daemon_pids: Collection[int] = ()) -> list[ClaimDeviceUsage]:
    """Usage of every prepared claim's devices (zero where none of its pods' processes run).

    ``mps_daemon_pids``: the driver's MPS control daemons; their children are MPS servers, which
    run every client of their GPU (whichever claim), so they count for no claim whatever their pod.
    """
    by_pod_and_uuid: dict[tuple[str, str], list[ProcessUsage]] = {}
    for process in processes:
        if process.pod_uid is not None and process.parent_pid not in mps_daemon_pids:
            by_pod_and_uuid.setdefault((process.pod_uid, process.uuid), []).append(process)
    usage = []
    for record in sorted(claims, key=lambda r: (r.namespace, r.name)):
        for device in record.devices:
            uuid = device.mig_uuid or device.gpu_uuid
            found = [p for pod in record.pod_uids for p in by_pod_and_uuid.get((pod, uuid), [])]
            unknown = _sm_unknown(device, found)
            # A sample there would be no claim's own (MPS: the server's; MIG: none is defined), so none is used.
            samples = [p.sm_percent for p in found if p.sm_percent is not None] if unknown is None else []
            memories = [p.memory_bytes for p in found]
            memory, sm, enforced = _entitlement(record, device, targets.get(device.device.device_name),
                                                layout.get(device.layout_key))
            usage.append(ClaimDeviceUsage(
                namespace=record.namespace, claim=record.name, device=device.device.device_name, kind=device.kind,
                pids=tuple(sorted(p.pid for p in found)),
                memory_bytes=None if None in memories else sum(m for m in memories if m is not None),
                memory_limit_bytes=memory, sm_percent=sum(samples) if samples else None, sm_limit_percent=sm,
                enforced=enforced, sm_unknown=unknown, admin_access=device.admin_access))
    return usage
