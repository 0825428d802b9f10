"""Dynamic MIG, the pure parts: the intent a prepare records, which instances are Tessera's, placements other
claims hold, MPS daemons moved onto created instances, which instance a device stands for (health), and a
claim plan on dynamic devices (no EXCLUSIVE_PROCESS, no time slice, one MIG device per MPS daemon)."""

from __future__ import annotations

from typing import Any

import pytest

from driver.gpu.claim.claimplan import ClaimPlan, plan_claim
from driver.gpu.claim.claimrecord import started_record
from driver.gpu.claimcdi.edits import CdiNames
from driver.gpu.errors import PrepareError
from driver.gpu.health.model import UuidHealth
from driver.gpu.health.published import instance_uuid, unhealthy_devices
from driver.gpu.mps.model import MpsDaemonSpec
from driver.gpu.published.devices import make_view
from driver.gpu.published.dynamicmigplan import DynamicMigEntry, dynamic_mig_form
from driver.gpu.published.targets import NodeView
from driver.gpu.record.checkpoint import Checkpoint, ClaimPhase, ClaimRecord, PreparedDeviceRecord
from driver.gpu.record.migrecord import DynamicMigRecord, intent_for
from driver.gpu.runtime.mig import CreatedMig, MigGpuInstance
from driver.gpu.runtime.migclaims import (
    at_placement,
    check_placements_free,
    overlapping,
    own_instances,
    plan_on_instances,
    spec_on_instance,
)
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.types import PreparedDevice
from tests.support.mig import h100, instance, inventory_of
from tests.support.statenode import gpu_config

DRIVER = "gpu.tessera.dev"
NAMES = CdiNames(DRIVER)


def view(*instances: Any) -> NodeView:
    gpu = h100(0, instances=tuple(instances))
    shares, _ = dynamic_mig_form(DynamicMigEntry(), h100(0), supported=True, own=())
    assert shares is not None
    return make_view(inventory_of(gpu, h100(1, mig_enabled=False)), {gpu.uuid: shares},
                     own_instances={(gpu.uuid, i.gi_id) for i in instances})


def claim(uid: str, *devices: str, configs: list[dict[str, Any]] | None = None, admin: bool = False) -> ResourceClaim:
    results = [{"request": f"r{i}", "driver": DRIVER, "pool": "p", "device": d, **({"adminAccess": True} if admin
                                                                                    else {})}
               for i, d in enumerate(devices)]
    return ResourceClaim.model_validate({"metadata": {"name": f"c-{uid}", "namespace": "ns", "uid": uid},
                                         "status": {"allocation": {"devices": {"results": results,
                                                                               "config": configs or []}}}})


def planned(uid: str, *devices: str, **kwargs: Any) -> ClaimPlan:
    claim_plan = plan_claim(claim(uid, *devices, **kwargs), driver_name=DRIVER, pool_name="p", view=view())
    assert claim_plan is not None
    return claim_plan


def mig_mps(**mps: Any) -> dict[str, Any]:
    return {"source": "FromClaim", "requests": [], "opaque": {"driver": DRIVER, "parameters": {
        "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "MigDeviceConfig",
        "sharing": {"strategy": "MPS", **({"mpsConfig": mps} if mps else {})}}}}


def record_of(claim_plan: ClaimPlan, *ids: tuple[int, int, str]) -> ClaimRecord:
    record = started_record(claim_plan, NAMES, "p", None, "now")
    for dev, (gi, ci, uuid) in zip(record.devices, ids, strict=False):
        dev.mig_gi_id, dev.mig_ci_id, dev.mig_uuid = gi, ci, uuid
    return record


# ----------------------------------------------------------------------------- the intent


def test_the_prepare_record_names_the_profile_and_placement_before_anything_exists() -> None:
    [dev] = record_of(planned("u", "gpu-0-dynmig-3g40gb-4")).devices
    intent = dev.dynamic_mig
    assert intent is not None and (intent.profile, intent.placement_start, intent.memory_slices) == ("3g.40gb", 4, 4)
    assert intent.gi_profile_id == 9 and not intent.create_started
    assert (dev.mig_gi_id, dev.mig_ci_id, dev.mig_uuid) == (None, None, None)
    assert intent.describe() == "3g.40gb at placement 4 (memory slices 4-7)"
    again = intent.profile_info()
    assert (again.name, again.gi_profile_id, again.memory_slices) == ("3g.40gb", 9, 4)


def test_the_whole_device_of_a_dynamic_gpu_records_its_full_size_profile_at_0() -> None:
    [dev] = record_of(planned("u", "gpu-0")).devices
    assert dev.kind == "gpu" and dev.dynamic_mig is not None
    assert (dev.dynamic_mig.profile, dev.dynamic_mig.placement_start) == ("7g.80gb", 0)


