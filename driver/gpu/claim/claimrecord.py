"""Pure: a claim's plan as the checkpoint records it when its prepare starts (``PrepareStarted``).

Everything the prepare is about to do is in this record before any of it happens (the devices, the
MPS daemons it owns or shares, the GPUs it makes EXCLUSIVE_PROCESS, its time slice, the dynamic MIG
instances it creates), so recovery after a crash knows what to finish or undo.
"""

from __future__ import annotations

from driver.gpu.claim.claimplan import ClaimPlan
from driver.gpu.claim.tenancy import claim_enforcement
from driver.gpu.claimcdi.edits import CdiNames
from driver.gpu.record.checkpoint import ClaimPhase, ClaimRecord, PreparedDeviceRecord, TimeSliceRecord
from driver.gpu.record.migrecord import intent_for
from driver.kubeletplugin.types import PreparedDevice


def started_record(claim_plan: ClaimPlan, names: CdiNames, pool_name: str, driver_version: str | None,
                   updated_at: str) -> ClaimRecord:
    """The ``PrepareStarted`` record of ``claim_plan``; ``driver_version`` decides how its MPS limits hold."""
    uid = claim_plan.uid
    record = ClaimRecord(uid=uid, namespace=claim_plan.namespace, name=claim_plan.name,
                         phase=ClaimPhase.PREPARE_STARTED,
                         cdi_spec_file=names.spec_file_name(uid), updated_at=updated_at,
                         pod_uids=list(claim_plan.pod_uids))
    record.mps_clients, record.mps_enforcement = claim_enforcement(claim_plan, driver_version)
    daemon_of = {name: d.daemon_id for d in claim_plan.daemons for name in d.device_names}
    consumed = dict(claim_plan.consumed)
    for result, target in zip(claim_plan.results, claim_plan.targets, strict=True):
        device = PreparedDevice(request_names=[result.base_request], pool_name=pool_name,
                                device_name=target.name, cdi_device_ids=[names.device_id(uid, target.name)],
                                share_id=result.share_id)
        mig = target.mig
        record.devices.append(PreparedDeviceRecord(
            device=device, kind=target.kind, gpu_uuid=target.gpu.uuid, gpu_minor=target.gpu.minor,
            mig_uuid=mig.uuid if mig else None, mig_gi_id=mig.gi_id if mig else None,
            mig_ci_id=mig.ci_id if mig else None, mps_daemon_id=daemon_of.get(target.name),
            admin_access=bool(result.admin_access),
            # Dynamic MIG: the instance to create, named before it exists. Admin access creates nothing (it
            # watches devices other claims hold), so its device gets the GPU's node only.
            dynamic_mig=intent_for(target.placement) if target.placement and not result.admin_access else None))
        if (share := consumed.get(target.name)) is not None:
            record.devices[-1].consumed_memory_bytes = share.memory_bytes
            record.devices[-1].consumed_multiprocessors = share.multiprocessors
    for daemon in claim_plan.daemons:
        (record.shared_mps_daemons if daemon.shared else record.owned_mps_daemons).append(daemon.daemon_id)
        record.exclusive_gpus.extend(g for g in daemon.exclusive_gpus if g not in record.exclusive_gpus)
    if claim_plan.timeslice is not None:
        record.timeslice = TimeSliceRecord(gpu_uuids=list(claim_plan.timeslice.gpu_uuids),
                                           interval=claim_plan.timeslice.interval)
    return record


def allocation_of(record: ClaimRecord) -> list[tuple[str, str, str | None, int | None, int | None]]:
    """What a record says the scheduler allocated: per device its pool, name, share ID and consumed amounts."""
    return sorted((d.device.pool_name, d.device.device_name, d.device.share_id, d.consumed_memory_bytes,
                   d.consumed_multiprocessors) for d in record.devices)
