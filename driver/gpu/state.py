"""Prepare and unprepare claims on this node, crash-safely, without one GPU waiting for another.

A prepare plans (``claim/claimplan.py``, pure), reserves (``reservation.py``, under the claim's per-GPU locks, then
briefly the node lock: the ``PrepareStarted`` record, after which a rescan cannot re-publish its GPUs) and acts under
the per-GPU locks only, each result recorded through the :class:`NodeLedger`: docs/design.md, "The path of a
prepare, hop by hop". Every step is bounded by the call's :class:`Deadline`; when it passes or the kubelet gives up,
or anything fails, the claim is rolled back before the error is returned, so a failed claim leaves no daemon, no
changed GPU setting, no CDI file and no checkpoint entry. A crash leaves a ``PrepareStarted`` record that recovery
(``recovery.py``) rolls back at the next start.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path, PurePosixPath

import cdi
from driver.gpu.claim.claimplan import ClaimPlan, plan_claim
from driver.gpu.claim.claimrecord import allocation_of, started_record
from driver.gpu.claim.healthgate import DeviceTaints, check_device_health
from driver.gpu.claim.rebuild import rebuild_checkpoint
from driver.gpu.claim.tenancy import check_clients
from driver.gpu.claimcdi.edits import CdiNames, CdiSources, claim_spec_file
from driver.gpu.claimcdi.toolkit import ToolkitEdits
from driver.gpu.errors import DriverError, NodeBusy, PrepareError
from driver.gpu.published.devices import make_view
from driver.gpu.published.sharelayout import SharingLayout, plan_timeslices
from driver.gpu.published.targets import NodeView, drop_unfit, merge_layout
from driver.gpu.record.changes import forget_claim
from driver.gpu.record.checkpoint import Checkpoint, CheckpointStore, ClaimPhase, ClaimRecord
from driver.gpu.record.ledger import NodeLedger
from driver.gpu.reservation import Interrupted, Prepared, Replan, Reservation, Reserved, reserve
from driver.gpu.runtime.gpulocks import RESCAN_GPU_WAIT, GpuBusy, GpuLocks
from driver.gpu.runtime.interfaces import ComputeModeControl, MpsDaemons, TimeSlices
from driver.gpu.runtime.mig import MigPartitioner
from driver.gpu.runtime.migclaims import dynamic_devices, own_instances
from driver.gpu.runtime.migruntime import MigRuntime
from driver.gpu.runtime.sharing import SharingRuntime
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.nodelock import LockTimeout, NodeLock
from driver.kubeletplugin.types import DEFAULT_PREPARE_DEADLINE, ClaimRef, Deadline, DeadlineExceeded, PreparedDevice
from driver.units import now

log = logging.getLogger(__name__)

# How long an unprepare waits for its GPUs (a prepare on them is bounded by its own deadline).
UNPREPARE_GPU_WAIT = DEFAULT_PREPARE_DEADLINE + 10.0
_RESERVE_ATTEMPTS = 3
# Stopping a failed prepare's daemons, after its 30 s deadline, before the kubelet's 45 s; once spent,
# a daemon still gets SIGKILL (proc.StopSteps), never left running.
ROLLBACK_BUDGET_S = 8.0


@dataclass(frozen=True)
class StatePaths:
    state_dir: Path  # checkpoint, locks, MPS daemon directories
    cdi_root: Path
    host_root: Path  # where the host's /dev and /proc are visible
    mps_shm_dir: Path | None  # host directory mounted as /dev/shm for MPS clients
    driver_root: Path | None = None  # where this process sees the driver root; None: the driver is on the host
    driver_root_on_host: PurePosixPath | None = None  # the same root's path on the node


class DeviceState:
    """The node's prepared claims and the side effects behind them."""

    def __init__(self, *, driver_name: str, pool_name: str, paths: StatePaths, toolkit: ToolkitEdits,
                 mps: MpsDaemons, timeslicer: TimeSlices, compute_modes: ComputeModeControl, view: NodeView,
                 lock_timeout: float = 10.0, mps_multi_user: bool = False,
                 mig: Callable[[], MigPartitioner] | None = None):
        """``mps_multi_user``: the node's MPS supports multi-user mode (plan daemons then use it); ``mig``
        opens the MIG partitioner of dynamic MIG claims (at the first; None: none can be prepared)."""
        self.mps_multi_user = mps_multi_user
        # True: multi-user mode turned out available while it waited (plan again); the app's (runtime/multiuser.py).
        self.multi_user_gate: Callable[[ClaimPlan, float], bool] = lambda _claim_plan, _seconds: False
        # Published device name -> why it is unhealthy; new claims on those are refused (set by the app).
        self.device_problems: Callable[[], Mapping[str, str]] = dict
        self.device_taints: Callable[[], DeviceTaints] = dict  # a claim may tolerate them
        self.driver_name = driver_name
        self.pool_name = pool_name
        self.paths = paths
        self.toolkit = toolkit
        self.names = CdiNames(driver_name)
        self._view = view
        self._view_mutex = threading.Lock()
        self.node_lock = NodeLock(paths.state_dir / "state.lock", timeout=lock_timeout)
        self.gpu_locks = GpuLocks(paths.state_dir / "gpu-locks")
        self.ledger = NodeLedger(CheckpointStore(paths.state_dir / "checkpoint.json"), self.node_lock,
                                 lambda: rebuild_checkpoint(paths.cdi_root, self.names, pool_name, now()))
        self.sharing = SharingRuntime(mps, timeslicer, compute_modes, self.ledger)
        self.mig = MigRuntime(mig, self.ledger, lambda: self.view.inventory)
        self.cdi_sources = CdiSources(self.names, paths.host_root, toolkit, paths.mps_shm_dir,
                                      paths.driver_root, paths.driver_root_on_host or PurePosixPath("/"))

    # ----------------------------------------------------------------------------- views

    @property
    def view(self) -> NodeView:
        with self._view_mutex:
            return self._view

    def set_view(self, view: NodeView) -> None:
        with self._view_mutex:
            self._view = view

    def set_toolkit(self, toolkit: ToolkitEdits) -> None:
        """Use a regenerated toolkit spec for claims prepared from now on (prepared ones keep theirs)."""
        self.toolkit = toolkit
        self.cdi_sources = replace(self.cdi_sources, toolkit=toolkit)

    def prepared_count(self) -> int:
        """Prepared claims, read without the node lock (for metrics scrapes during a long prepare)."""
        try:
            cp = self.ledger.store.peek()
        except (ValueError, OSError):
            return 0
        return 0 if cp is None else sum(1 for r in cp.claims.values() if r.phase == ClaimPhase.PREPARE_COMPLETED)

    def prepared_claims(self) -> list[ClaimRecord]:
        return list(self.ledger.read().claims.values())

    def apply_layout(self, view: NodeView, desired: SharingLayout,
                     current: Callable[[], bool] = lambda: True) -> tuple[NodeView, set[str]]:
        """Switch to a new inventory/plan, keeping GPUs with prepared claims in their current form; not if
        ``current()`` says, under the node lock, that the inventory is stale (the view in force stays).

        Returns the view now in force and the GPUs whose change was deferred. Plan time slices
        are applied or reset here, when the plan changes, not at prepare: each under its GPU's
        lock after the node lock is released; a GPU that stays busy is left to the next rescan.
        """
        with self.node_lock.held():
            if not current():
                return self.view, set()
            cp = self.ledger.load_locked()
            busy = {key for rec in cp.claims.values() for key in rec.held_layout_keys}
            effective, deferred = merge_layout(self.view.layout, desired, busy)
            effective, unfit = drop_unfit(effective, desired, view.inventory)
            new_view = make_view(view.inventory, effective, self.mps_multi_user, own_instances(cp, view.inventory))
            if cp.layout != effective:  # rescans mostly change nothing: no write then
                cp.layout = dict(effective)
                self.ledger.store.save(cp)
            self.set_view(new_view)
        for uuid in sorted(unfit):
            log.error("the GPU's MIG mode changed under its prepared claims, so their form cannot keep it; "
                      "published as it now is: delete their pods", extra={
                          "gpu_uuid": uuid, "claims": sorted(r.uid for r in cp.claims.values() if uuid in r.gpu_uuids)})
        deferred -= unfit
        for uuid in sorted(deferred):
            log.warning("sharing plan change for this GPU deferred until its prepared claims are gone",
                        extra={"gpu_uuid": uuid})
        self._apply_plan_timeslices(effective)
        return new_view, deferred

    def _apply_plan_timeslices(self, layout: SharingLayout) -> None:
        desired = plan_timeslices(layout)
        recorded = self.ledger.read().plan_timeslices
        for uuid in sorted(set(recorded) | set(desired)):
            if recorded.get(uuid) == desired.get(uuid):
                continue
            try:
                with self.gpu_locks.held([uuid], RESCAN_GPU_WAIT, "changing the plan's time slice"):
                    self.sharing.set_plan_timeslice(uuid, desired.get(uuid))
            except GpuBusy as exc:
                log.info("plan time slice left to the next rescan", extra={"gpu_uuid": uuid, "reason": str(exc)})

    # ----------------------------------------------------------------------------- prepare

    def prepare(self, claim: ResourceClaim, deadline: Deadline | None = None) -> list[PreparedDevice]:
        deadline = deadline or Deadline.after(DEFAULT_PREPARE_DEADLINE)
        uid = claim.metadata.uid
        # Refused before anything starts: a node that cannot give containers libcuda would otherwise
        # start a daemon and change a compute mode only to roll them back at the CDI step.
        if self.toolkit.readiness_problem is not None and claim.results_for(self.driver_name):
            raise PrepareError(self.toolkit.readiness_problem)
        try:
            for _ in range(_RESERVE_ATTEMPTS):
                claim_plan, view, gpus = self._claim_plan(claim)
                if claim_plan is None:
                    return []
                if self.multi_user_gate(claim_plan, deadline.remaining()):
                    continue
                # Every call, a claim already prepared included: the kubelet sends it again after its own
                # restart, with the pods then reserved. Before any lock or side effect: it reads pods.
                check_clients(claim, claim_plan, deadline)
                with self.gpu_locks.held(gpus, deadline.remaining(), f"preparing claim {uid}"):
                    devices = self._prepare_holding(claim, gpus, deadline, (view, claim_plan))
                if devices is not None:
                    return devices
        except (NodeBusy, LockTimeout, DeadlineExceeded) as exc:
            raise PrepareError(f"{exc}; nothing was left prepared, the kubelet will retry") from exc
        raise PrepareError("the claim's devices changed form while it was being prepared; the kubelet will retry")

    def _claim_plan(self, claim: ResourceClaim) -> tuple[ClaimPlan | None, NodeView, list[str]]:
        """The plan, the view it was made against, and the GPUs to lock (the plan's and a previous attempt's)."""
        with self.node_lock.held():
            view = self.view
            claim_plan = plan_claim(claim, driver_name=self.driver_name, pool_name=self.pool_name, view=view,
                                    multi_user=self.mps_multi_user)
            existing = self.ledger.load_locked(shared=True).claims.get(claim.metadata.uid)
        gpus = set(claim_plan.gpu_uuids if claim_plan else []) | (existing.gpu_uuids if existing else set())
        return claim_plan, view, sorted(gpus)

    def _prepare_holding(self, claim: ResourceClaim, gpus: list[str], deadline: Deadline,
                         planned: tuple[NodeView, ClaimPlan]) -> list[PreparedDevice] | None:
        """Prepare with ``gpus`` locked; None if the plan no longer matches them (the caller plans again).

        ``planned``: the plan made before the locks were taken, and the view it was made against."""
        deadline.check("reserving the claim's devices")
        reservation = self.ledger.commit(partial(self._reserve, claim=claim, gpus=gpus, planned=planned),
                                         durable=False)  # why not durable: reservation.py
        match reservation:
            case Replan():
                return None
            case Prepared(record, claim_plan):
                return self._serve_prepared(claim, record, claim_plan)
            case Interrupted(record):
                self._roll_back_interrupted(record, deadline)
                return None
            case Reserved(claim_plan, record):
                return self._run_reserved(claim_plan, record, deadline)

    def _reserve(self, cp: Checkpoint, claim: ResourceClaim, gpus: list[str],
                 planned: tuple[NodeView, ClaimPlan]) -> Reservation:
        # Planned and reserved in one node-lock section: a rescan changes the published form of
        # a GPU under the same lock, so a device cannot change form between the two. Views are
        # replaced, never changed, so the same view object means the earlier plan still holds.
        view, checked = planned
        claim_plan: ClaimPlan | None = checked
        if self.view is not view:
            claim_plan = plan_claim(claim, driver_name=self.driver_name, pool_name=self.pool_name, view=self.view,
                                    multi_user=self.mps_multi_user)
        return reserve(cp, claim.metadata.uid, claim_plan, checked=checked, gpus=gpus,
                       check_health=lambda p: check_device_health(p, self.device_problems(), self.device_taints()),
                       started=lambda p: started_record(p, self.names, self.pool_name,
                                                        self.view.inventory.driver_version, now()))

    def _serve_prepared(self, claim: ResourceClaim, record: ClaimRecord, claim_plan: ClaimPlan) -> list[PreparedDevice]:
        if allocation_of(record) != allocation_of(started_record(claim_plan, self.names, self.pool_name, None, "")):
            # Served as recorded, the pod would get the old devices and limits, not what the scheduler counted.
            raise PrepareError(f"claim {claim.metadata.namespace}/{claim.metadata.name} ({claim.metadata.uid}) is "
                               "already prepared with another allocation; delete the pod so it is unprepared first")
        try:
            self.ensure_claim_runtime(record)
        except Exception as exc:
            raise _user_error(exc) from exc
        return [d.device for d in record.devices]

    def _roll_back_interrupted(self, record: ClaimRecord, deadline: Deadline) -> None:
        log.info("rolling back an interrupted prepare before retrying it", extra={"claim_uid": record.uid})
        try:
            self.undo(record, deadline)
            self.ledger.commit(partial(forget_claim, uid=record.uid))
        except Exception as exc:
            # The record stays: the next retry or the next start rolls back again.
            raise _user_error(exc) from exc

    def _run_reserved(self, claim_plan: ClaimPlan, record: ClaimRecord, deadline: Deadline) -> list[PreparedDevice]:
        try:
            # Dynamic MIG instances first: the plan's MPS daemons serve them (migruntime.py).
            claim_plan, record = self.mig.create_for_claim(claim_plan, record, deadline)
            self.sharing.start_for_claim(claim_plan, deadline)
            deadline.check("writing the CDI spec")
            self.write_cdi(record, self.ledger.read())
            deadline.check("recording the prepared claim")
            self.ledger.commit(partial(_complete, uid=record.uid))
        except Exception as exc:
            self._roll_back_failed_prepare(record)
            raise _user_error(exc) from exc
        return [d.device for d in record.devices]

    def _roll_back_failed_prepare(self, record: ClaimRecord) -> None:
        try:
            self.undo(record, Deadline.after(ROLLBACK_BUDGET_S))
        except Exception:
            # Keep the PrepareStarted record: the next prepare of this claim, or the next start,
            # retries the rollback. The user still gets the original error.
            log.exception("rolling back a failed prepare failed too; it is retried later",
                          extra={"claim_uid": record.uid})
            return
        try:
            self.ledger.commit(partial(forget_claim, uid=record.uid))
        except Exception:  # the record left is handled by the next prepare or start; the user gets the cause
            log.exception("forgetting a rolled-back prepare failed", extra={"claim_uid": record.uid})

    def write_cdi(self, record: ClaimRecord, cp: Checkpoint) -> None:
        spec = claim_spec_file(self.cdi_sources, record, cp.mps_daemons, cp.layout)
        # Not fsynced: readers and a kill -9 see the whole file (the page cache survives a process),
        # and after a power failure a spec that is missing or torn is written again at start from
        # the durable PrepareCompleted record (ensure_claim_runtime), which the kubelet's answer
        # waits for. Most nodes keep CDI specs on a tmpfs (/var/run/cdi), where fsync does nothing.
        cdi.write_spec_text(self.paths.cdi_root, record.cdi_spec_file, spec.text, durable=False, sync_data=False)

    def ensure_claim_runtime(self, record: ClaimRecord) -> tuple[bool, list[str]]:
        """Make a completed claim whole again: its MIG instances there, its daemons running and its CDI spec on disk,
        whole (written again for instances created again: their ids and MIG UUIDs changed)."""
        try:
            remade = self.mig.ensure_instances(record)
        except Exception:
            # An instance of the claim is gone (its ids forgotten) and could not be made again: after a reboot another
            # tool took its placement first. Its spec names capability nodes by GI/CI ids NVML may have handed to that
            # tool's instance: a container started from the kubelet's cached CDI ids must find nothing rather than
            # open it. (A claim whose ids still stand, e.g. NVML did not answer a listing, keeps its spec.)
            current = self.ledger.read().claims.get(record.uid, record)
            if any(d.mig_gi_id is None and not d.admin_access for _, d, _ in dynamic_devices(current)):
                cdi.remove_spec(self.paths.cdi_root, record.cdi_spec_file)
            raise
        record = self.ledger.read().claims.get(record.uid, record) if remade else record
        restarted = self.sharing.ensure_claim_daemons(record)
        recreated = False
        if remade or restarted or not cdi.spec_file_intact(self.paths.cdi_root / record.cdi_spec_file):
            self.write_cdi(record, self.ledger.read())
            recreated = True
        return recreated, restarted

    # ----------------------------------------------------------------------------- unprepare

    def unprepare(self, ref: ClaimRef) -> None:
        record = self.ledger.read().claims.get(ref.uid)
        if record is None:
            # Never prepared here, or already unprepared: still make sure no spec is left.
            cdi.remove_spec(self.paths.cdi_root, self.names.spec_file_name(ref.uid))
            return
        with self.gpu_locks.held(record.gpu_uuids, UNPREPARE_GPU_WAIT, f"unpreparing claim {ref.uid}"):
            current = self.ledger.read().claims.get(ref.uid)
            if current is None:
                return
            self.undo(current)
            self.ledger.commit(partial(forget_claim, uid=ref.uid))

    def undo(self, record: ClaimRecord, deadline: Deadline | None = None) -> None:
        """Reverse everything ``record`` may have done (stops within ``deadline``); idempotent. GPU locks held.
        Daemons stop before the MIG instances they serve go; the record (the caller drops it) outlives both."""
        self.sharing.release_claim(record, deadline)
        self.mig.release_claim(record, deadline)
        cdi.remove_spec(self.paths.cdi_root, record.cdi_spec_file)


def _complete(cp: Checkpoint, uid: str) -> None:
    record = cp.claims[uid]
    record.phase = ClaimPhase.PREPARE_COMPLETED
    record.updated_at = now()


def _user_error(exc: Exception) -> Exception:
    """The error the kubelet shows the user: expected failures keep their own message."""
    if isinstance(exc, PrepareError):
        return exc
    if isinstance(exc, DeadlineExceeded):
        return PrepareError(f"{exc}; the claim's work was rolled back, the kubelet will retry")
    if isinstance(exc, DriverError | LockTimeout | OSError):
        return PrepareError(str(exc))
    return exc
