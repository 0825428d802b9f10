"""The checkpoint's changes of one field each, given to :meth:`NodeLedger.commit` bound with ``functools.partial``
(see ``ledger.py``). Changes that need a layer's own knowledge live beside its code, written the same way."""

from __future__ import annotations

from driver.gpu.claimconfig.choices import TimeSliceInterval
from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.mps.model import MpsDaemonRecord
from driver.gpu.record.checkpoint import Checkpoint


def forget_claim(cp: Checkpoint, uid: str) -> None:
    cp.claims.pop(uid, None)


def record_daemon(cp: Checkpoint, daemon_id: str, record: MpsDaemonRecord) -> None:
    cp.mps_daemons[daemon_id] = record


def forget_daemon(cp: Checkpoint, daemon_id: str) -> None:
    cp.mps_daemons.pop(daemon_id, None)
    cp.mps_limits_unconfirmed.pop(daemon_id, None)


def limits_unconfirmed(cp: Checkpoint, daemon_id: str, why: str) -> None:
    cp.mps_limits_unconfirmed[daemon_id] = why


def limits_confirmed(cp: Checkpoint, daemon_id: str) -> None:
    cp.mps_limits_unconfirmed.pop(daemon_id, None)


def remember_mode(cp: Checkpoint, uuid: str, mode: ComputeMode) -> None:
    cp.compute_modes.setdefault(uuid, mode)


def forget_mode(cp: Checkpoint, uuid: str) -> None:
    cp.compute_modes.pop(uuid, None)


def record_plan_timeslice(cp: Checkpoint, uuid: str, interval: TimeSliceInterval) -> None:
    cp.plan_timeslices[uuid] = interval


def forget_plan_timeslice(cp: Checkpoint, uuid: str) -> None:
    cp.plan_timeslices.pop(uuid, None)


def forget_gpu_settings(cp: Checkpoint) -> None:
    """After a reboot: no plan time slice is applied, and every GPU the driver set is back in its DEFAULT mode."""
    cp.plan_timeslices.clear()
    for uuid in cp.compute_modes:
        cp.compute_modes[uuid] = ComputeMode.DEFAULT


def record_boot(cp: Checkpoint, boot_id: str | None) -> None:
    cp.boot_id = boot_id
