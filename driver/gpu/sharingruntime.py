"""The running side of GPU sharing: MPS daemons and time slices, kept in step with the checkpoint.

Plan MPS shares use one daemon per GPU, started by the first share's prepare and stopped after
the last share's unprepare (its users are the claims that list it, so the count is derived,
never stored). Per-claim MPS config gets one daemon per claim and config group. A daemon's id is
recorded in the checkpoint *before* it is started, so a crash cannot leak it.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Sequence
from functools import partial

from driver.gpu.checkpoint import Checkpoint, ClaimRecord, TimeSliceRecord
from driver.gpu.configapi import DeviceConfig, Sharing, resolve_mps_limits
from driver.gpu.mps import MpsDaemonRecord, MpsDaemonSpec, MpsManager
from driver.gpu.sharing import SharingLayout, TimeSliceInterval
from driver.gpu.targets import DeviceTarget
from driver.gpu.timeslice import TimeSlicer
from driver.kubeletplugin.claim import DeviceRequestAllocationResult

log = logging.getLogger(__name__)


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def plan_daemon_id(gpu_uuid: str) -> str:
    # Short ids keep MPS socket paths under the 108-byte Unix socket limit.
    return f"plan-{_short_hash(gpu_uuid)}"


def claim_daemon_id(claim_uid: str, group: int) -> str:
    return f"claim-{_short_hash(claim_uid)}-{group}"


def is_plan_daemon(daemon_id: str) -> bool:
    return daemon_id.startswith("plan-")


ConfigGroups = Sequence[tuple[DeviceConfig, Sequence[DeviceRequestAllocationResult]]]


def daemons_needed(claim_uid: str, targets: Sequence[DeviceTarget], groups: ConfigGroups) -> list[str]:
    """The MPS daemons a claim's devices would be served by (plan daemons per GPU, one per MPS config group)."""
    by_name = {t.name: t for t in targets}
    needed = {plan_daemon_id(t.gpu.uuid) for t in targets if t.kind == "mps"}
    for index, (config, results) in enumerate(groups):
        if config.sharing is not None and config.sharing.strategy == "MPS" and any(
                by_name[r.device].kind in ("gpu", "mig") for r in results):
            needed.add(claim_daemon_id(claim_uid, index))
    return sorted(needed)


