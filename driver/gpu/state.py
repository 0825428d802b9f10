"""Prepare and unprepare claims on this node, crash-safely.

Every state change runs under the node lock and follows one pattern: record the intent in the
checkpoint (``PrepareStarted``), do the side effects (MPS daemon, time slice, CDI spec), then
record the outcome (``PrepareCompleted``). A crash between the two leaves a ``PrepareStarted``
record that :meth:`DeviceState.recover` rolls back at the next start; the kubelet then retries
the prepare. A claim whose only side effect is its CDI spec skips the intent record: recovery
removes a spec that no record claims. Any failure inside prepare is rolled back before the
error is returned, so a failed claim leaves no daemon, no CDI file and no checkpoint entry.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path

import cdi
from driver.gpu.cdiedits import MPS_CONTAINER_PIPE_DIR, CdiNames, CdiSources, claim_spec
from driver.gpu.checkpoint import (
    Checkpoint,
    CheckpointCorrupt,
    CheckpointStore,
    ClaimPhase,
    ClaimRecord,
    PreparedDeviceRecord,
    current_boot_id,
)
from driver.gpu.configapi import ConfigError
from driver.gpu.errors import PrepareError
from driver.gpu.hostfs import HostFsError
from driver.gpu.mps import MpsError, MpsManager
from driver.gpu.opaque import group_by_config, resolve_configs
from driver.gpu.rebuild import rebuild_checkpoint
from driver.gpu.sharing import SharingLayout
from driver.gpu.sharingruntime import ConfigGroups, SharingRuntime, daemons_needed
from driver.gpu.targets import DeviceTarget, NodeView, make_view, merge_layout
from driver.gpu.timeslice import TimeSliceError, TimeSlicer
from driver.gpu.toolkit import ToolkitEdits
from driver.kubeletplugin.claim import DeviceRequestAllocationResult, ResourceClaim
from driver.kubeletplugin.nodelock import LockTimeout, NodeLock
from driver.kubeletplugin.types import ClaimRef, PreparedDevice

log = logging.getLogger(__name__)

__all__ = ["DeviceState", "PrepareError", "RecoveryReport", "StatePaths"]


@dataclass(frozen=True)
class StatePaths:
    state_dir: Path  # checkpoint, lock, MPS daemon directories
    cdi_root: Path
    host_root: Path  # where the host's /dev and /proc are visible
    mps_shm_dir: Path | None  # host directory mounted as /dev/shm for MPS clients


@dataclass
class RecoveryReport:
    rolled_back: list[str]
    cdi_recreated: list[str]
    daemons_restarted: list[str]
    orphans_removed: list[str]
    rebuilt_from_cdi: bool = False


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class DeviceState:
    """The node's prepared claims and the side effects behind them."""

    def __init__(self, *, driver_name: str, pool_name: str, paths: StatePaths, toolkit: ToolkitEdits,
                 mps: MpsManager, timeslicer: TimeSlicer, view: NodeView, lock_timeout: float = 10.0):
        self.driver_name = driver_name
        self.pool_name = pool_name
        self.paths = paths
        self.toolkit = toolkit
        self.mps = mps
        self.timeslicer = timeslicer
        self._view = view
        self._view_mutex = threading.Lock()
        self._store = CheckpointStore(paths.state_dir / "checkpoint.json")
        self._lock = NodeLock(paths.state_dir / "state.lock", timeout=lock_timeout)
        self.sharing = SharingRuntime(mps, timeslicer, self._save)
        self.names = CdiNames(driver_name)
        self.cdi_sources = CdiSources(self.names, paths.host_root, toolkit, mps, paths.mps_shm_dir)

    # ----------------------------------------------------------------------------- views

    @property
    def view(self) -> NodeView:
        with self._view_mutex:
            return self._view

    def set_toolkit(self, toolkit: ToolkitEdits) -> None:
        """Use a regenerated toolkit spec for claims prepared from now on (prepared ones keep theirs)."""
        self.toolkit = toolkit
        self.cdi_sources = replace(self.cdi_sources, toolkit=toolkit)

    def prepared_count(self) -> int:
        """Prepared claims, read without the node lock (for metrics scrapes during a long prepare)."""
        try:
            cp = self._store.peek()
        except (ValueError, OSError):
            return 0
        return 0 if cp is None else sum(1 for r in cp.claims.values() if r.phase == ClaimPhase.PREPARE_COMPLETED)

    def prepared_claims(self) -> list[ClaimRecord]:
        with self._lock.held():
            return list(self._load().claims.values())

    def apply_layout(self, view: NodeView, desired: SharingLayout) -> tuple[NodeView, set[str]]:
        """Switch to a new inventory/plan, keeping GPUs with prepared claims in their current form.

        Returns the view now in force and the GPUs whose change was deferred. Plan time slices
        are applied or reset here, when the plan changes, not at prepare.
        """
        with self._lock.held():
            cp = self._load()
            busy = {uuid for rec in cp.claims.values() for uuid in rec.gpu_uuids}
            effective, deferred = merge_layout(self.view.layout, desired, busy)
            new_view = make_view(view.inventory, effective)
            before = (dict(cp.layout), dict(cp.plan_timeslices))
            self.sharing.apply_plan_timeslices(cp, effective)
            cp.layout = dict(effective)
            if (cp.layout, cp.plan_timeslices) != before:  # rescans mostly change nothing: no write then
                self._save(cp)
            with self._view_mutex:
                self._view = new_view
        for uuid in sorted(deferred):
            log.warning("sharing plan change for this GPU deferred until its prepared claims are gone",
                        extra={"gpu_uuid": uuid})
        return new_view, deferred

    # ----------------------------------------------------------------------------- prepare

    def prepare(self, claim: ResourceClaim) -> list[PreparedDevice]:
        uid = claim.metadata.uid
        results = claim.results_for(self.driver_name)
        if not results:
            return []
        with self._lock.held():
            # Resolved under the lock: a rescan changes the published form of a GPU under the same
            # lock, so a device cannot change form between its resolution and its preparation.
            view = self.view
            targets = [self._target_for(r, view) for r in results]
            kinds = {id(r): t.kind for r, t in zip(results, targets, strict=True)}
            try:
                groups = group_by_config(resolve_configs(claim.configs_for(self.driver_name), results,
                                                         lambda r: kinds[id(r)]))
            except ConfigError as exc:
                raise PrepareError(f"invalid opaque configuration: {exc}") from exc
            self._check_share_multiplicity(targets)
            daemons = daemons_needed(uid, targets, groups)
            self._check_one_mps_daemon(daemons)

            cp = self._load()
            existing = cp.claims.get(uid)
            if existing is not None and existing.phase == ClaimPhase.PREPARE_COMPLETED:
                try:
                    self._ensure_claim_runtime(existing, cp)
                except Exception as exc:
                    raise _user_error(exc) from exc
                finally:
                    self._save(cp)
                return [d.device for d in existing.devices]
            if existing is not None:
                log.info("rolling back an interrupted prepare before retrying it", extra={"claim_uid": uid})
                self._undo(existing, cp)
                del cp.claims[uid]
            self._check_overlap(cp, uid, targets)

            record = ClaimRecord(uid=uid, namespace=claim.metadata.namespace, name=claim.metadata.name,
                                 phase=ClaimPhase.PREPARE_STARTED, cdi_spec_file=self.names.spec_file_name(uid),
                                 updated_at=_now())
            for result, target in zip(results, targets, strict=True):
                record.devices.append(self._device_record(uid, result, target))
            cp.claims[uid] = record
            if daemons or _sets_time_slice(targets, groups):
                # The intent is durable before a side effect that outlives the process. A claim
                # whose only side effect is its CDI spec skips this write: a spec without a
                # checkpoint entry is removed as an orphan at the next start.
                self._save(cp)

            try:
                self.sharing.start_for_claim(record, cp, targets, groups)
                self._write_cdi(record, cp)
                record.phase = ClaimPhase.PREPARE_COMPLETED
                record.updated_at = _now()
                self._save(cp)
            except Exception as exc:
                self._roll_back_failed_prepare(record, cp)
                raise _user_error(exc) from exc
            return [d.device for d in record.devices]

    def _roll_back_failed_prepare(self, record: ClaimRecord, cp: Checkpoint) -> None:
        try:
            self._undo(record, cp)
        except Exception:
            # Keep the PrepareStarted record: the next prepare of this claim, or the next start,
            # retries the rollback. The user still gets the original error.
            log.exception("rolling back a failed prepare failed too; it is retried later",
                          extra={"claim_uid": record.uid})
        else:
            cp.claims.pop(record.uid, None)
        self._save(cp)

    @staticmethod
    def _check_one_mps_daemon(needed: list[str]) -> None:
        if len(needed) > 1:
            raise PrepareError(
                f"the claim's devices would be served by {len(needed)} MPS daemons, but a container reaches only "
                f"one (its {MPS_CONTAINER_PIPE_DIR}). Ask for MPS shares of one GPU only, or put all whole GPUs of "
                "the claim under one GpuConfig with sharing.strategy MPS (one daemon serves them all)")

    def _target_for(self, result: DeviceRequestAllocationResult, view: NodeView) -> DeviceTarget:
        if result.pool != self.pool_name:
            raise PrepareError(f"device {result.device!r} was allocated from pool {result.pool!r}, but this node's "
                               f"pool is {self.pool_name!r}; the claim belongs to another node")
        target = view.targets.get(result.device)
        if target is None:
            known = ", ".join(sorted(view.targets)) or "none"
            raise PrepareError(
                f"device {result.device!r} is not published by this node (published: {known}). The allocation is "
                "stale (the GPU or the sharing plan changed); delete the pod so its claim is allocated again")
        return target

    @staticmethod
    def _check_share_multiplicity(targets: list[DeviceTarget]) -> None:
        by_gpu: dict[str, list[DeviceTarget]] = {}
        for t in targets:
            if t.shares is not None and not t.shares.allow_multiple_shares_per_claim:
                by_gpu.setdefault(t.gpu.uuid, []).append(t)
        for group in by_gpu.values():
            if len(group) > 1:
                names = ", ".join(t.name for t in group)
                raise PrepareError(
                    f"the claim holds {len(group)} shares of one GPU ({names}); shares of the same GPU in one claim "
                    "add no capacity (every process still gets one share's limits). Ask for one share, or for a whole "
                    "GPU (DeviceClass gpu.tessera.dev) with GpuConfig.sharing to choose your own limits; the node "
                    "operator can allow this with allowMultipleSharesPerClaim in the sharing plan")

    @staticmethod
    def _check_overlap(cp: Checkpoint, uid: str, targets: list[DeviceTarget]) -> None:
        for other in cp.claims.values():
            if other.uid == uid:
                continue
            taken = {d.device.device_name for d in other.devices}
            for t in targets:
                if t.name in taken:
                    raise PrepareError(
                        f"device {t.name!r} is already prepared for claim {other.namespace}/{other.name} "
                        f"({other.uid}); the allocation is stale, delete the pod so its claim is allocated again")

    def _device_record(self, uid: str, result: DeviceRequestAllocationResult,
                       target: DeviceTarget) -> PreparedDeviceRecord:
        device = PreparedDevice(
            request_names=[result.base_request],
            pool_name=self.pool_name,
            device_name=target.name,
            cdi_device_ids=[self.names.device_id(uid, target.name)],
            share_id=result.share_id,
        )
        mig = target.mig
        return PreparedDeviceRecord(
            device=device, kind=target.kind, gpu_uuid=target.gpu.uuid, gpu_minor=target.gpu.minor,
            mig_uuid=mig.uuid if mig else None, mig_gi_id=mig.gi_id if mig else None,
            mig_ci_id=mig.ci_id if mig else None)

    def _write_cdi(self, record: ClaimRecord, cp: Checkpoint) -> None:
        spec = claim_spec(self.cdi_sources, record, cp.mps_daemons, cp.layout)
        cdi.write_spec(self.paths.cdi_root, record.cdi_spec_file, spec)

    # ----------------------------------------------------------------------------- unprepare

    def unprepare(self, ref: ClaimRef) -> None:
        with self._lock.held():
            cp = self._load()
            record = cp.claims.get(ref.uid)
            if record is None:
                # Never prepared here, or already unprepared: still make sure no spec is left.
                cdi.remove_spec(self.paths.cdi_root, self.names.spec_file_name(ref.uid))
                return
            self._undo(record, cp)
            del cp.claims[ref.uid]
            self._save(cp)

    def _undo(self, record: ClaimRecord, cp: Checkpoint) -> None:
        """Reverse everything ``record`` may have done; each step is idempotent."""
        cdi.remove_spec(self.paths.cdi_root, record.cdi_spec_file)
        self.sharing.release_claim(record, cp)

    # ----------------------------------------------------------------------------- recovery

    def _ensure_claim_runtime(self, record: ClaimRecord, cp: Checkpoint) -> tuple[bool, list[str]]:
        """Make a completed claim whole again: its daemons running and its CDI spec on disk."""
        restarted = self.sharing.ensure_claim_daemons(record, cp)
        spec_path = self.paths.cdi_root / record.cdi_spec_file
        recreated = False
        if restarted or not spec_path.exists():
            self._write_cdi(record, cp)
            recreated = True
        return recreated, restarted

    def recover(self) -> RecoveryReport:
        """Run once at start: finish or roll back what a crash or reboot interrupted.

        Best effort per item: one stuck daemon or one failing GPU is logged and retried later, it
        never keeps the driver from serving the node.
        """
        report = RecoveryReport([], [], [], [])
        with self._lock.held():
            try:
                cp = self._store.load()
            except CheckpointCorrupt:
                cp = rebuild_checkpoint(self.paths.cdi_root, self.names, self.pool_name, _now())
                report.rebuilt_from_cdi = True
            # Publish what the previous process published until apply_layout decides otherwise.
            inventory = self.view.inventory
            present = {g.uuid for g in inventory.gpus}
            with self._view_mutex:
                self._view = make_view(inventory, {u: s for u, s in cp.layout.items() if u in present})
            boot_id = current_boot_id()
            if cp.boot_id is not None and boot_id is not None and boot_id != cp.boot_id:
                log.info("the node rebooted since the last run; re-applying GPU settings")
                self.sharing.after_reboot(cp)
            for record in [r for r in cp.claims.values() if r.phase == ClaimPhase.PREPARE_STARTED]:
                try:
                    self._undo(record, cp)
                except Exception:
                    log.exception("rolling back an interrupted prepare failed; retried at the next start",
                                  extra={"claim_uid": record.uid})
                    continue
                del cp.claims[record.uid]
                report.rolled_back.append(record.uid)
            for record in cp.claims.values():
                if record.phase != ClaimPhase.PREPARE_COMPLETED:
                    continue
                try:
                    recreated, restarted = self._ensure_claim_runtime(record, cp)
                except Exception:
                    log.exception("could not restore a prepared claim; its containers may fail to start",
                                  extra={"claim_uid": record.uid})
                    continue
                if recreated:
                    report.cdi_recreated.append(record.uid)
                report.daemons_restarted.extend(restarted)
            report.orphans_removed.extend(self.sharing.sweep_orphans(cp))
            report.orphans_removed.extend(self._remove_orphan_specs(cp))
            cp.boot_id = boot_id
            self._save(cp)
        log.info("state recovered", extra={"rolled_back": report.rolled_back, "cdi_recreated": report.cdi_recreated,
                                           "daemons_restarted": report.daemons_restarted,
                                           "orphans_removed": report.orphans_removed,
                                           "rebuilt_from_cdi": report.rebuilt_from_cdi})
        return report

    def _remove_orphan_specs(self, cp: Checkpoint) -> list[str]:
        removed: list[str] = []
        known_files = {r.cdi_spec_file for r in cp.claims.values()}
        for path in cdi.list_specs(self.paths.cdi_root, self.names.spec_prefix):
            if path.name not in known_files:
                cdi.remove_spec(self.paths.cdi_root, path.name)
                removed.append(f"cdi spec {path.name}")
        # Temporary files of writes a crash interrupted (runtimes ignore them, nothing else removes them).
        for pattern in (f".{self.names.spec_prefix}*.tmp",):
            for tmp in self.paths.cdi_root.glob(pattern):
                tmp.unlink(missing_ok=True)
                removed.append(f"temporary file {tmp.name}")
        for tmp in self.paths.state_dir.glob(".checkpoint.json.*.tmp"):
            tmp.unlink(missing_ok=True)
            removed.append(f"temporary file {tmp.name}")
        return removed

    def check_daemons(self) -> list[str]:
        """Restart MPS daemons that died since the last check (called on every rescan)."""
        with self._lock.held():
            cp = self._load()
            if not cp.mps_daemons:
                return []
            restarted = self.sharing.check_daemons(cp)
            if not restarted:
                return []
            for record in cp.claims.values():
                if set(restarted) & {*record.owned_mps_daemons, *record.shared_mps_daemons}:
                    try:
                        self._write_cdi(record, cp)
                    except Exception:
                        log.exception("could not rewrite the CDI spec after restarting its MPS daemon",
                                      extra={"claim_uid": record.uid})
            self._save(cp)
        if restarted:
            log.warning("restarted MPS daemons that had died; their clients must reconnect",
                        extra={"daemons": restarted})
        return restarted

    # ----------------------------------------------------------------------------- persistence

    def _load(self) -> Checkpoint:
        try:
            return self._store.load()
        except CheckpointCorrupt:
            cp = rebuild_checkpoint(self.paths.cdi_root, self.names, self.pool_name, _now())
            self._save(cp)
            return cp

    def _save(self, cp: Checkpoint) -> None:
        self._store.save(cp)


def _sets_time_slice(targets: list[DeviceTarget], groups: ConfigGroups) -> bool:
    by_name = {t.name: t for t in targets}
    return any(config.sharing is not None and config.sharing.strategy == "TimeSlicing"
               and any(by_name[r.device].kind == "gpu" for r in results) for config, results in groups)


def _user_error(exc: Exception) -> Exception:
    """The error the kubelet shows the user: known failures keep their own message."""
    if isinstance(exc, PrepareError):
        return exc
    if isinstance(exc, MpsError | TimeSliceError | HostFsError | ConfigError | LockTimeout):
        return PrepareError(str(exc))
    return exc
