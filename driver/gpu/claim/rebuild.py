"""Rebuild the checkpoint from the CDI specs on disk, after the checkpoint was found corrupt or missing.

Every spec the driver writes carries annotations naming its claim and, per device, everything
the checkpoint held about it: kind, GPU, MIG instance (and, for dynamic MIG, its profile and placement),
request names, share ID, admin access, the share layout of its GPU and its MPS daemon; the claim's time
slice is a spec-level annotation. So running
workloads keep their specs, their daemons and their GPUs' published form; only daemon PIDs are
lost: recovery adopts each live daemon again from the settings its claims' specs carry
(:func:`daemon_specs`; its limits read back), the next prepare that needs one adopts it too, and unprepare
still stops those daemons through their directories. The compute modes
the GPUs had before their daemons are lost too; recovery then takes them as DEFAULT.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import cdi
from driver.gpu.claim.claimplan import is_shared_daemon
from driver.gpu.claimcdi.edits import CdiNames
from driver.gpu.claimconfig.choices import DeviceKind
from driver.gpu.discovery.inventory import ComputeMode
from driver.gpu.mps.model import MpsDaemonSpec
from driver.gpu.published.sharelayout import GpuForm
from driver.gpu.record.checkpoint import Checkpoint, ClaimPhase, ClaimRecord, PreparedDeviceRecord, TimeSliceRecord
from driver.gpu.record.migrecord import DynamicMigRecord
from driver.kubeletplugin.types import PreparedDevice

log = logging.getLogger(__name__)


def rebuild_checkpoint(cdi_root: Path, names: CdiNames, pool_name: str, updated_at: str) -> Checkpoint:
    cp = Checkpoint()
    for path in cdi.list_specs(cdi_root, names.spec_prefix):
        try:
            record, layout = _claim_from_spec(path, names, pool_name, updated_at)
        except Exception as exc:  # any unreadable spec: it cannot be managed, so it is an orphan
            log.error("cannot rebuild a claim from its CDI spec; removing the spec",
                      extra={"cdi_spec": str(path), "reason": str(exc)})
            cdi.remove_spec(cdi_root, path.name)
            continue
        cp.claims[record.uid] = record
        cp.layout.update(layout)
        # The modes before the daemons are lost with the file: take DEFAULT (the mode a node boots
        # with), as recovery does. Without a record, the last unprepare would leave the GPU in
        # EXCLUSIVE_PROCESS for good when the file is rebuilt while the driver runs.
        for uuid in record.exclusive_gpus:
            cp.compute_modes.setdefault(uuid, ComputeMode.DEFAULT)
    log.warning("checkpoint rebuilt from CDI specs", extra={"claims": sorted(cp.claims)})
    return cp


def daemon_specs(cdi_root: Path, names: CdiNames) -> dict[str, MpsDaemonSpec]:
    """The MPS daemons the claims' specs name, with the settings they were started with (specs written before
    the settings were annotated name none)."""
    found: dict[str, MpsDaemonSpec] = {}
    for path in cdi.list_specs(cdi_root, names.spec_prefix):
        try:
            devices = cdi.read_spec(path).devices
        except Exception:  # rebuild_checkpoint reported (and removed) what cannot be read
            continue
        for device in devices:
            text = (device.annotations or {}).get(names.annotation("mps-daemon-spec"))
            if text:
                with contextlib.suppress(ValueError):
                    spec = MpsDaemonSpec.model_validate_json(text)
                    found[spec.daemon_id] = spec
    return found


def _claim_from_spec(path: Path, names: CdiNames, pool_name: str,
                     updated_at: str) -> tuple[ClaimRecord, dict[str, GpuForm]]:
    spec = cdi.read_spec(path)
    ann = spec.annotations or {}
    uid = ann[names.annotation("claim-uid")]
    namespace, name = ann[names.annotation("claim")].split("/", 1)
    record = ClaimRecord(uid=uid, namespace=namespace, name=name, phase=ClaimPhase.PREPARE_COMPLETED,
                         cdi_spec_file=path.name, updated_at=updated_at)
    timeslice = ann.get(names.annotation("timeslice"))
    if timeslice:
        record.timeslice = TimeSliceRecord.model_validate_json(timeslice)
    layout: dict[str, GpuForm] = {}
    for device in spec.devices:
        dann = device.annotations or {}
        device_name = dann[names.annotation("device")]
        gi_ci = dann.get(names.annotation("mig-instance"))
        gi, ci = (int(x) for x in gi_ci.split("/")) if gi_ci else (None, None)
        requests = dann.get(names.annotation("request"), "")
        daemon = dann.get(names.annotation("mps-daemon"))
        gpu_uuid = dann[names.annotation("gpu-uuid")]
        record.devices.append(PreparedDeviceRecord(
            device=PreparedDevice(request_names=[r for r in requests.split(",") if r], pool_name=pool_name,
                                  device_name=device_name, cdi_device_ids=[names.device_id(uid, device_name)],
                                  share_id=dann.get(names.annotation("share-id"))),
            kind=dann[names.annotation("kind")], gpu_uuid=gpu_uuid,
            gpu_minor=int(dann[names.annotation("gpu-minor")]), mig_uuid=dann.get(names.annotation("mig-uuid")),
            mig_gi_id=gi, mig_ci_id=ci, mps_daemon_id=daemon,
            admin_access=dann.get(names.annotation("admin-access")) == "true"))
        dynamic = dann.get(names.annotation("dynamic-mig"))  # an instance created for the claim: destroyed with it
        if dynamic:
            record.devices[-1].dynamic_mig = DynamicMigRecord.model_validate_json(dynamic)
        consumed = dann.get(names.annotation("consumed"))  # "<memory bytes>,<SMs>" of a consumable share
        if consumed:
            memory, sms = (int(x) for x in consumed.split(","))
            record.devices[-1].consumed_memory_bytes, record.devices[-1].consumed_multiprocessors = memory, sms
        if daemon is not None:
            daemons = record.shared_mps_daemons if is_shared_daemon(daemon) else record.owned_mps_daemons
            if daemon not in daemons:
                daemons.append(daemon)
            # The same rule as at prepare (claimplan.exclusive_gpus): whole GPUs only, never a MIG parent (nor
            # the GPU of a MIG instance's shares).
            rebuilt = record.devices[-1]
            if rebuilt.kind in (DeviceKind.GPU, DeviceKind.MPS) and rebuilt.dynamic_mig is None \
                    and rebuilt.mig_uuid is None and gpu_uuid not in record.exclusive_gpus:
                record.exclusive_gpus.append(gpu_uuid)
        shares = dann.get(names.annotation("shares"))
        if shares:
            layout[record.devices[-1].layout_key] = GpuForm.model_validate_json(shares)
    return record, layout
