"""Sharing-plan entries for MIG instances (match.migProfile): matching, resolution, names, publishing and the
claim plan of a share (pure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from driver.gpu.claim.claimplan import plan_claim
from driver.gpu.claim.claimrecord import started_record
from driver.gpu.claim.sharecheck import check_no_overlap
from driver.gpu.claimcdi.edits import CdiNames
from driver.gpu.errors import PrepareError
from driver.gpu.published.devicenames import mig_device_name, mig_share_device_name, parse_device_name
from driver.gpu.published.devices import make_view
from driver.gpu.published.planmatch import Match
from driver.gpu.published.planuse import plan_use
from driver.gpu.published.sharelayout import Enforcement, plan_timeslices
from driver.gpu.published.sharingplan import PlanError, SharingPlan, entries_matching_no_gpu, resolve_plan
from driver.gpu.published.targets import drop_unfit, merge_layout
from driver.gpu.record.checkpoint import Checkpoint
from driver.simulation.discovery import SimulatedDiscovery
from driver.units import MIB
from tests.support.statenode import DRIVER, POOL, claim

INVENTORY = SimulatedDiscovery("demo", POOL).discover()
EXAMPLE = Path(__file__).resolve().parents[4] / "examples" / "sharing-plans.yaml"
H100, MIG_GPU, L4 = INVENTORY.gpus
THREE_G, TWO_G, ONE_G = sorted(MIG_GPU.mig_instances, key=lambda m: m.placement_start)
MIXED = {"gpus": [{"match": {"migProfile": "1g.10gb"}, "timeSlicing": {"shares": 2}},
                  {"match": {"product": "NVIDIA H100*", "migProfile": "3g.*"},
                   "mps": {"shares": 4, "activeThreadPercentage": 25}}]}


def plan(data: dict[str, Any]) -> SharingPlan:
    return SharingPlan.model_validate(data)


def plan_error(data: dict[str, Any]) -> str:
    with pytest.raises(ValidationError) as info:
        plan(data)
    return str(info.value)


# --- matching and entry forms --------------------------------------------------------------------


def test_a_mig_profile_glob_matches_instances_of_gpus_in_mig_mode_only() -> None:
    match = Match.model_validate({"migProfile": "1g.*"})
    assert match.for_instances and match.matches_instance(MIG_GPU, ONE_G)
    assert not match.matches_instance(MIG_GPU, THREE_G)
    assert match.describe() == "migProfile: 1g.*"
    narrowed = Match.model_validate({"minor": H100.minor, "migProfile": "*"})
    assert not narrowed.matches_instance(MIG_GPU, ONE_G), "the GPU selector narrows which GPUs' instances"
    assert narrowed.describe() == f"minor: {H100.minor}, migProfile: *"


@pytest.mark.parametrize(("match", "expected"), [
    ({"minor": 1, "product": "x", "migProfile": "*"}, "with migProfile set at most one of minor, uuid, product"),
    ({"migProfile": ""}, "migProfile must not be empty"),
    ({"migProfile": 3}, "migProfile"),
])
def test_mig_profile_selector_errors(match: dict[str, Any], expected: str) -> None:
    assert expected in plan_error({"gpus": [{"match": match, "timeSlicing": {"shares": 2}}]})


@pytest.mark.parametrize(("form", "expected"), [
    ({"consumable": {}}, "splits into mps or timeSlicing shares only, not consumable"),
    ({"dynamicMig": {}}, "not dynamicMig: dynamicMig applies to whole GPUs in MIG mode"),
    ({"whole": True}, "not whole: an instance no migProfile entry matches is published whole already"),
])
def test_a_mig_profile_entry_takes_mps_or_time_slicing_only(form: dict[str, Any], expected: str) -> None:
    assert expected in plan_error({"gpus": [{"match": {"migProfile": "1g.10gb"}, **form}]})


def test_a_time_slice_interval_cannot_be_set_for_a_mig_instance() -> None:
    message = plan_error({"gpus": [{"match": {"migProfile": "*"}, "timeSlicing": {"shares": 2, "interval": "Long"}}]})
    assert "timeSlicing.interval Long cannot be set for a MIG instance" in message
    assert "nvidia-smi compute-policy --set-timeslice" in message


# --- resolution ----------------------------------------------------------------------------------


def test_matching_instances_get_shares_keyed_by_mig_uuid_with_limits_relative_to_the_instance() -> None:
    layout = resolve_plan(plan(MIXED), INVENTORY, "p").layout
    assert set(layout) == {ONE_G.uuid, THREE_G.uuid}, "the 2g instance and the other GPUs stay as they are"
    ts, mps = layout[ONE_G.uuid], layout[THREE_G.uuid]
    assert (ts.strategy, ts.count, ts.mig_profile) == ("TimeSlicing", 2, "1g.10gb")
    assert ts.memory_bytes_per_share == ONE_G.memory_bytes // 2 // MIB * MIB  # type: ignore[operator]
    assert (mps.strategy, mps.count, mps.active_thread_percentage, mps.mig_profile) == ("MPS", 4, 25, "3g.40gb")
    assert mps.memory_bytes_per_share == THREE_G.memory_bytes // 4 // MIB * MIB  # type: ignore[operator]
    assert plan_timeslices(layout) == {}, "a MIG instance takes no time slice setting"


def test_gpu_entries_and_instance_entries_are_matched_separately_first_match_wins_in_each() -> None:
    data = {"gpus": [{"match": {"all": True}, "whole": True},
                     {"match": {"migProfile": "1g.10gb"}, "mps": {"shares": 2}},
                     {"match": {"migProfile": "*"}, "timeSlicing": {"shares": 3}}]}
    layout = resolve_plan(plan(data), INVENTORY, "p").layout
    assert layout[ONE_G.uuid].strategy == "MPS"
    assert {layout[THREE_G.uuid].strategy, layout[TWO_G.uuid].strategy} == {"TimeSlicing"}
    assert H100.uuid not in layout and MIG_GPU.uuid not in layout


def test_a_gpu_selector_that_takes_no_mig_gpu_shares_nothing_and_is_reported_unmatched() -> None:
    data = {"gpus": [{"match": {"product": "NVIDIA L4", "migProfile": "*"}, "timeSlicing": {"shares": 2}}]}
    assert resolve_plan(plan(data), INVENTORY, "p").layout == {}
    assert entries_matching_no_gpu(plan(data), INVENTORY, "p") == [
        "plans.p.gpus[0] (match product: NVIDIA L4, migProfile: *)"]
    assert entries_matching_no_gpu(plan(MIXED), INVENTORY, "p") == []


def test_more_mps_shares_than_an_instance_serves_is_a_plan_error_naming_the_instance() -> None:
    data = {"gpus": [{"match": {"migProfile": "1g.10gb"}, "mps": {"shares": 7}}]}
    with pytest.raises(PlanError) as info:
        resolve_plan(plan(data), INVENTORY, "p")
    assert str(info.value).startswith(f"plans.p.gpus[0] (GPU minor 1, {MIG_GPU.uuid}, NVIDIA H100 80GB HBM3, MIG "
                                      f"instance 1g.10gb at 6, {ONE_G.uuid}): mps.shares 7 is more than the 6 MPS")
    ok = {"gpus": [{"match": {"migProfile": "3g.40gb"}, "mps": {"shares": 20}}]}  # 48 x 3/7 compute slices
    assert resolve_plan(plan(ok), INVENTORY, "p").layout[THREE_G.uuid].count == 20


def test_an_explicit_limit_beyond_the_instances_memory_is_a_plan_error() -> None:
    data = {"gpus": [{"match": {"migProfile": "1g.10gb"}, "mps": {"shares": 2, "pinnedMemoryLimit": "8Gi"}}]}
    with pytest.raises(PlanError, match=r"2 shares x mps.pinnedMemoryLimit 8192 MiB is more than the MIG "
                                        r"instance's 9984 MiB"):
        resolve_plan(plan(data), INVENTORY, "p")


def test_instance_entries_do_not_apply_to_a_dynamic_mig_gpu() -> None:
    inventory = SimulatedDiscovery("dynamic-mig", POOL).discover()
    data = {"gpus": [{"match": {"minor": 0}, "dynamicMig": {}},
                     {"match": {"migProfile": "*"}, "timeSlicing": {"shares": 2}}]}
    dynamic = inventory.gpus[0].model_copy(update={"mig_instances": (THREE_G,)})
    inventory = inventory.model_copy(update={"gpus": (dynamic, *inventory.gpus[1:])})
    # The instance is one Tessera made for a claim (a foreign one would make the GPU static again: published as
    # its MIG devices, whose instances the migProfile entry then splits).
    resolved = resolve_plan(plan(data), inventory, "p", own_instances=((dynamic.uuid, THREE_G.gi_id),))
    assert set(resolved.layout) == {dynamic.uuid} and resolved.layout[dynamic.uuid].dynamic_mig is not None
    assert "plans.p.gpus[1] (migProfile) not applied: the GPU is dynamic MIG" in resolved.notes[dynamic.uuid]


# --- names ---------------------------------------------------------------------------------------


def test_share_names_extend_the_instance_name_and_parse_back() -> None:
    name = mig_share_device_name(1, "1g.10gb+me", 6, "TimeSlicing", 1)
    assert name == "gpu-1-mig-1g10gbme-6-ts-1"
    parsed = parse_device_name(name)
    assert (parsed.kind, parsed.minor, parsed.mig_profile, parsed.placement_start, parsed.share_index) == (
        "timeslice", 1, "1g10gbme", 6, 1)
    assert parse_device_name("gpu-0-mig-1g10gb-me-3-mps-0").kind == "mps"
    assert parse_device_name("gpu-0-mig-1g10gb-me-3").kind == "mig", "an instance's own name stays a MIG device"
    assert name != mig_device_name(1, "1g.10gb+me", 6)


def test_a_profile_whose_instance_name_would_read_as_a_share_is_refused() -> None:
    with pytest.raises(ValueError, match="reads as a share's name"):
        mig_device_name(0, "1g-2-ts", 3)


# --- publishing ----------------------------------------------------------------------------------


def test_a_shared_instance_is_published_as_its_shares_in_place_of_its_mig_device() -> None:
    view = make_view(INVENTORY, resolve_plan(plan(MIXED), INVENTORY, "p").layout)
    assert [d.name for d in view.devices] == [
        "gpu-0",
        *(f"gpu-1-mig-3g40gb-0-mps-{k}" for k in range(4)),
        "gpu-1-mig-2g20gb-4",
        "gpu-1-mig-1g10gb-6-ts-0", "gpu-1-mig-1g10gb-6-ts-1",
        "gpu-2"]
    share = next(d for d in view.devices if d.name == "gpu-1-mig-3g40gb-0-mps-2")
    attrs = {k: v.model_dump(by_alias=True, exclude_none=True) for k, v in share.attributes.items()}
    assert attrs["type"] == {"string": "mps"} and attrs["profile"] == {"string": "3g.40gb"}
    assert attrs["migUUID"] == {"string": THREE_G.uuid} and attrs["parentUUID"] == {"string": MIG_GPU.uuid}
    assert attrs["shareIndex"] == {"int": 2} and attrs["activeThreadPercentage"] == {"int": 25}
    assert attrs["memoryLimitEnforcement"] == {"string": Enforcement.MPS_ADVISORY.value}, \
        "the GPU stays in DEFAULT: a client that leaves MPS runs beside the daemon"
    assert share.capacity["memory"].value == f"{THREE_G.memory_bytes // 4 // MIB}Mi"  # type: ignore[operator]
    ts = next(d for d in view.devices if d.name == "gpu-1-mig-1g10gb-6-ts-0")
    assert ts.attributes["timeSliceInterval"].model_dump(by_alias=True, exclude_none=True) == {"string": "Default"}
    target = view.targets["gpu-1-mig-3g40gb-0-mps-2"]
    assert (target.kind, target.mig, target.share_index, target.cuda_uuid) == ("mps", THREE_G, 2, THREE_G.uuid)
    assert view.targets["gpu-1-mig-2g20gb-4"].kind == "mig"


def test_plan_use_describes_each_instance() -> None:
    resolved = resolve_plan(plan(MIXED), INVENTORY, "p")
    use = plan_use(plan(MIXED), "p", None, "test", INVENTORY, resolved.layout)
    [mig] = [g for g in use.gpus if g.minor == 1]
    assert mig.entry == "plans.p.gpus[0], plans.p.gpus[1]"
    assert mig.published == (
        "its 3 MIG device(s) (3g.40gb at 0 as 4 MPS shares, each memory 10112Mi (pinned limit), 25% of the SMs, "
        "clients nonRoot, limits advisory; 2g.20gb at 4; 1g.10gb at 6 as 2 time-sliced shares, each memory 4992Mi "
        "(not enforced))")
    assert [g.entry for g in use.gpus if g.minor != 1] == [None, None]


def test_check_plan_accepts_and_describes_mig_profile_entries(capsys: pytest.CaptureFixture[str]) -> None:
    from driver.cli import main

    assert main(["check-plan", str(EXAMPLE), "--plan", "mig-shared", "--simulate", "demo"]) == 0
    out = capsys.readouterr().out
    assert "plans.mig-shared.gpus[1]: match product: NVIDIA H100*, migProfile: 3g.40gb -> mps" in out
    assert ("NVIDIA H100 80GB HBM3: plans.mig-shared.gpus[0], plans.mig-shared.gpus[1] -> its 3 MIG device(s) "
            "(3g.40gb at 0 as 4 MPS shares") in out
    assert "WARNING" not in out


# --- claims --------------------------------------------------------------------------------------

VIEW = make_view(INVENTORY, resolve_plan(plan(MIXED), INVENTORY, "p").layout)


def claim_plan(uid: str, *devices: str) -> Any:
    return plan_claim(claim(uid, *devices), driver_name=DRIVER, pool_name=POOL, view=VIEW)


def test_an_instance_share_is_served_by_the_instances_daemon_with_the_instances_limits() -> None:
    p = claim_plan("u1", "gpu-1-mig-3g40gb-0-mps-1")
    [daemon] = p.daemons
    assert daemon.shared and daemon.spec.gpu_uuids == [THREE_G.uuid]
    assert daemon.spec.pinned_memory_limits == {THREE_G.uuid: THREE_G.memory_bytes // 4 // MIB * MIB}  # type: ignore[operator]
    assert daemon.spec.active_thread_percentage == 25 and daemon.exclusive_gpus == [], "MIG allows only DEFAULT"
    assert claim_plan("u2", "gpu-1-mig-3g40gb-0-mps-3").daemons[0].daemon_id == daemon.daemon_id
    assert claim_plan("u3", "gpu-1-mig-1g10gb-6-ts-0").daemons == ()
    assert claim_plan("u3", "gpu-1-mig-1g10gb-6-ts-0").timeslice is None


def test_two_shares_of_one_instance_in_one_claim_are_refused() -> None:
    with pytest.raises(PrepareError, match="2 shares of one MIG instance"):
        claim_plan("u1", "gpu-1-mig-1g10gb-6-ts-0", "gpu-1-mig-1g10gb-6-ts-1")


def _held(*claims: tuple[str, str]) -> Checkpoint:
    cp = Checkpoint()
    for uid, device in claims:
        cp.claims[uid] = started_record(claim_plan(uid, device), CdiNames(DRIVER), POOL, None, "")
    return cp


def test_an_instance_held_whole_is_not_also_handed_out_as_a_share_and_others_are_free() -> None:
    whole_view = make_view(INVENTORY, {})
    cp = Checkpoint()
    held = plan_claim(claim("old", "gpu-1-mig-1g10gb-6"), driver_name=DRIVER, pool_name=POOL, view=whole_view)
    cp.claims["old"] = started_record(held, CdiNames(DRIVER), POOL, None, "")
    with pytest.raises(PrepareError, match="already prepared for claim"):
        check_no_overlap(cp, claim_plan("new", "gpu-1-mig-1g10gb-6-ts-0"))
    check_no_overlap(cp, claim_plan("other", "gpu-1-mig-3g40gb-0-mps-0"))
    check_no_overlap(_held(("a", "gpu-1-mig-1g10gb-6-ts-0")), claim_plan("b", "gpu-1-mig-1g10gb-6-ts-1"))


def test_a_held_instance_keeps_its_form_through_a_plan_change_and_others_change() -> None:
    layout = resolve_plan(plan(MIXED), INVENTORY, "p").layout
    cp = _held(("a", "gpu-1-mig-1g10gb-6-ts-0"))
    busy = {key for record in cp.claims.values() for key in record.held_layout_keys}
    assert ONE_G.uuid in busy and THREE_G.uuid not in busy
    effective, deferred = merge_layout(layout, {}, busy)
    assert effective == {ONE_G.uuid: layout[ONE_G.uuid]} and deferred == {ONE_G.uuid}
    assert cp.claims["a"].devices[0].layout_key == ONE_G.uuid
    assert (cp.claims["a"].devices[0].mig_gi_id, cp.claims["a"].devices[0].mig_ci_id) == (ONE_G.gi_id, ONE_G.ci_id)


def test_instance_shares_are_dropped_once_mig_mode_is_off() -> None:
    layout = resolve_plan(plan(MIXED), INVENTORY, "p").layout
    assert drop_unfit(layout, {}, INVENTORY) == (layout, set())
    plain = MIG_GPU.model_copy(update={"mig_enabled": False})
    off = INVENTORY.model_copy(update={"gpus": (H100, plain, L4)})
    assert drop_unfit(layout, {}, off) == ({}, {ONE_G.uuid, THREE_G.uuid})


def test_an_instances_mps_shares_are_probed_and_reported_for_multi_user_mode_by_its_mig_uuid() -> None:
    from driver.gpu.runtime.multiuser import plan_mps_gpus, probe_gpu, single_user_gpus

    layout = resolve_plan(plan(MIXED), INVENTORY, "p").layout
    assert plan_mps_gpus(INVENTORY, layout) == [THREE_G.uuid], "the time-sliced instance has no daemon"
    assert probe_gpu(INVENTORY, layout) == THREE_G.uuid  # an H100: compute capability 9.0
    assert single_user_gpus(INVENTORY, layout, False) == [THREE_G.uuid]
    assert single_user_gpus(INVENTORY, layout, True) == []


def test_a_root_pod_on_an_instances_shared_daemon_is_refused_naming_the_instance() -> None:
    from driver.gpu.claim.tenancy import check_clients, claim_enforcement
    from driver.kubeletplugin.claimmodel import ResourceClaim
    from driver.kubeletplugin.podspec import Pod
    from driver.kubeletplugin.types import Deadline

    class RootPods:
        def read_pods(self, refs: Any, timeout_s: float) -> list[Pod | None]:
            return [Pod.model_validate({"metadata": {"namespace": ns, "name": name, "uid": uid},
                                        "spec": {"containers": [{"name": "main"}]}})
                    for ns, name, uid in refs]

    data = claim("u1", "gpu-1-mig-3g40gb-0-mps-1").model_dump(by_alias=True)
    data["status"]["reservedFor"] = [{"resource": "pods", "name": "train-0", "uid": "pod-uid"}]
    root = ResourceClaim.model_validate(data).with_pod_reader(RootPods())
    p = claim_plan("u1", "gpu-1-mig-3g40gb-0-mps-1")
    with pytest.raises(PrepareError, match="MPS daemon shared with other claims on gpu-1-mig-3g40gb-0 admits only"):
        check_clients(root, p, Deadline.after(5))
    assert claim_enforcement(p, INVENTORY.driver_version) == ("nonRoot", Enforcement.MPS_ADVISORY)
