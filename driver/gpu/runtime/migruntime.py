"""The running side of dynamic MIG: each claim's MIG instance created, destroyed and re-created, all recorded.

Callers hold the per-GPU lock of every GPU they touch (``gpulocks.py``), never the node lock: NVML work
runs under the GPU's lock only, so creating on one GPU never waits for another. What must survive a
crash is in the checkpoint before NVML is asked:

1. the claim's ``PrepareStarted`` record names the profile and placement (``record/migrecord.py``);
2. the placement is checked free of instances Tessera did not create (listed through NVML) and of other
   claims' instances; only then is ``create_started`` committed, durably;
3. NVML creates the GPU instance and the compute instance spanning it (the partitioner destroys its GPU
   instance again if the compute instance fails); the ids and MIG UUID are committed right after.

So at any crash, recovery knows what may exist: ids recorded, that instance (checked to still be of the
profile and at the placement); ``create_started`` without ids, an instance of that profile at exactly that
placement, or a bare GPU instance there, which only this create can have made, since the placement was
found free under the GPU's lock (held by this driver, and the other plugin pod of a rolling update takes
the same lock) just before; neither, nothing (the placement may hold someone else's instance: never
touched). Instances do not survive a reboot: :meth:`MigRuntime.after_reboot` forgets every recorded id, so
nothing that NVML hands out again under an old id is destroyed, and completed claims get theirs created
again (:meth:`MigRuntime.ensure_instances`) before the driver serves prepares.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from functools import partial

from driver.gpu.claim.claimplan import ClaimPlan
from driver.gpu.discovery.inventory import GpuInfo, NodeInventory
from driver.gpu.errors import PrepareError
from driver.gpu.record.checkpoint import Checkpoint, ClaimPhase, ClaimRecord, PreparedDeviceRecord
from driver.gpu.record.migrecord import DynamicMigRecord
from driver.gpu.runtime.mig import CreatedMig, MigCreateError, MigError, MigGpuInstance, MigPartitioner
from driver.gpu.runtime.migclaims import (
    at_placement,
    describe_instance,
    dynamic_devices,
    holders,
    overlapping,
    plan_on_instances,
    spec_on_instance,
)
from driver.gpu.runtime.sharing import Ledger
from driver.kubeletplugin.types import Deadline

log = logging.getLogger(__name__)


class MigRuntime:
    """Dynamic MIG instances of the node's claims. ``open_partitioner`` is called once, at the first
    claim that needs one (None: this node cannot create MIG devices); ``inventory`` is the view's, read to
    name the profiles of instances found in the way."""

    def __init__(self, open_partitioner: Callable[[], MigPartitioner] | None, ledger: Ledger,
                 inventory: Callable[[], NodeInventory] = NodeInventory) -> None:
        self._open = open_partitioner
        self._ledger = ledger
        self._inventory = inventory
        self._partitioner: MigPartitioner | None = None
        self._open_lock = threading.Lock()
        # Instances this process created or destroyed: after recovery, a non-zero count means discovery's
        # inventory is stale (the app discovers again before publishing).
        self.changes = 0
        # Run before each NVML create: the capability nodes this process's create opens (host/capnodes.py).
        self.before_create: Callable[[], object] = lambda: None

    @property
    def partitioner(self) -> MigPartitioner:
        with self._open_lock:
            if self._partitioner is None:
                if self._open is None:
                    raise MigError("this driver was started without a way to create MIG devices")
                self._partitioner = self._open()
            return self._partitioner

    def close(self) -> None:
        with self._open_lock:
            if self._partitioner is not None:
                self._partitioner.close()
                self._partitioner = None

    # ----------------------------------------------------------------------------- prepare

    def create_for_claim(self, claim_plan: ClaimPlan, record: ClaimRecord,
                         deadline: Deadline) -> tuple[ClaimPlan, ClaimRecord]:
        """Create the instance of each dynamic MIG device of the claim (its PrepareStarted ``record``);
        the plan with its MPS daemons serving them, and the record with their ids. PrepareError on refusal."""
        todo = [(i, d, m) for i, d, m in dynamic_devices(record) if d.mig_gi_id is None and not d.admin_access]
        for index, dev, intent in todo:
            deadline.check(f"creating MIG {intent.describe()} on GPU {dev.gpu_uuid}")
            try:
                found = self._listed(dev.gpu_uuid, deadline)
                self._check_free(record.uid, dev, intent, found)
                self._create(record.uid, index, dev, intent, deadline)
            except MigError as exc:
                raise PrepareError(_refusal(dev, intent, exc)) from exc
        if not todo:
            return claim_plan, record
        current = self._ledger.read().claims[record.uid]
        return plan_on_instances(claim_plan, current), current

    def _create(self, uid: str, index: int, dev: PreparedDeviceRecord, intent: DynamicMigRecord,
                deadline: Deadline | None) -> CreatedMig:
        """Commit ``create_started`` (durably), create, commit what was created; the claim's daemons follow it."""
        self._ledger.commit(partial(_change_device, uid=uid, index=index, change=_started))
        self.before_create()
        try:
            made = self.partitioner.create(dev.gpu_uuid, intent.profile_info(), intent.placement_start, deadline)
        except MigCreateError as exc:
            if exc.reason != "failed":
                # NVML refused the GPU instance itself: nothing of this create exists. What is at the placement now
                # (another tool's create since the check, the very reason for "occupied") is not the claim's, so
                # ``create_started`` goes, or the rollback (or unprepare) would destroy it as this create's.
                self._forget(uid, index)
            raise
        self.changes += 1
        self._ledger.commit(partial(_change_device, uid=uid, index=index, change=partial(_created, made=made),
                                    move_daemon=True))
        log.info("MIG device created for a claim", extra={
            "claim_uid": uid, "device": dev.device.device_name, "gpu_uuid": dev.gpu_uuid, "profile": intent.profile,
            "placement_start": intent.placement_start, "gi_id": made.gi_id, "ci_id": made.ci_id,
            "mig_uuid": made.uuid})
        return made

    # ----------------------------------------------------------------------------- unprepare

    def release_claim(self, record: ClaimRecord, deadline: Deadline | None = None) -> None:
        """Destroy what the claim's record says was (or may have been) created: compute instance, then GPU
        instance. Idempotent; MigError if NVML refuses (e.g. a process still runs in it), record kept."""
        current = self._ledger.read().claims.get(record.uid, record)
        for _, dev, intent in dynamic_devices(current):
            if dev.mig_gi_id is None and not intent.create_started:
                continue  # nothing was asked of NVML: whatever is at the placement is not this claim's
            found = self._listed(dev.gpu_uuid, deadline)
            for gi in self._made_for(dev, intent, found):
                ci = gi.ci_id if isinstance(gi, CreatedMig) else None
                self.partitioner.destroy(dev.gpu_uuid, gi.gi_id, ci, deadline)
                self.changes += 1
                log.info("MIG device destroyed", extra={
                    "claim_uid": current.uid, "device": dev.device.device_name, "gpu_uuid": dev.gpu_uuid,
                    "profile": intent.profile, "placement_start": intent.placement_start, "gi_id": gi.gi_id,
                    "ci_id": ci})

    def _made_for(self, dev: PreparedDeviceRecord, intent: DynamicMigRecord,
                  found: list[MigGpuInstance]) -> list[MigGpuInstance]:
        """The instances on the GPU that are this device's: the recorded one, if still of its profile at its
        placement; with only ``create_started``, those of its profile at exactly its placement (module doc)."""
        if dev.mig_gi_id is None:
            return at_placement(intent, found)
        same_id = [g for g in found if g.gi_id == dev.mig_gi_id]
        # NVML hands a destroyed instance's ids out again: a MIG device there with another MIG UUID is another
        # tool's. A bare GPU instance has no UUID: the claim's whose compute instance went first (an unprepare
        # cut short between its two destroys, or ``nvidia-smi mig -dci``), as the doc's table says.
        mine = [g for g in at_placement(intent, same_id) if not isinstance(g, CreatedMig) or g.uuid == dev.mig_uuid]
        if same_id and not mine:
            log.warning("the GPU instance id recorded for a claim's MIG device now names another instance; left alone",
                        extra={"device": dev.device.device_name, "gpu_uuid": dev.gpu_uuid, "gi_id": dev.mig_gi_id,
                               "found": describe_instance(same_id[0], self._gpu(dev.gpu_uuid))})
        return mine

    # ----------------------------------------------------------------------------- restarts and reboots

    def ensure_instances(self, record: ClaimRecord) -> bool:
        """Give a prepared claim back the instances it lost (a reboot, or someone destroyed them), at the same
        placements; True if any was created (new ids and MIG UUIDs: its CDI spec must be written again).
        PrepareError naming the device if one cannot be."""
        if record.phase != ClaimPhase.PREPARE_COMPLETED:
            return False
        remade = False
        for index, dev, intent in dynamic_devices(record):
            if dev.admin_access:
                continue
            try:
                found = self._listed(dev.gpu_uuid, None)
                if dev.mig_gi_id is not None and any(_is_recorded(g, dev, intent) for g in found):
                    continue
                log.warning("a prepared claim's MIG device is gone (instances do not survive a reboot, or it was "
                            "destroyed outside Tessera); creating it again at the same placement", extra={
                                "claim_uid": record.uid, "device": dev.device.device_name, "gpu_uuid": dev.gpu_uuid,
                                "profile": intent.profile, "placement_start": intent.placement_start})
                if dev.mig_gi_id is not None or intent.create_started:
                    # What is left of the claim's instance (its bare GPU instance: forgotten, it would read as
                    # someone else's and stay forever), or what a re-create cut short by a crash made (module doc):
                    # destroyed and made again.
                    for gi in self._made_for(dev, intent, found):
                        self.partitioner.destroy(dev.gpu_uuid, gi.gi_id, gi.ci_id if isinstance(gi, CreatedMig)
                                                 else None)
                        self.changes += 1
                    found = self._listed(dev.gpu_uuid, None)
                self._forget(record.uid, index)
                self._check_free(record.uid, dev, intent, found)
                self._create(record.uid, index, dev, intent, None)
            except MigError as exc:
                raise PrepareError(_refusal(dev, intent, exc)) from exc
            remade = True
        return remade

    def forget_lost(self, record: ClaimRecord, gpu_uuid: str) -> list[str]:
        """Forget the ids of the claim's MIG devices on ``gpu_uuid`` whose instance is no longer listed as it was
        made (destroyed outside Tessera; a bare GPU instance left of it is destroyed first): a MIG UUID proves
        nothing if NVML derives it from the GPU and the ids, so an instance made again at the same place must
        never pass for the claim's. The devices forgotten. Callers hold the GPU's lock (the listing is fresh)."""
        if record.phase != ClaimPhase.PREPARE_COMPLETED:
            return []
        lost: list[str] = []
        found: list[MigGpuInstance] | None = None
        for index, dev, intent in dynamic_devices(record):
            if dev.gpu_uuid != gpu_uuid or dev.admin_access or dev.mig_gi_id is None:
                continue
            found = self._listed(gpu_uuid, None) if found is None else found
            if any(_is_recorded(g, dev, intent) for g in found):
                continue
            for gi in self._made_for(dev, intent, found):
                if not isinstance(gi, CreatedMig):  # its compute instance went first: the rest is the claim's
                    self.partitioner.destroy(gpu_uuid, gi.gi_id, None)
                    self.changes += 1
            self._forget(record.uid, index)
            lost.append(dev.device.device_name)
        return lost

    def after_reboot(self) -> None:
        """No MIG instance survives a reboot: forget every recorded id (ids NVML hands out again are someone
        else's until a claim's instance is created again) and every create in progress."""
        self._ledger.commit(_forget_instances)

    # ----------------------------------------------------------------------------- helpers

    def _gpu(self, uuid: str) -> GpuInfo | None:
        return next((g for g in self._inventory().gpus if g.uuid == uuid), None)

    def _forget(self, uid: str, index: int) -> None:
        self._ledger.commit(partial(_change_device, uid=uid, index=index, change=_forgotten))

    def _listed(self, gpu_uuid: str, deadline: Deadline | None) -> list[MigGpuInstance]:
        """Every GPU instance on the GPU: MIG devices and bare GPU instances (a create cut short, another tool's)."""
        partitioner = self.partitioner
        return [*partitioner.instances(gpu_uuid, deadline), *partitioner.bare_gpu_instances(gpu_uuid, deadline)]

    def _check_free(self, uid: str, dev: PreparedDeviceRecord, intent: DynamicMigRecord,
                    found: list[MigGpuInstance]) -> None:
        """PrepareError naming what is in the way if any instance meets the placement."""
        owners = holders(self._ledger.read(), dev.gpu_uuid)
        gpu = self._gpu(dev.gpu_uuid)
        # nvidia-smi's -i is NVML's enumeration index, which need not be the minor the device names use.
        smi_gpu = gpu.index if gpu is not None else dev.gpu_uuid
        problems = []
        for gi in overlapping(intent, found):
            holder = owners.get(gi.gi_id)
            if holder is None:
                problems.append(f"{describe_instance(gi, gpu)}, an instance Tessera did not create (it is never "
                                f"touched: remove it with `nvidia-smi mig -i {smi_gpu} -dci -gi {gi.gi_id}` then "
                                f"`-dgi -gi {gi.gi_id}` if nothing uses it)")
            elif holder.uid != uid:
                problems.append(f"{describe_instance(gi, gpu)}, created by Tessera for claim "
                                f"{holder.namespace}/{holder.name} ({holder.uid})")
        if problems:
            raise PrepareError(
                f"MIG {intent.describe()} for device {dev.device.device_name!r} cannot be created on GPU "
                f"{dev.gpu_minor} ({dev.gpu_uuid}): the placement is held by {'; '.join(problems)}. Delete the pod "
                "so its claim is allocated again once the placement is free")