class SharingRuntime:
    def __init__(self, mps: MpsManager, timeslicer: TimeSlicer, save: Callable[[Checkpoint], None]):
        self.mps = mps
        self.timeslicer = timeslicer
        self._save = save

    def start_for_claim(self, record: ClaimRecord, cp: Checkpoint, targets: Sequence[DeviceTarget],
                        groups: ConfigGroups) -> None:
        by_name = {t.name: t for t in targets}
        dev_by_name = {d.device.device_name: d for d in record.devices}
        for target in targets:
            if target.kind != "mps" or target.shares is None:
                continue
            shares = target.shares
            spec = MpsDaemonSpec(daemon_id=plan_daemon_id(target.gpu.uuid), gpu_uuids=[target.gpu.uuid],
                                 active_thread_percentage=shares.active_thread_percentage,
                                 pinned_memory_limits={target.gpu.uuid: shares.memory_bytes_per_share})
            if spec.daemon_id not in record.shared_mps_daemons:
                record.shared_mps_daemons.append(spec.daemon_id)
            self.ensure_daemon(cp, spec)
            dev_by_name[target.name].mps_daemon_id = spec.daemon_id
        for index, (config, results) in enumerate(groups):
            sharing = config.sharing
            group = [by_name[r.device] for r in results if by_name[r.device].kind in ("gpu", "mig")]
            if sharing is None or not group:
                continue
            if sharing.strategy == "MPS":
                daemon_id = self._start_claim_daemon(record, cp, index, config, group)
                for t in group:
                    dev_by_name[t.name].mps_daemon_id = daemon_id
            elif isinstance(sharing, Sharing) and sharing.strategy == "TimeSlicing":
                timeslicing = sharing.timeSlicingConfig
                interval: TimeSliceInterval = timeslicing.interval if timeslicing else "Default"
                gpu_uuids = sorted({t.gpu.uuid for t in group})
                record.timeslice = TimeSliceRecord(gpu_uuids=gpu_uuids, interval=interval)
                self._save(cp)  # recorded first, so recovery resets it even if we crash mid-command
                self.timeslicer.apply(gpu_uuids, interval)

    def _start_claim_daemon(self, record: ClaimRecord, cp: Checkpoint, index: int, config: DeviceConfig,
                            group: list[DeviceTarget]) -> str:
        assert config.sharing is not None
        daemon_id = claim_daemon_id(record.uid, index)
        uuids = sorted(t.cuda_uuid for t in group)
        mps_config = config.sharing.mpsConfig
        memory = {t.cuda_uuid: t.memory_bytes or 0 for t in group}
        limits = resolve_mps_limits(mps_config, uuids, memory) if mps_config else None
        spec = MpsDaemonSpec(daemon_id=daemon_id, gpu_uuids=uuids,
                             active_thread_percentage=limits.active_thread_percentage if limits else None,
                             pinned_memory_limits=dict(limits.pinned_memory_bytes) if limits else {})
        record.owned_mps_daemons.append(daemon_id)
        self._save(cp)
        self.mps.stop_by_id(daemon_id)  # a daemon left by a crash between its start and its record
        cp.mps_daemons[daemon_id] = self.mps.start(spec)
        self._save(cp)
        return daemon_id

    def ensure_daemon(self, cp: Checkpoint, spec: MpsDaemonSpec) -> MpsDaemonRecord:
        """Adopt the recorded daemon if it runs with these limits; otherwise (re)start it."""
        existing = cp.mps_daemons.get(spec.daemon_id)
        if existing is not None and existing.spec == spec and self.mps.is_running(existing):
            # Its limits and readiness were verified when it started (and again at every driver
            # start); a control round trip per share prepare would cost a process spawn each time.
            return existing
        if existing is not None and existing.spec == spec:
            record = self.mps.ensure_running(existing)
        else:
            if existing is not None:
                self.mps.stop(existing)
            else:
                self.mps.stop_by_id(spec.daemon_id)  # a daemon left by a crash between its start and its record
            record = self.mps.start(spec)
        cp.mps_daemons[spec.daemon_id] = record
        self._save(cp)
        return record

    def release_claim(self, record: ClaimRecord, cp: Checkpoint) -> None:
        """Stop what only this claim needed; every step is idempotent."""
        for daemon_id in record.owned_mps_daemons:
            self.stop_daemon(cp, daemon_id)
        for daemon_id in record.shared_mps_daemons:
            if not any(c.uid != record.uid and daemon_id in c.shared_mps_daemons for c in cp.claims.values()):
                self.stop_daemon(cp, daemon_id)
        if record.timeslice is not None:
            self.timeslicer.reset(record.timeslice.gpu_uuids)

    def stop_daemon(self, cp: Checkpoint, daemon_id: str) -> None:
        daemon = cp.mps_daemons.pop(daemon_id, None)
        if daemon is not None:
            self.mps.stop(daemon)
        else:
            self.mps.stop_by_id(daemon_id)

    def ensure_claim_daemons(self, record: ClaimRecord, cp: Checkpoint) -> list[str]:
        """After a restart: adopt the claim's live daemons, restart dead ones. Returns the restarted ids."""
        restarted: list[str] = []
        for daemon_id in [*record.owned_mps_daemons, *record.shared_mps_daemons]:
            daemon = cp.mps_daemons.get(daemon_id)
            if daemon is None:
                continue
            running = self.mps.ensure_running(daemon)
            if running.pid != daemon.pid:
                restarted.append(daemon_id)
            cp.mps_daemons[daemon_id] = running
        return restarted

    def sweep_orphans(self, cp: Checkpoint) -> list[str]:
        """Stop daemons no claim refers to, recorded or only left on disk."""
        removed: list[str] = []
        referenced = {d for r in cp.claims.values() for d in (*r.owned_mps_daemons, *r.shared_mps_daemons)}
        for daemon_id in sorted(set(cp.mps_daemons) - referenced):
            stopped = self._best_effort(f"stopping orphan MPS daemon {daemon_id}",
                                        partial(self.stop_daemon, cp, daemon_id))
            if stopped:
                removed.append(f"mps daemon {daemon_id}")
        for daemon_id in self.mps.daemon_ids_on_disk():
            # A referenced daemon without a record survives a checkpoint rebuild: its claim still runs.
            if daemon_id not in cp.mps_daemons and daemon_id not in referenced and self._best_effort(
                    f"stopping MPS daemon left in {daemon_id}", partial(self.mps.stop_by_id, daemon_id)):
                removed.append(f"mps directory {daemon_id}")
        return removed

    @staticmethod
    def _best_effort(what: str, action: Callable[[], object]) -> bool:
        """Recovery and rescans keep going past one stuck process or one GPU that refuses a setting."""
        try:
            action()
        except Exception as exc:
            log.error(f"{what} failed; will retry later", extra={"reason": str(exc)})
            return False
        return True

    def check_daemons(self, cp: Checkpoint) -> list[str]:
        """Restart recorded daemons that died (e.g. killed with an old plugin container). Returns their ids."""
        restarted: list[str] = []
        for daemon_id, daemon in sorted(cp.mps_daemons.items()):
            def ensure(d: MpsDaemonRecord = daemon, i: str = daemon_id) -> None:
                running = self.mps.ensure_running(d)
                if running.pid != d.pid:
                    restarted.append(i)
                cp.mps_daemons[i] = running
            self._best_effort(f"checking MPS daemon {daemon_id}", ensure)
        return restarted

    def after_reboot(self, cp: Checkpoint) -> None:
        """GPU settings do not survive a reboot: forget the plan's and re-apply each claim's time slice."""
        cp.plan_timeslices.clear()
        for record in cp.claims.values():
            if record.timeslice is not None:
                ts = record.timeslice
                self._best_effort(f"re-applying the time slice of claim {record.uid}",
                                  partial(self.timeslicer.apply, ts.gpu_uuids, ts.interval))

    def apply_plan_timeslices(self, cp: Checkpoint, layout: SharingLayout) -> None:
        """Set the plan's time slices on GPUs entering a time-slicing plan, reset those leaving it."""
        desired = {uuid: s.interval or "Default" for uuid, s in layout.items() if s.strategy == "TimeSlicing"}
        # Per GPU, recorded as soon as it is done: one GPU refusing (e.g. no compute-policy support)
        # neither blocks the others nor loses track of what was already changed.
        for uuid in sorted(set(cp.plan_timeslices) - set(desired)):
            if self._best_effort(f"resetting the time slice of GPU {uuid}", partial(self.timeslicer.reset, [uuid])):
                del cp.plan_timeslices[uuid]
        for uuid, interval in sorted(desired.items()):
            if cp.plan_timeslices.get(uuid) != interval and self._best_effort(
                    f"setting the plan's time slice on GPU {uuid}",
                    partial(self.timeslicer.apply, [uuid], interval)):
                cp.plan_timeslices[uuid] = interval
