"""Prepare and unprepare claims on this node, crash-safely.

Every state change runs under the node lock and follows one pattern: record the intent in the
checkpoint (``PrepareStarted``), do the side effects (MPS daemon, time slice, CDI spec), then
record the outcome (``PrepareCompleted``). A crash between the two leaves a ``PrepareStarted``
record that :meth:`DeviceState.recover` rolls back at the next start; the kubelet then retries
the prepare. Any failure inside prepare is rolled back before the error is returned, so a
failed claim leaves no daemon, no CDI file and no checkpoint entry behind.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import cdi
from driver.gpu import cdispec
from driver.gpu.checkpoint import (
    Checkpoint,
    CheckpointCorrupt,
    CheckpointStore,
    ClaimPhase,
    ClaimRecord,
    PreparedDeviceRecord,
    TimeSliceRecord,
    current_boot_id,
)
from driver.gpu.configapi import ConfigError, GpuConfig, MigDeviceConfig, resolve_mps_limits
from driver.gpu.hostfs import HostFsError, control_device_paths, mig_capability_nodes, missing_paths
from driver.gpu.mps import MpsDaemonRecord, MpsDaemonSpec, MpsError, MpsManager
from driver.gpu.opaque import group_by_config, resolve_configs
from driver.gpu.sharing import SharingLayout, TimeSliceInterval
from driver.gpu.targets import DeviceTarget, NodeView, make_view, merge_layout
from driver.gpu.timeslice import TimeSliceError, TimeSlicer
from driver.gpu.toolkit import ToolkitEdits
from driver.kubeletplugin.claim import DeviceRequestAllocationResult, ResourceClaim
from driver.kubeletplugin.nodelock import NodeLock
from driver.kubeletplugin.types import ClaimRef, PreparedDevice

log = logging.getLogger(__name__)

CDI_VENDOR = "k8s.gpu.tessera.dev"
CDI_CLASS = "claim"
CDI_KIND = f"{CDI_VENDOR}/{CDI_CLASS}"
MPS_CONTAINER_PIPE_DIR = "/tmp/nvidia-mps"


class PrepareError(Exception):
    """A claim cannot be prepared; the message is shown to the user in the pod's events."""


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


