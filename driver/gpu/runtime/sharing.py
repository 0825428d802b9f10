"""The running side of GPU sharing: MPS daemons, compute modes and time slices, kept in the checkpoint.

Callers hold the per-GPU locks of every GPU they touch (``gpulocks.py``) and never the node lock:
the work here runs processes. Each result is recorded through a :class:`Ledger`, which takes the
node lock only for the checkpoint write, so the records of GPUs one holds are stable while other
GPUs' claims change theirs. What must survive a crash is recorded *before* the change (a
compute mode's previous value, a time slice, a claim's intended daemons in its PrepareStarted
record), the rest right after it.

Plan MPS shares use one daemon per GPU, started by the first share's prepare and stopped after
the last share's unprepare (its users are the claims that list it, so the count is derived,
never stored). Per-claim MPS config gets one daemon per claim and config group. A whole GPU is
EXCLUSIVE_PROCESS while any claim's daemon serves it (``computemode.py``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import suppress
from functools import partial
from typing import Protocol

from driver.gpu.claim.claimplan import ClaimPlan
from driver.gpu.claimconfig.choices import TimeSliceInterval
from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.mps.limits import DriftNotRestored, LimitDrift
from driver.gpu.mps.model import MpsBusy, MpsDaemonRecord, MpsDaemonSpec, MpsDaemonStopped, MpsNoAnswer
from driver.gpu.record.changes import (
    forget_daemon,
    forget_gpu_settings,
    forget_mode,
    forget_plan_timeslice,
    limits_confirmed,
    limits_unconfirmed,
    record_daemon,
    record_plan_timeslice,
    remember_mode,
)
from driver.gpu.record.checkpoint import Checkpoint, ClaimRecord
from driver.gpu.runtime.computemode import ComputeModeError
from driver.gpu.runtime.interfaces import ComputeModeControl, DaemonReports, MpsDaemons, ServedClaim, TimeSlices
from driver.gpu.runtime.limitconfirm import LimitConfirmations
from driver.kubeletplugin.types import Deadline
from driver.units import now

log = logging.getLogger(__name__)

# What a prepare that reuses a running daemon waits for its limits' read-back (milliseconds normally).
_READ_BACK_S = 1.5
# What one watcher check of a running daemon may take: it holds the daemon's GPU locks meanwhile, and a
# prepare on those GPUs waits for them. Normally tens of milliseconds; more means a client holds the socket.
WATCH_CHECK_S = 2.0
# The same while the last check already failed (a client keeps the socket): a shorter look
# each round, so prepares on those GPUs wait less for the locks, long enough to catch the socket free.
_WATCH_RECHECK_S = 1.0


class Ledger(Protocol):
    """The checkpoint as the runtime sees it."""

    def read(self) -> Checkpoint:
        """The current checkpoint, for reading only (it is the ledger's cached copy)."""
        ...

    def commit(self, change: Callable[[Checkpoint], None]) -> None:
        """Apply ``change`` (a change as ``record/ledger.py`` says) under the node lock and save it."""
        ...


def _same_limits(running: MpsDaemonSpec, wanted: MpsDaemonSpec) -> bool:
    """Whether a running shared daemon can serve ``wanted``. A changed multi-user setting (a driver
    upgrade) or /dev/shm size (its tmpfs is sized once, when mounted) is not worth restarting it under
    the claims it serves; it applies from its next start."""
    return running.model_copy(update={"multi_user": wanted.multi_user, "shm_size": wanted.shm_size}) == wanted


def _exclusive_users(cp: Checkpoint, gpu_uuid: str, other_than: str) -> list[str]:
    return [c.uid for c in cp.claims.values() if c.uid != other_than and gpu_uuid in c.exclusive_gpus]


class NoReports:
    """Reports go to the log only (the app installs its own, with metrics and Events)."""

    def limits_reverted(self, daemon_id: str, drift: Sequence[LimitDrift], claims: Sequence[ServedClaim]) -> None:
        log.warning("MPS daemon limits changed by a client were restored", extra={
            "daemon_id": daemon_id, "drift": [d.describe() for d in drift], "claims": [c.uid for c in claims]})

    def daemon_restarted(self, daemon_id: str, claims: Sequence[ServedClaim]) -> None:
        log.warning("MPS daemon restarted", extra={"daemon_id": daemon_id, "claims": [c.uid for c in claims]})

    def limits_unconfirmed(self, daemon_id: str, reason: str, claims: Sequence[ServedClaim], first: bool) -> None:
        log.warning("MPS daemon limits unconfirmed", extra={"daemon_id": daemon_id, "reason": reason,
                                                            "claims": [c.uid for c in claims]})

    def limits_confirmed(self, daemon_id: str, claims: Sequence[ServedClaim]) -> None:
        log.info("MPS daemon limits confirmed again", extra={"daemon_id": daemon_id})


class SharingRuntime:
    def __init__(self, mps: MpsDaemons, timeslicer: TimeSlices, compute_modes: ComputeModeControl, ledger: Ledger):
        self.mps = mps
        self.timeslicer = timeslicer
        self.compute_modes = compute_modes
        self._ledger = ledger
        self.reports: DaemonReports = NoReports()  # the app's: log lines, metrics and Events
        self.confirmations = LimitConfirmations()  # the app sets the watch interval

    # ----------------------------------------------------------------------------- prepare

    def start_for_claim(self, claim_plan: ClaimPlan, deadline: Deadline) -> None:
        """Do the plan's side effects; its PrepareStarted record already names every one of them."""
        for daemon in claim_plan.daemons:
            self.hold_exclusive(daemon.exclusive_gpus, deadline)
            deadline.check(f"starting MPS daemon {daemon.daemon_id}")
            self.ensure_daemon(daemon.spec, reuse_running=daemon.shared, deadline=deadline)
        if claim_plan.timeslice is not None:
            deadline.check("setting the time slice")
            self.timeslicer.apply(list(claim_plan.timeslice.gpu_uuids), claim_plan.timeslice.interval, deadline)

    def hold_exclusive(self, gpu_uuids: Sequence[str], deadline: Deadline | None = None) -> None:
        """Put each GPU in EXCLUSIVE_PROCESS, recording its previous mode first."""
        for uuid in gpu_uuids:
            if uuid in self._ledger.read().compute_modes:
                continue  # already ours: another daemon serves this GPU
            if deadline is not None:
                deadline.check(f"setting the compute mode of {uuid}")
            previous = self.compute_modes.get(uuid, deadline)
            self._ledger.commit(partial(remember_mode, uuid=uuid, mode=previous))
            if previous == ComputeMode.EXCLUSIVE_PROCESS:
                continue
            try:
                self.compute_modes.set(uuid, ComputeMode.EXCLUSIVE_PROCESS, deadline)
            except ComputeModeError:
                # A refused change leaves the mode as it was: forget the record so the rollback does
                # not set it again for nothing. If the mode cannot even be read, keep it.
                with suppress(ComputeModeError):
                    if self.compute_modes.get(uuid) == previous:
                        self._ledger.commit(partial(forget_mode, uuid=uuid))
                raise
            log.info("compute mode set for MPS", extra={"gpu_uuid": uuid, "previous": previous.value})

    def ensure_daemon(self, spec: MpsDaemonSpec, reuse_running: bool = True,
                      deadline: Deadline | None = None) -> MpsDaemonRecord:
        """With ``reuse_running``, keep the recorded daemon if it runs with these limits; otherwise (re)start it.

        A (re)start is bounded by what is left of ``deadline``, so a daemon that never answers fails
        the claim inside the prepare's deadline rather than after it."""
        existing = self._ledger.read().mps_daemons.get(spec.daemon_id)
        if reuse_running and existing is not None and _same_limits(existing.spec, spec):
            # A client may have changed its limits since (a tenant root in its container can): read them
            # back, a few milliseconds with NVIDIA's binary. Stopped by a client: restarted at once.
            return self._keep_running(existing, deadline, limits=True)
        if existing is None and reuse_running and (adopted := self.mps.adopt(spec, deadline)) is not None:
            record = adopted  # its record was lost with a corrupt checkpoint: its clients keep it
        else:
            if existing is not None:
                self.mps.stop(existing, deadline)
            else:
                # A daemon left by a crash between its start and its record.
                self.mps.stop_by_id(spec.daemon_id, deadline)
            record = self.mps.start(spec, deadline)
            self.confirmations.confirmed(spec.daemon_id)
            if reuse_running and not spec.multi_user:
                log.warning("MPS daemon for plan shares started single-user: it serves one Linux UID at a time, "
                            "a client of another UID waits until the first UID's clients finish (mpsMultiUser=false)",
                            extra={"daemon_id": spec.daemon_id, "gpu_uuids": spec.gpu_uuids})
        self._ledger.commit(partial(record_daemon, daemon_id=spec.daemon_id, record=record))
        return record

    # ----------------------------------------------------------------------------- unprepare

    def release_claim(self, record: ClaimRecord, deadline: Deadline | None = None) -> None:
        """Stop what only this claim needed; every step is idempotent. Daemon stops share ``deadline``
        (a rollback's budget), each still ending its daemon with SIGKILL once it has passed."""
        for daemon_id in record.mps_daemon_ids:
            if not any(c.uid != record.uid for c in self._ledger.read().claims_using(daemon_id)):
                self.stop_daemon(daemon_id, deadline)
        if record.timeslice is not None:
            self.timeslicer.reset(record.timeslice.gpu_uuids)
        for uuid in record.exclusive_gpus:
            if not _exclusive_users(self._ledger.read(), uuid, other_than=record.uid):
                self.restore_compute_mode(uuid)

    def restore_compute_mode(self, uuid: str) -> None:
        previous = self._ledger.read().compute_modes.get(uuid)
        if previous is None:
            return
        if previous != ComputeMode.EXCLUSIVE_PROCESS:
            self.compute_modes.set(uuid, previous)
            log.info("compute mode restored", extra={"gpu_uuid": uuid, "mode": previous.value})
        self._ledger.commit(partial(forget_mode, uuid=uuid))

    def stop_daemon(self, daemon_id: str, deadline: Deadline | None = None) -> None:
        daemon = self._ledger.read().mps_daemons.get(daemon_id)
        if daemon is None:
            self.mps.stop_by_id(daemon_id, deadline)
            return
        self.mps.stop(daemon, deadline)
        self.confirmations.forget(daemon_id)
        self._ledger.commit(partial(forget_daemon, daemon_id=daemon_id))

    # ----------------------------------------------------------------------------- recovery and rescans

    def ensure_claim_daemons(self, record: ClaimRecord) -> list[str]:
        """Adopt the claim's live daemons, restart dead ones. Returns the restarted ids."""
        return [daemon_id for daemon_id in record.mps_daemon_ids if self.revive_daemon(daemon_id)]

    def revive_daemon(self, daemon_id: str, limits: bool = False) -> bool:
        """Restart the recorded daemon if it died, and with ``limits`` revert limits a client changed;
        True if it was restarted."""
        daemon = self._ledger.read().mps_daemons.get(daemon_id)
        if daemon is None:
            return False
        return self._keep_running(daemon, None, limits) is not daemon

    def _keep_running(self, daemon: MpsDaemonRecord, deadline: Deadline | None, limits: bool) -> MpsDaemonRecord:
        """``daemon`` if it runs (its limits read back and restored first, with ``limits``), else the
        restarted one, recorded. Each drift and restart is reported."""
        daemon_id = daemon.spec.daemon_id
        if limits and self.mps.process_running(daemon):
            if deadline is not None and self.confirmations.fresh(daemon_id):
                return daemon  # the watcher read them back within its interval: no control command needed
            if deadline is not None and self.confirmations.drifted(daemon_id) is not None:
                self._unconfirmed(daemon_id, first=False)  # the joining claim is told too; no wait for the socket
                return daemon
            try:
                # A prepare gives the read-back little time: it takes milliseconds unless a client holds the
                # daemon's one control session, which must not fail the claim (its limits are watched).
                watch = _WATCH_RECHECK_S if self.confirmations.failing(daemon_id) else WATCH_CHECK_S
                bound = Deadline.after(watch) if deadline is None else deadline.capped(_READ_BACK_S)
                drift = self.mps.check_and_restore_limits(daemon, bound)
            except MpsDaemonStopped as exc:  # a client stopped it after the /proc check: restart it below
                log.warning("MPS daemon stopped while its limits were read back; restarting it",
                            extra={"daemon_id": daemon_id, "reason": str(exc)})
            except DriftNotRestored as exc:
                # Found changed; setting them back was not confirmed. Reported now; a refusal fails the caller.
                self._report(partial(self.reports.limits_reverted, daemon_id, exc.drift, self._served_by(daemon_id)))
                if not isinstance(exc.__cause__, (MpsNoAnswer, MpsBusy)):
                    raise
                if self.confirmations.failed(daemon_id, str(exc)):
                    self._unconfirmed(daemon_id, first=True)
                return daemon
            except (MpsNoAnswer, MpsBusy) as exc:
                log.warning("MPS daemon's limits could not be read back (a client holds its control socket); going on "
                            "with it, they count as changed once unconfirmed for longer than the watch interval",
                            extra={"daemon_id": daemon_id, "reason": str(exc)})
                if self.confirmations.failed(daemon_id, str(exc)):
                    self._unconfirmed(daemon_id, first=True)
                return daemon
            else:
                if drift:
                    self._report(partial(self.reports.limits_reverted, daemon_id, drift, self._served_by(daemon_id)))
                if self.confirmations.confirmed(daemon_id):
                    self._ledger.commit(partial(limits_confirmed, daemon_id=daemon_id))
                    self._report(partial(self.reports.limits_confirmed, daemon_id, self._served_by(daemon_id)))
                return daemon
        try:
            # A prepare (with a deadline) starts it again, for a while, if a client stops it while it
            # starts; a background check leaves that to its next round rather than hold the GPU's lock.
            running = self.mps.ensure_running(daemon, deadline, retry_stopped=deadline is not None)
        except MpsDaemonStopped as exc:
            # A client keeps stopping it (a tenant root in its container): no reason to fail or stall
            # another claim. Its record stays; the watcher and the next prepare start it again.
            log.warning("a client keeps stopping the MPS daemon while it starts; going on without it for now",
                        extra={"daemon_id": daemon_id, "reason": str(exc).splitlines()[0]})
            return daemon
        if running == daemon:
            return daemon
        if self.confirmations.confirmed(daemon_id):  # restarted: its limits were set and read back
            self._ledger.commit(partial(limits_confirmed, daemon_id=daemon_id))
            self._report(partial(self.reports.limits_confirmed, daemon_id, self._served_by(daemon_id)))
        self._ledger.commit(partial(record_daemon, daemon_id=daemon_id, record=running))
        self._report(partial(self.reports.daemon_restarted, daemon_id, self._served_by(daemon_id)))
        return running

    def _unconfirmed(self, daemon_id: str, first: bool) -> None:
        """Report limits that count as drifted for want of a read-back: recorded for `inspect` (first time), and
        each claim the daemon serves that was not told yet (a joining claim included)."""
        reason = self.confirmations.drifted(daemon_id) or ""
        if first:
            since = now()
            self._ledger.commit(partial(limits_unconfirmed, daemon_id=daemon_id, why=f"since {since}: {reason}"))
        served = self._served_by(daemon_id)
        new = set(self.confirmations.not_yet_told(daemon_id, [c.uid for c in served]))
        self._report(partial(self.reports.limits_unconfirmed, daemon_id, reason,
                             [c for c in served if c.uid in new], first))

    def _served_by(self, daemon_id: str) -> list[ClaimRecord]:
        return self._ledger.read().claims_using(daemon_id)

    @staticmethod
    def _report(report: Callable[[], None]) -> None:
        # Reports (log, metrics, Events) are best effort: they never fail the prepare or check behind them.
        try:
            report()
        except Exception:
            log.exception("reporting an MPS daemon change failed")

    def sweep_orphans(self) -> list[str]:
        """Stop daemons no claim refers to, recorded or only left on disk."""
        removed: list[str] = []
        cp = self._ledger.read()
        referenced = {d for r in cp.claims.values() for d in r.mps_daemon_ids}
        for daemon_id in sorted(set(cp.mps_daemons) - referenced):
            if self._best_effort(f"stopping orphan MPS daemon {daemon_id}", partial(self.stop_daemon, daemon_id)):
                removed.append(f"mps daemon {daemon_id}")
        recorded = set(self._ledger.read().mps_daemons)
        for daemon_id in self.mps.daemon_ids_on_disk():
            # A referenced daemon without a record survives a checkpoint rebuild: its claim still runs.
            if daemon_id not in recorded and daemon_id not in referenced and self._best_effort(
                    f"stopping MPS daemon left in {daemon_id}", partial(self.mps.stop_by_id, daemon_id)):
                removed.append(f"mps directory {daemon_id}")
        return removed

    def reconcile_compute_modes(self, rebuilt: bool) -> None:
        """Make every GPU's compute mode match the claims: EXCLUSIVE_PROCESS where a daemon serves it,
        the recorded previous mode elsewhere. Best effort per GPU.

        After a checkpoint rebuild the previous modes are unknown; a GPU found in EXCLUSIVE_PROCESS
        is then taken to have been DEFAULT (the mode a node boots with) before this driver set it.
        """
        cp = self._ledger.read()
        wanted = sorted({g for c in cp.claims.values() for g in c.exclusive_gpus})
        for uuid in sorted(set(cp.compute_modes) - set(wanted)):
            self._best_effort(f"restoring the compute mode of {uuid}", partial(self.restore_compute_mode, uuid))
        for uuid in wanted:
            self._best_effort(f"setting the compute mode of {uuid}", partial(self._ensure_exclusive, uuid, rebuilt))

    def _ensure_exclusive(self, uuid: str, rebuilt: bool) -> None:
        current = self.compute_modes.get(uuid)
        if uuid not in self._ledger.read().compute_modes:
            previous = ComputeMode.DEFAULT if rebuilt and current == ComputeMode.EXCLUSIVE_PROCESS else current
            self._ledger.commit(partial(remember_mode, uuid=uuid, mode=previous))
        if current != ComputeMode.EXCLUSIVE_PROCESS:
            self.compute_modes.set(uuid, ComputeMode.EXCLUSIVE_PROCESS)

    def after_reboot(self) -> None:
        """GPU settings do not survive a reboot (NVML: the compute mode "always resets to Default"):
        forget the plan's time slices and the modes recorded before it, re-apply each claim's time slice."""
        self._ledger.commit(forget_gpu_settings)
        for record in self._ledger.read().claims.values():
            if record.timeslice is not None:
                ts = record.timeslice
                self._best_effort(f"re-applying the time slice of claim {record.uid}",
                                  partial(self.timeslicer.apply, ts.gpu_uuids, ts.interval))

    def set_plan_timeslice(self, uuid: str, interval: TimeSliceInterval | None) -> bool:
        """Apply the plan's time slice to one GPU (None: reset it), recorded once done; False if it failed."""
        if interval is None:
            if any(r.timeslice is not None and uuid in r.timeslice.gpu_uuids
                   for r in self._ledger.read().claims.values()):
                # A claim on the GPU, published whole again, set its own time slice (a reset left to
                # a later rescan comes after it): keep the claim's, forget only the plan's record.
                self._ledger.commit(partial(forget_plan_timeslice, uuid=uuid))
                return True
            done = self._best_effort(f"resetting the time slice of GPU {uuid}", partial(self.timeslicer.reset, [uuid]))
            if done:
                self._ledger.commit(partial(forget_plan_timeslice, uuid=uuid))
            return done
        done = self._best_effort(f"setting the plan's time slice on GPU {uuid}",
                                 partial(self.timeslicer.apply, [uuid], interval))
        if done:
            self._ledger.commit(partial(record_plan_timeslice, uuid=uuid, interval=interval))
        return done

    @staticmethod
    def _best_effort(what: str, action: Callable[[], object]) -> bool:
        """Recovery and rescans keep going past one stuck process or one GPU that refuses a setting."""
        try:
            action()
        except Exception as exc:
            log.error(f"{what} failed; will retry later", extra={"reason": str(exc)})
            return False
        return True
