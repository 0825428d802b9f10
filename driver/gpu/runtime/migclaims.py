"""Dynamic MIG, pure: which instances are Tessera's, which placements claims hold, and a plan's MPS
daemons moved onto the instances created for it.

The checkpoint is the one record of what Tessera created: a device record with a ``dynamic_mig``
entry and GPU/compute instance ids is an instance this driver made for that claim. Everything here
reads checkpoints and plans; nothing does I/O (``runtime/migruntime.py`` does the NVML side).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from driver.gpu.claim.claimplan import ClaimPlan, PlannedDaemon
from driver.gpu.discovery.inventory import GpuInfo, NodeInventory
from driver.gpu.errors import PrepareError
from driver.gpu.mps.model import MpsDaemonSpec
from driver.gpu.record.checkpoint import Checkpoint, ClaimRecord, PreparedDeviceRecord
from driver.gpu.record.migrecord import DynamicMigRecord
from driver.gpu.runtime.mig import MigGpuInstance


def dynamic_devices(record: ClaimRecord) -> list[tuple[int, PreparedDeviceRecord, DynamicMigRecord]]:
    """(index, device, its dynamic MIG record) of each device of ``record`` that has an instance of its own."""
    return [(i, d, d.dynamic_mig) for i, d in enumerate(record.devices) if d.dynamic_mig is not None]


def own_instances(cp: Checkpoint, inventory: NodeInventory | None = None) -> set[tuple[str, int]]:
    """(GPU UUID, GPU instance id) of every instance Tessera created for a claim and still records; with
    ``inventory``, less those listed there with another MIG UUID (ids come back: another tool's instance
    where the claim's was destroyed), and plus those a create in progress has made but not recorded yet
    (``create_started``: the instance of its profile at exactly its placement, ``runtime/migruntime.py``),
    so a rescan in between does not take the GPU for one with someone else's instances."""
    listed = {(gpu.uuid, m.gi_id): m.uuid for gpu in (inventory.gpus if inventory is not None else ())
              for m in gpu.mig_instances}
    own = {(d.gpu_uuid, d.mig_gi_id) for r in cp.claims.values() for _, d, _ in dynamic_devices(r)
           if d.mig_gi_id is not None and listed.get((d.gpu_uuid, d.mig_gi_id), d.mig_uuid) == d.mig_uuid}
    creating = [(d.gpu_uuid, m) for r in cp.claims.values() for _, d, m in dynamic_devices(r)
                if d.mig_gi_id is None and m.create_started]
    for gpu in inventory.gpus if inventory is not None and creating else ():
        for uuid, intent in creating:
            own.update((uuid, i.gi_id) for i in gpu.mig_instances if uuid == gpu.uuid
                       and i.gi_profile_id == intent.gi_profile_id and i.placement_start == intent.placement_start)
    return own


def holders(cp: Checkpoint, gpu_uuid: str) -> dict[int, ClaimRecord]:
    """GPU instance id -> the claim whose instance it is, on one GPU."""
    return {d.mig_gi_id: r for r in cp.claims.values() for _, d, _ in dynamic_devices(r)
            if d.gpu_uuid == gpu_uuid and d.mig_gi_id is not None}


def check_placements_free(cp: Checkpoint, claim_plan: ClaimPlan) -> None:
    """Refuse a plan whose placements meet another claim's: the scheduler's counters never allow it, so
    the allocation is stale or the counters were wrong; either way no second instance may be created there."""
    wanted = [(t, t.placement) for r, t in zip(claim_plan.results, claim_plan.targets, strict=True)
              if t.placement is not None and not r.admin_access]
    for target, placement in wanted:
        start, end = placement.start, placement.start + placement.size
        for record in cp.claims.values():
            if record.uid == claim_plan.uid:
                continue
            for _, dev, held in dynamic_devices(record):
                if dev.gpu_uuid == target.gpu.uuid and held.placement_start < end and start < held.placement_end:
                    raise PrepareError(
                        f"device {target.name!r} ({placement.profile.name} at placement {start} of GPU "
                        f"{target.gpu.minor}, {target.gpu.uuid}) overlaps {dev.device.device_name!r} "
                        f"({held.describe()}), which claim {record.namespace}/{record.name} ({record.uid}) holds; "
                        "the allocation is stale: delete the pod so its claim is allocated again")


def overlapping(intent: DynamicMigRecord, found: Iterable[MigGpuInstance]) -> list[MigGpuInstance]:
    """The GPU instances whose memory slices meet ``intent``'s placement."""
    return [g for g in found if g.placement_start < intent.placement_end
            and intent.placement_start < g.placement_start + g.placement_size]


def at_placement(intent: DynamicMigRecord, found: Iterable[MigGpuInstance]) -> list[MigGpuInstance]:
    """The GPU instances of ``intent``'s profile at exactly its placement: the only ones a create there can make."""
    return [g for g in found if g.gi_profile_id == intent.gi_profile_id
            and g.placement_start == intent.placement_start and g.placement_size == intent.memory_slices]


def describe_instance(gi: MigGpuInstance, gpu: GpuInfo | None) -> str:
    """``GI 2 (1g.10gb at placement 5)``, the profile named where the GPU's profiles say it."""
    names = {p.gi_profile_id: p.name for p in (gpu.mig_profiles if gpu is not None else ())}
    profile = names.get(gi.gi_profile_id, f"GI profile {gi.gi_profile_id}")
    return f"GI {gi.gi_id} ({profile} at placement {gi.placement_start}, {gi.placement_size} memory slice(s))"


def spec_on_instance(spec: MpsDaemonSpec, mig_uuid: str) -> MpsDaemonSpec:
    """A daemon spec serving the MIG device ``mig_uuid`` in place of what it served before.

    A daemon serving a MIG device serves that one device only (a CUDA process sees one MIG device:
    ``claimplan._check_one_cuda_process_can_see``), so its one UUID and its one memory limit move over,
    whether they named the parent GPU (planned before the instance existed) or an earlier instance
    (recreated after a reboot with a new UUID)."""
    limits = list(spec.pinned_memory_limits.values())
    return spec.model_copy(update={"gpu_uuids": [mig_uuid],
                                   "pinned_memory_limits": {mig_uuid: limits[0]} if limits else {}})


def plan_on_instances(claim_plan: ClaimPlan, record: ClaimRecord) -> ClaimPlan:
    """``claim_plan`` with each daemon of a dynamic MIG device serving the instance ``record`` says was created."""
    created = {d.device.device_name: d.mig_uuid for _, d, _ in dynamic_devices(record) if d.mig_uuid is not None}
    daemons: list[PlannedDaemon] = []
    for daemon in claim_plan.daemons:
        uuids = [created[n] for n in daemon.device_names if n in created]
        daemons.append(replace(daemon, spec=spec_on_instance(daemon.spec, uuids[0])) if uuids else daemon)
    return replace(claim_plan, daemons=tuple(daemons))