def spec_file_name(claim_uid: str) -> str:
    return cdi.transient_spec_name(CDI_VENDOR, CDI_CLASS, claim_uid)


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _short_hash(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def plan_daemon_id(gpu_uuid: str) -> str:
    # Short ids keep MPS socket paths under the 108-byte Unix socket limit.
    return f"plan-{_short_hash(gpu_uuid)}"


def claim_daemon_id(claim_uid: str, group: int) -> str:
    return f"claim-{_short_hash(claim_uid)}-{group}"


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

    # ----------------------------------------------------------------------------- views

    @property
    def view(self) -> NodeView:
        with self._view_mutex:
            return self._view

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
            self._apply_plan_timeslices(cp, effective)
            cp.layout = dict(effective)
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
        view = self.view
        targets = [self._target_for(r, view) for r in results]
        kinds = {id(r): t.kind for r, t in zip(results, targets, strict=True)}
        try:
            resolved = resolve_configs(claim.configs_for(self.driver_name), results, lambda r: kinds[id(r)])
        except ConfigError as exc:
            raise PrepareError(f"invalid opaque configuration: {exc}") from exc
        self._check_share_multiplicity(targets)

        with self._lock.held():
            cp = self._load()
            existing = cp.claims.get(uid)
            if existing is not None and existing.phase == ClaimPhase.PREPARE_COMPLETED:
                self._ensure_claim_runtime(existing, cp)
                self._save(cp)
                return [d.device for d in existing.devices]
            if existing is not None:
                log.info("rolling back an interrupted prepare before retrying it", extra={"claim_uid": uid})
                self._undo(existing, cp)
                del cp.claims[uid]
            self._check_overlap(cp, uid, targets)

            record = ClaimRecord(uid=uid, namespace=claim.metadata.namespace, name=claim.metadata.name,
                                 phase=ClaimPhase.PREPARE_STARTED, cdi_spec_file=spec_file_name(uid),
                                 updated_at=_now())
            for result, target in zip(results, targets, strict=True):
                record.devices.append(self._device_record(uid, result, target))
            cp.claims[uid] = record
            self._save(cp)  # the intent is durable before any side effect

            try:
                self._start_sharing(record, cp, targets, group_by_config(resolved))
                self._write_cdi(record, cp)
                record.phase = ClaimPhase.PREPARE_COMPLETED
                record.updated_at = _now()
                self._save(cp)
            except Exception as exc:
                self._undo(record, cp)
                cp.claims.pop(uid, None)
                self._save(cp)
                if isinstance(exc, PrepareError):
                    raise
                if isinstance(exc, MpsError | TimeSliceError | HostFsError | ConfigError):
                    raise PrepareError(str(exc)) from exc
                raise
            return [d.device for d in record.devices]

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
            cdi_device_ids=[f"{CDI_KIND}={cdispec.cdi_device_name(uid, target.name)}"],
            share_id=result.share_id,
        )
        mig = target.mig
        return PreparedDeviceRecord(
            device=device, kind=target.kind, gpu_uuid=target.gpu.uuid, gpu_minor=target.gpu.minor,
            mig_uuid=mig.uuid if mig else None, mig_gi_id=mig.gi_id if mig else None,
            mig_ci_id=mig.ci_id if mig else None)

    # ----------------------------------------------------------------------------- sharing

    def _start_sharing(self, record: ClaimRecord, cp: Checkpoint, targets: list[DeviceTarget],
                       groups: list[tuple[GpuConfig | MigDeviceConfig, list[DeviceRequestAllocationResult]]]) -> None:
        by_name = {t.name: t for t in targets}
        dev_by_name = {d.device.device_name: d for d in record.devices}
        # Plan MPS shares: one daemon per GPU, shared by every claim holding one of its shares.
        for target in targets:
            if target.kind != "mps" or target.shares is None:
                continue
            daemon_id = plan_daemon_id(target.gpu.uuid)
            shares = target.shares
            spec = MpsDaemonSpec(daemon_id=daemon_id, gpu_uuids=[target.gpu.uuid],
                                 active_thread_percentage=shares.active_thread_percentage,
                                 pinned_memory_limits={target.gpu.uuid: shares.memory_bytes_per_share})
            self._ensure_daemon(cp, spec)
            if daemon_id not in record.shared_mps_daemons:
                record.shared_mps_daemons.append(daemon_id)
            dev_by_name[target.name].mps_daemon_id = daemon_id
        # Per-claim sharing config on whole GPUs and MIG devices.
        for index, (config, results) in enumerate(groups):
            sharing = config.sharing
            group_targets = [by_name[r.device] for r in results if by_name[r.device].kind in ("gpu", "mig")]
            if sharing is None or not group_targets:
                continue
            uuids = sorted(t.cuda_uuid for t in group_targets)
            if sharing.strategy == "MPS":
                daemon_id = claim_daemon_id(record.uid, index)
                record.owned_mps_daemons.append(daemon_id)
                self._save(cp)  # durable before the daemon exists, so a crash cannot leak it
                self.mps.stop_by_id(daemon_id)  # a daemon left by a crash between start and record
                memory = {t.cuda_uuid: t.memory_bytes or 0 for t in group_targets}
                limits = resolve_mps_limits(sharing.mpsConfig, uuids, memory) if sharing.mpsConfig else None
                spec = MpsDaemonSpec(
                    daemon_id=daemon_id, gpu_uuids=uuids,
                    active_thread_percentage=limits.active_thread_percentage if limits else None,
                    pinned_memory_limits=dict(limits.pinned_memory_bytes) if limits else {})
                cp.mps_daemons[daemon_id] = self.mps.start(spec)
                self._save(cp)
                for t in group_targets:
                    dev_by_name[t.name].mps_daemon_id = daemon_id
            elif sharing.strategy == "TimeSlicing":
                interval: TimeSliceInterval = (
                    sharing.timeSlicingConfig.interval if sharing.timeSlicingConfig else "Default")
                gpu_uuids = sorted({t.gpu.uuid for t in group_targets})
                record.timeslice = TimeSliceRecord(gpu_uuids=gpu_uuids, interval=interval)
                self._save(cp)
                self.timeslicer.apply(gpu_uuids, interval)

    def _ensure_daemon(self, cp: Checkpoint, spec: MpsDaemonSpec) -> MpsDaemonRecord:
        existing = cp.mps_daemons.get(spec.daemon_id)
        if existing is not None and existing.spec == spec:
            record = self.mps.ensure_running(existing)
        else:
            if existing is not None:
                self.mps.stop(existing)
            else:
                self.mps.stop_by_id(spec.daemon_id)  # a daemon left by a crash between start and record
            record = self.mps.start(spec)
        cp.mps_daemons[spec.daemon_id] = record
        self._save(cp)
        return record

    def _apply_plan_timeslices(self, cp: Checkpoint, layout: SharingLayout) -> None:
        desired = {uuid: s.interval or "Default" for uuid, s in layout.items() if s.strategy == "TimeSlicing"}
        for uuid in sorted(set(cp.plan_timeslices) - set(desired)):
            self.timeslicer.reset([uuid])
            del cp.plan_timeslices[uuid]
        for uuid, interval in sorted(desired.items()):
            if cp.plan_timeslices.get(uuid) != interval:
                self.timeslicer.apply([uuid], interval)
                cp.plan_timeslices[uuid] = interval

    # ----------------------------------------------------------------------------- CDI

    def _device_edits(self, dev: PreparedDeviceRecord, cp: Checkpoint) -> cdispec.DeviceEdits:
        host = self.paths.host_root
        gpu_node = f"/dev/nvidia{dev.gpu_minor}"
        missing = missing_paths(host, [gpu_node])
        if missing:
            raise PrepareError(
                f"device node {gpu_node} for {dev.device.device_name} does not exist on the node; the NVIDIA driver "
                "has not created it yet (run nvidia-smi or nvidia-modprobe on the host), then the kubelet retries")
        nodes: list[dict[str, object]] = [{"path": gpu_node}]
        if dev.kind == "mig" and dev.mig_gi_id is not None and dev.mig_ci_id is not None:
            for cap in mig_capability_nodes(host, dev.gpu_minor, dev.mig_gi_id, dev.mig_ci_id):
                nodes.append({"path": cap.path, "type": "c", "major": cap.major, "minor": cap.minor,
                              "fileMode": cap.file_mode})
        env: list[str] = []
        mounts: list[dict[str, object]] = []
        prefix = cdispec.ANNOTATION_PREFIX
        # Enough to rebuild the checkpoint entry from this file if the checkpoint is ever lost.
        annotations = {f"{prefix}/device": dev.device.device_name, f"{prefix}/gpu-uuid": dev.gpu_uuid,
                       f"{prefix}/request": ",".join(dev.device.request_names)}
        if dev.device.share_id:
            annotations[f"{prefix}/share-id"] = dev.device.share_id
        if dev.mig_uuid:
            annotations[f"{prefix}/mig-uuid"] = dev.mig_uuid
        if dev.mps_daemon_id is not None:
            daemon = cp.mps_daemons[dev.mps_daemon_id]
            edits = self.mps.client_edits(daemon, MPS_CONTAINER_PIPE_DIR, self.paths.mps_shm_dir)
            env.extend(edits.env)
            mounts.extend({"hostPath": str(h), "containerPath": c, "options": list(o)} for h, c, o in edits.mounts)
            annotations[f"{prefix}/mps-daemon"] = dev.mps_daemon_id
        return cdispec.DeviceEdits(dev.device.device_name, nodes, env, mounts, annotations)

    def build_spec(self, record: ClaimRecord, cp: Checkpoint) -> cdi.Spec:
        control = control_device_paths(self.paths.host_root)
        if "/dev/nvidiactl" not in control:
            raise PrepareError("/dev/nvidiactl does not exist on the node: the NVIDIA kernel driver is not loaded "
                               "(check 'lsmod | grep nvidia' and the driver installation)")
        return cdispec.build_claim_spec(
            kind=CDI_KIND,
            claim=cdispec.ClaimIdentity(record.uid, record.namespace, record.name),
            devices=[self._device_edits(d, cp) for d in record.devices],
            common_edits=self.toolkit.edits,
            control_nodes=control,
            annotations={f"{cdispec.ANNOTATION_PREFIX}/driver-libraries": self.toolkit.status[:1000]},
        )

    def _write_cdi(self, record: ClaimRecord, cp: Checkpoint) -> None:
        cdi.write_spec(self.paths.cdi_root, record.cdi_spec_file, self.build_spec(record, cp))

    # ----------------------------------------------------------------------------- unprepare

    def unprepare(self, ref: ClaimRef) -> None:
        with self._lock.held():
            cp = self._load()
            record = cp.claims.get(ref.uid)
            if record is None:
                # Never prepared here, or already unprepared: still make sure no spec is left.
                cdi.remove_spec(self.paths.cdi_root, spec_file_name(ref.uid))
                return
            self._undo(record, cp)
            del cp.claims[ref.uid]
            self._save(cp)

    def _undo(self, record: ClaimRecord, cp: Checkpoint) -> None:
        """Reverse everything ``record`` may have done; each step is idempotent."""
        cdi.remove_spec(self.paths.cdi_root, record.cdi_spec_file)
        for daemon_id in record.owned_mps_daemons:
            self._stop_daemon(cp, daemon_id)
        for daemon_id in record.shared_mps_daemons:
            users = [c for c in cp.claims.values() if c.uid != record.uid and daemon_id in c.shared_mps_daemons]
            if not users:
                self._stop_daemon(cp, daemon_id)
        if record.timeslice is not None:
            self.timeslicer.reset(record.timeslice.gpu_uuids)

    def _stop_daemon(self, cp: Checkpoint, daemon_id: str) -> None:
        daemon = cp.mps_daemons.pop(daemon_id, None)
        if daemon is not None:
            self.mps.stop(daemon)
        else:
            self.mps.stop_by_id(daemon_id)

    # ----------------------------------------------------------------------------- recovery

    def _ensure_claim_runtime(self, record: ClaimRecord, cp: Checkpoint) -> tuple[bool, list[str]]:
        """Make a completed claim whole again: its daemons running and its CDI spec on disk."""
        restarted: list[str] = []
        for daemon_id in [*record.owned_mps_daemons, *record.shared_mps_daemons]:
            daemon = cp.mps_daemons.get(daemon_id)
            if daemon is None:
                continue
            running = self.mps.ensure_running(daemon)
            if running.pid != daemon.pid:
                restarted.append(daemon_id)
            cp.mps_daemons[daemon_id] = running
        spec_path = self.paths.cdi_root / record.cdi_spec_file
        recreated = False
        if restarted or not spec_path.exists():
            self._write_cdi(record, cp)
            recreated = True
        return recreated, restarted

    def recover(self) -> RecoveryReport:
        """Run once at start: finish or roll back what a crash or reboot interrupted."""
        report = RecoveryReport([], [], [], [])
        with self._lock.held():
            try:
                cp = self._store.load()
            except CheckpointCorrupt:
                cp = self._rebuild_from_cdi()
                report.rebuilt_from_cdi = True
            # Publish what the previous process published until apply_layout decides otherwise.
            inventory = self.view.inventory
            present = {g.uuid for g in inventory.gpus}
            with self._view_mutex:
                self._view = make_view(inventory, {u: s for u, s in cp.layout.items() if u in present})
            for record in [r for r in cp.claims.values() if r.phase == ClaimPhase.PREPARE_STARTED]:
                self._undo(record, cp)
                del cp.claims[record.uid]
                report.rolled_back.append(record.uid)
            for record in cp.claims.values():
                try:
                    recreated, restarted = self._ensure_claim_runtime(record, cp)
                except Exception:
                    log.exception("could not restore a prepared claim; its containers may fail to start",
                                  extra={"claim_uid": record.uid})
                    continue
                if recreated:
                    report.cdi_recreated.append(record.uid)
                report.daemons_restarted.extend(restarted)
            referenced = {d for r in cp.claims.values() for d in (*r.owned_mps_daemons, *r.shared_mps_daemons)}
            for daemon_id in sorted(set(cp.mps_daemons) - referenced):
                self._stop_daemon(cp, daemon_id)
                report.orphans_removed.append(f"mps daemon {daemon_id}")
            for daemon_id in self.mps.daemon_ids_on_disk():
                if daemon_id not in cp.mps_daemons:
                    self.mps.stop_by_id(daemon_id)
                    report.orphans_removed.append(f"mps directory {daemon_id}")
            known_files = {r.cdi_spec_file for r in cp.claims.values()}
            for path in cdi.list_specs(self.paths.cdi_root, f"{CDI_VENDOR}-{CDI_CLASS}_"):
                if path.name not in known_files:
                    cdi.remove_spec(self.paths.cdi_root, path.name)
                    report.orphans_removed.append(f"cdi spec {path.name}")
            cp.boot_id = current_boot_id()
            self._save(cp)
        log.info("state recovered", extra={"rolled_back": report.rolled_back, "cdi_recreated": report.cdi_recreated,
                                           "daemons_restarted": report.daemons_restarted,
                                           "orphans_removed": report.orphans_removed,
                                           "rebuilt_from_cdi": report.rebuilt_from_cdi})
        return report

    def _rebuild_from_cdi(self) -> Checkpoint:
        """Rebuild claim records from the annotations of the CDI specs we wrote."""
        cp = Checkpoint()
        prefix = cdispec.ANNOTATION_PREFIX
        for path in cdi.list_specs(self.paths.cdi_root, f"{CDI_VENDOR}-{CDI_CLASS}_"):
            try:
                spec = cdi.read_spec(path)
                ann = spec.annotations or {}
                uid = ann[f"{prefix}/claim-uid"]
                namespace, name = ann[f"{prefix}/claim"].split("/", 1)
                record = ClaimRecord(uid=uid, namespace=namespace, name=name, phase=ClaimPhase.PREPARE_COMPLETED,
                                     cdi_spec_file=path.name, updated_at=_now())
                for device in spec.devices:
                    dann = device.annotations or {}
                    device_name = dann[f"{prefix}/device"]
                    target = self.view.targets.get(device_name)
                    if target is None:
                        raise KeyError(f"device {device_name} is no longer published")
                    rebuilt = self._device_record(uid, _rebuilt_result(self.driver_name, self.pool_name, dann),
                                                  target)
                    record.devices.append(rebuilt)
                cp.claims[uid] = record
            except Exception as exc:
                log.error("cannot rebuild a claim from its CDI spec; removing the spec",
                          extra={"cdi_spec": str(path), "reason": str(exc)})
                cdi.remove_spec(self.paths.cdi_root, path.name)
        return cp

    # ----------------------------------------------------------------------------- persistence

    def _load(self) -> Checkpoint:
        try:
            return self._store.load()
        except CheckpointCorrupt:
            cp = self._rebuild_from_cdi()
            self._save(cp)
            return cp

    def _save(self, cp: Checkpoint) -> None:
        self._store.save(cp)


def _rebuilt_result(driver: str, pool: str, annotations: dict[str, str]) -> DeviceRequestAllocationResult:
    prefix = cdispec.ANNOTATION_PREFIX
    return DeviceRequestAllocationResult(
        request=annotations.get(f"{prefix}/request", ""), driver=driver, pool=pool,
        device=annotations[f"{prefix}/device"], shareID=annotations.get(f"{prefix}/share-id"))