def _refusal(dev: PreparedDeviceRecord, intent: DynamicMigRecord, exc: MigError) -> str:
    """The per-claim error for an instance NVML would not create (or list, or destroy)."""
    why = f" ({exc.reason})" if isinstance(exc, MigCreateError) else ""
    return (f"MIG {intent.describe()} for device {dev.device.device_name!r} on GPU {dev.gpu_minor} ({dev.gpu_uuid}) "
            f"could not be created{why}: {exc}; nothing was left on the GPU, the kubelet will retry")


def _is_recorded(gi: MigGpuInstance, dev: PreparedDeviceRecord, intent: DynamicMigRecord) -> bool:
    return (isinstance(gi, CreatedMig) and gi.gi_id == dev.mig_gi_id and gi.ci_id == dev.mig_ci_id
            and gi.uuid == dev.mig_uuid and bool(at_placement(intent, [gi])))


def _change_device(cp: Checkpoint, uid: str, index: int, change: Callable[[PreparedDeviceRecord], None],
                   move_daemon: bool = False) -> None:
    """Apply ``change`` to device ``index`` of claim ``uid``; with ``move_daemon``, its recorded MPS daemon
    (stopped or not yet started) is made to serve the device's instance."""
    dev = cp.claims[uid].devices[index]
    change(dev)
    daemon = cp.mps_daemons.get(dev.mps_daemon_id) if dev.mps_daemon_id is not None else None
    if move_daemon and daemon is not None and dev.mig_uuid is not None:
        cp.mps_daemons[daemon.spec.daemon_id] = daemon.model_copy(
            update={"spec": spec_on_instance(daemon.spec, dev.mig_uuid)})


def _forget_instances(cp: Checkpoint) -> None:
    for record in cp.claims.values():
        for _, dev, _ in dynamic_devices(record):
            _forgotten(dev)


def _started(dev: PreparedDeviceRecord) -> None:
    if dev.dynamic_mig is not None:
        dev.dynamic_mig.create_started = True


def _created(dev: PreparedDeviceRecord, made: CreatedMig) -> None:
    dev.mig_gi_id, dev.mig_ci_id, dev.mig_uuid = made.gi_id, made.ci_id, made.uuid


def _forgotten(dev: PreparedDeviceRecord) -> None:
    """Nothing of this device's is on the GPU (any more): no ids, no create in progress."""
    dev.mig_gi_id = dev.mig_ci_id = None
    dev.mig_uuid = None
    if dev.dynamic_mig is not None:
        dev.dynamic_mig.create_started = False
