"""Each watch round: the MIG instances Tessera created for claims, checked to still be there as made.

Why: the checkpoint says which instance is a claim's by its GPU instance and compute instance ids, its
profile, its placement and its MIG UUID. Published MIG UUIDs are name-based (version 5) and nvml.h does not
say from what; if NVML derives them from the GPU and the ids, another tool that destroys a claim's instance
and creates the same profile at the same place gets the same ids *and* the same UUID, and nothing in the
listing tells the two apart (nvml.h has no creation time or generation for GPU or compute instances). So
ownership also rests on continuity: this check lists every GPU that holds claims' instances, under its
lock, every ``--mps-limit-check-interval`` seconds (as every prepare, unprepare and start-up does), and an
instance not listed as made is forgotten at once (``MigRuntime.forget_lost``). An instance made again at
its place later is then someone else's: never destroyed, never counted as Tessera's, its placement
refused to claims. The claim's CDI spec goes (a restarted container must not get the capability nodes of
whatever holds those ids now) and so does each MPS daemon that served only the lost device; a log line and
a Warning Event ``MigDeviceLost`` tell the claim's owner. What a listing cannot see, a destroy and a
re-create between two rounds, is docs/sharing.md's "Whose MIG instance" limit.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import cdi
from driver.gpu.record.checkpoint import ClaimPhase, ClaimRecord
from driver.gpu.runtime.gpulocks import RESCAN_GPU_WAIT
from driver.gpu.runtime.migclaims import dynamic_devices
from driver.kubeletplugin.events import EventRecorder, EventSpec, ObjectRef

if TYPE_CHECKING:
    from driver.gpu.state import DeviceState

log = logging.getLogger(__name__)

MIG_DEVICE_LOST = "MigDeviceLost"
_CLAIM_API = "resource.k8s.io/v1"


def _recorded_on(record: ClaimRecord, gpu_uuid: str) -> bool:
    return record.phase == ClaimPhase.PREPARE_COMPLETED and any(
        d.gpu_uuid == gpu_uuid and d.mig_gi_id is not None and not d.admin_access
        for _, d, _ in dynamic_devices(record))


def check_mig_instances(state: DeviceState, events: EventRecorder | None) -> list[str]:
    """Forget the claims' MIG instances that are gone (module doc), one GPU at a time under its lock (a busy
    GPU is checked next round); the devices forgotten."""
    cp = state.ledger.read()
    gpus = sorted({d.gpu_uuid for r in cp.claims.values() for _, d, _ in dynamic_devices(r)
                   if _recorded_on(r, d.gpu_uuid)})
    forgotten: list[str] = []
    for gpu_uuid in gpus:
        try:
            with state.gpu_locks.held([gpu_uuid], RESCAN_GPU_WAIT, f"checking the MIG instances of {gpu_uuid}"):
                for record in [r for r in state.ledger.read().claims.values() if _recorded_on(r, gpu_uuid)]:
                    lost = state.mig.forget_lost(record, gpu_uuid)
                    if lost:
                        _withdraw(state, record, lost)
                        _report(events, record, lost)
                        forgotten.extend(lost)
        except Exception as exc:
            log.error("checking the MIG instances of claims failed; retried next round",
                      extra={"gpu_uuid": gpu_uuid, "reason": str(exc)})
    return forgotten


def _withdraw(state: DeviceState, record: ClaimRecord, lost: list[str]) -> None:
    """The claim's spec, and the daemons that served only lost devices: what would hand the ids on."""
    cdi.remove_spec(state.paths.cdi_root, record.cdi_spec_file)
    kept = {d.mps_daemon_id for d in record.devices if d.device.device_name not in lost}
    for dev in record.devices:
        daemon_id = dev.mps_daemon_id
        if dev.device.device_name in lost and daemon_id in record.owned_mps_daemons and daemon_id not in kept:
            state.sharing.stop_daemon(daemon_id)


def _report(events: EventRecorder | None, record: ClaimRecord, lost: list[str]) -> None:
    log.warning("a claim's MIG device was destroyed outside Tessera; forgotten, so an instance made again at its "
                "place is never taken for the claim's", extra={"claim_uid": record.uid, "devices": lost})
    if events is None:
        return
    regarding = ObjectRef(apiVersion=_CLAIM_API, kind="ResourceClaim", namespace=record.namespace,
                          name=record.name, uid=record.uid)
    events.post(EventSpec(regarding=regarding, reason=MIG_DEVICE_LOST, action="ForgetMigDevice", note=(
        f"The MIG instance of {', '.join(lost)} was destroyed by something other than this driver. Its CDI spec "
        f"was removed and the claim no longer holds the instance; an instance created again at the same place "
        f"belongs to whoever created it. Delete the pod so its claim is allocated again.")))