def test_admin_access_to_a_dynamic_device_creates_nothing() -> None:
    [dev] = record_of(planned("u", "gpu-0-dynmig-3g40gb-4", admin=True)).devices
    assert dev.admin_access and dev.dynamic_mig is None


def test_own_instances_are_the_recorded_ids() -> None:
    made = record_of(planned("a", "gpu-0-dynmig-3g40gb-4"), (3, 0, "MIG-a"))
    pending = record_of(planned("b", "gpu-0-dynmig-1g10gb-0"))
    cp = Checkpoint(claims={"a": made, "b": pending})
    assert own_instances(cp) == {("GPU-h100-0", 3)}


def test_an_instance_with_a_recorded_id_but_another_mig_uuid_is_not_own() -> None:
    # The claim's instance was destroyed outside Tessera and another tool made one at the same place, which NVML
    # gave the same GPU instance id: it is that tool's (its placements stay unpublished), not the claim's.
    made = record_of(planned("a", "gpu-0-dynmig-3g40gb-4"), (3, 0, "MIG-a"))
    other = instance("3g.40gb", 4, gi_id=3, size=4).model_copy(update={"gi_profile_id": 9, "uuid": "MIG-other"})
    cp = Checkpoint(claims={"a": made})
    assert own_instances(cp, inventory_of(h100(0, instances=(other,)))) == set()
    assert own_instances(cp, inventory_of(h100(0, instances=(other.model_copy(update={"uuid": "MIG-a"}),)))) == {
        ("GPU-h100-0", 3)}
    assert own_instances(cp) == {("GPU-h100-0", 3)}, "without an inventory: the recorded ids"


def test_an_instance_a_create_in_progress_made_is_own_too() -> None:
    creating = record_of(planned("a", "gpu-0-dynmig-3g40gb-4"))
    assert creating.devices[0].dynamic_mig is not None
    creating.devices[0].dynamic_mig.create_started = True
    made = instance("3g.40gb", 4, gi_id=5, size=4).model_copy(update={"gi_profile_id": 9})
    someone_elses = instance("1g.10gb", 0, gi_id=6)
    inventory = inventory_of(h100(0, instances=(made, someone_elses)))
    cp = Checkpoint(claims={"a": creating})
    assert own_instances(cp) == set()
    assert own_instances(cp, inventory) == {("GPU-h100-0", 5)}


# ----------------------------------------------------------------------------- placements


@pytest.mark.parametrize(("device", "refused"), [
    ("gpu-0-dynmig-1g10gb-5", True), ("gpu-0-dynmig-2g20gb-4", True), ("gpu-0", True),
    ("gpu-0-dynmig-3g40gb-0", False), ("gpu-0-dynmig-4g40gb-0", False), ("gpu-0-dynmig-1g10gb-3", False),
])
def test_a_placement_meeting_another_claims_is_refused(device: str, refused: bool) -> None:
    cp = Checkpoint(claims={"a": record_of(planned("a", "gpu-0-dynmig-3g40gb-4"))})
    claim_plan = planned("b", device)
    if refused:
        with pytest.raises(PrepareError, match=r"claim ns/c-a \(a\) holds; the allocation is stale"):
            check_placements_free(cp, claim_plan)
    else:
        check_placements_free(cp, claim_plan)


def test_the_claims_own_record_and_admin_access_are_not_in_its_way() -> None:
    claim_plan = planned("a", "gpu-0-dynmig-3g40gb-4")
    check_placements_free(Checkpoint(claims={"a": record_of(claim_plan)}), claim_plan)
    check_placements_free(Checkpoint(claims={"a": record_of(claim_plan)}),
                          planned("b", "gpu-0-dynmig-3g40gb-4", admin=True))


def test_instances_at_the_placement_and_in_its_way() -> None:
    intent = DynamicMigRecord(profile="3g.40gb", gi_profile_id=9, ci_profile_id=2, compute_slices=3, memory_slices=4,
                              memory_bytes=1, multiprocessors=60, placement_start=4)
    exact = CreatedMig(gi_id=1, gi_profile_id=9, placement_start=4, placement_size=4, uuid="MIG-x", ci_id=0)
    bare = MigGpuInstance(gi_id=2, gi_profile_id=9, placement_start=4, placement_size=4)
    inside = MigGpuInstance(gi_id=3, gi_profile_id=19, placement_start=5, placement_size=1)
    beside = MigGpuInstance(gi_id=4, gi_profile_id=19, placement_start=3, placement_size=1)
    found = [exact, bare, inside, beside]
    assert at_placement(intent, found) == [exact, bare], "only the profile at exactly the placement"
    assert overlapping(intent, found) == [exact, bare, inside]


# ----------------------------------------------------------------------------- MPS on created instances


def test_a_planned_daemon_moves_onto_the_created_instance() -> None:
    claim_plan = planned("u", "gpu-0-dynmig-3g40gb-4", configs=[mig_mps(defaultActiveThreadPercentage=30,
                                                                defaultPinnedDeviceMemoryLimit="4Gi")])
    [daemon] = claim_plan.daemons
    assert daemon.spec.gpu_uuids == ["GPU-h100-0"], "the parent GPU until the instance exists"
    assert daemon.exclusive_gpus == [], "a GPU in MIG mode is never EXCLUSIVE_PROCESS"
    moved = plan_on_instances(claim_plan, record_of(claim_plan, (1, 0, "MIG-new")))
    spec = moved.daemons[0].spec
    assert spec.gpu_uuids == ["MIG-new"] and spec.pinned_memory_limits == {"MIG-new": 4 * 2**30}
    assert spec.active_thread_percentage == 30
    assert started_record(claim_plan, NAMES, "p", None, "now").exclusive_gpus == []


def test_a_recreated_instance_takes_over_its_daemons_spec() -> None:
    spec = MpsDaemonSpec(daemon_id="claim-x-0", gpu_uuids=["MIG-old"], pinned_memory_limits={"MIG-old": 2**30},
                         active_thread_percentage=20)
    moved = spec_on_instance(spec, "MIG-new")
    assert moved.gpu_uuids == ["MIG-new"] and moved.pinned_memory_limits == {"MIG-new": 2**30}
    assert spec_on_instance(spec.model_copy(update={"pinned_memory_limits": {}}), "MIG-n").pinned_memory_limits == {}


def test_two_dynamic_devices_in_one_claim_are_two_instances() -> None:
    claim_plan = planned("u", "gpu-0-dynmig-1g10gb-0", "gpu-0-dynmig-1g10gb-1")
    assert [d.dynamic_mig.placement_start for d in record_of(claim_plan).devices if d.dynamic_mig] == [0, 1]


def test_two_dynamic_devices_on_one_mps_daemon_are_refused_with_the_reason() -> None:
    with pytest.raises(PrepareError, match="a CUDA process sees only one MIG device"):
        planned("u", "gpu-0-dynmig-1g10gb-0", "gpu-0-dynmig-1g10gb-1", configs=[mig_mps()])


def test_time_slicing_on_the_whole_device_of_a_dynamic_gpu_does_nothing() -> None:
    claim_plan = planned("u", "gpu-0", configs=[gpu_config(strategy="TimeSlicing")])
    assert claim_plan.timeslice is None


# ----------------------------------------------------------------------------- health


def test_a_dynamic_device_stands_for_its_profiles_instance_at_its_placement() -> None:
    mine = instance("3g.40gb", 4, gi_id=2, size=4).model_copy(update={"gi_profile_id": 9, "uuid": "MIG-mine"})
    other = instance("1g.10gb", 0, gi_id=3)
    v = view(mine, other)
    assert instance_uuid(v.targets["gpu-0-dynmig-3g40gb-4"]) == "MIG-mine"
    assert instance_uuid(v.targets["gpu-0-dynmig-3g40gb-0"]) is None
    assert instance_uuid(v.targets["gpu-0-dynmig-1g10gb-4"]) is None, "another profile at the same start"
    health = {"MIG-mine": UuidHealth("xid-94", "contained ECC error", 1.0, "GPU-h100-0")}
    assert set(unhealthy_devices(v.targets, health)) == {"gpu-0-dynmig-3g40gb-4"}


# ----------------------------------------------------------------------------- the checkpoint


def test_a_record_from_a_newer_driver_still_loads() -> None:
    placement = view().targets["gpu-0-dynmig-2g20gb-2"].placement
    assert placement is not None
    device = PreparedDeviceRecord.model_validate({
        "device": PreparedDevice(request_names=["r"], pool_name="p", device_name="d", cdi_device_ids=["x"]),
        "kind": "mig", "gpu_uuid": "GPU-1", "gpu_minor": 0,
        "dynamic_mig": {**intent_for(placement).model_dump(), "a_field_from_the_future": 1}})
    assert device.dynamic_mig is not None and device.dynamic_mig.placement_start == 2
    assert ClaimRecord(uid="u", namespace="n", name="c", phase=ClaimPhase.PREPARE_STARTED, cdi_spec_file="f",
                       devices=[device]).devices[0].dynamic_mig == device.dynamic_mig
