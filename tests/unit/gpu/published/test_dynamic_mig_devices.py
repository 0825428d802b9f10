"""Dynamic MIG devices: one per placement of each allowed profile, the whole GPU beside them, the
GPU's counter set, and what each name stands for (devices.make_view, targets.DeviceTarget)."""

from __future__ import annotations

from typing import Any

import pytest

from driver.gpu.published.devicenames import counter_set_name, parse_device_name
from driver.gpu.published.devices import make_view
from driver.gpu.published.sharelayout import DynamicMigPolicy, GpuForm
from driver.gpu.published.targets import NodeView
from driver.kubeletplugin.slicelimits import limits_for
from driver.kubeletplugin.slicevalidation import validate_devices
from driver.units import MIB
from tests.support.mig import H100_MEMORY, h100, instance, inventory_of, l4

ALL_H100 = ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")  # table order


def dynamic(profiles: tuple[str, ...] = ALL_H100, whole: bool = True) -> GpuForm:
    return GpuForm(strategy="DynamicMig", count=1, memory_bytes_per_share=H100_MEMORY,
                     dynamic_mig=DynamicMigPolicy(profiles=profiles, also_whole_gpu=whole))


def view(*profiles: str, whole: bool = True, **gpu: Any) -> NodeView:
    g = h100(1, **gpu)
    return make_view(inventory_of(g), {g.uuid: dynamic(profiles or ALL_H100, whole)})


def wire(v: NodeView, name: str) -> dict[str, Any]:
    return next(d.to_wire() for d in v.devices if d.name == name)


def test_one_device_per_placement_of_each_allowed_profile_after_the_whole_gpu() -> None:
    v = view("1g.10gb", "3g.40gb")
    assert [d.name for d in v.devices] == [
        "gpu-1", *(f"gpu-1-dynmig-1g10gb-{s}" for s in range(7)), "gpu-1-dynmig-3g40gb-0", "gpu-1-dynmig-3g40gb-4"]
    assert len(view().devices) == 1 + 7 + 7 + 4 + 3 + 2 + 1 + 1  # every H100 placement


def test_names_parse_like_static_mig_names() -> None:
    parsed = parse_device_name("gpu-1-dynmig-1g10gbme-3")
    assert (parsed.kind, parsed.minor, parsed.mig_profile, parsed.placement_start) == ("mig", 1, "1g10gbme", 3)
    assert "gpu-1-dynmig-1g10gbme-3" in view().targets


def test_placement_device_has_the_static_mig_attributes_less_the_uuid_plus_placement() -> None:
    dev = wire(view("3g.40gb"), "gpu-1-dynmig-3g40gb-4")
    attributes = dev["attributes"]
    assert attributes["type"] == {"string": "mig"} and attributes["profile"] == {"string": "3g.40gb"}
    assert attributes["placement"] == {"int": 4}
    assert attributes["parentUUID"] == {"string": "GPU-h100-1"}
    assert "uuid" not in attributes, "no MIG UUID exists before prepare creates the instance"
    assert attributes["productName"] == {"string": "NVIDIA H100 80GB HBM3"}
    assert dev["capacity"] == {"multiprocessors": {"value": "60"}, "copyEngines": {"value": "3"},
                               "memory": {"value": "40448Mi"},
                               **{f"memorySlice{i}": {"value": "1"} for i in range(4, 8)}}


def test_placement_consumes_its_profile_and_its_memory_slices() -> None:
    dev = wire(view("3g.40gb"), "gpu-1-dynmig-3g40gb-4")
    assert dev["consumesCounters"] == [{"counterSet": "gpu-1-counter-set", "counters": {
        "copy-engines": {"value": "3"}, "memory": {"value": "40448Mi"}, "multiprocessors": {"value": "60"},
        **{f"memory-slice-{i}": {"value": "1"} for i in range(4, 8)}}}]


def test_counter_set_of_the_gpu() -> None:
    [counter_set] = view("1g.10gb").counter_sets
    assert counter_set.name == counter_set_name(1) == "gpu-1-counter-set"
    assert {k: c.value for k, c in counter_set.counters.items()} == {
        "multiprocessors": "132", "copy-engines": "7", "memory": "81559Mi",
        **{f"memory-slice-{i}": "1" for i in range(8)}}


def test_whole_gpu_consumes_every_counter_and_stands_for_the_full_profile() -> None:
    v = view("1g.10gb")
    whole = wire(v, "gpu-1")
    assert whole["attributes"]["type"] == {"string": "gpu"} and whole["attributes"]["uuid"] == {"string": "GPU-h100-1"}
    [counter_set] = v.counter_sets
    assert whole["consumesCounters"] == [
        {"counterSet": counter_set.name, "counters": counter_set.to_wire()["counters"]}]
    target = v.targets["gpu-1"]
    assert target.kind == "gpu" and target.creates_mig_instance and target.placement is not None
    assert (target.placement.profile.name, target.placement.start) == ("7g.80gb", 0)


def test_also_whole_gpu_false_leaves_the_whole_gpu_out() -> None:
    v = view("1g.10gb", whole=False)
    assert "gpu-1" not in v.targets and len(v.devices) == 7


def test_targets_carry_the_placement_for_the_prepare_path() -> None:
    v = view("3g.40gb")
    target = v.targets["gpu-1-dynmig-3g40gb-4"]
    assert target.kind == "mig" and target.mig is None and target.creates_mig_instance
    assert target.placement is not None and target.placement.start == 4 and target.placement.size == 4
    assert target.placement.profile.gi_profile_id == 9 and target.placement.profile.ci_profile_id == 2
    assert target.form is not None and target.form.strategy == "DynamicMig"
    assert target.memory_bytes == 40448 * MIB
    assert target.cuda_uuid == "GPU-h100-1", "no MIG UUID until the instance exists"


def test_devices_stay_within_the_api_limits_at_every_release() -> None:
    v = view()
    for minor in (34, 35, 36, 37):
        assert validate_devices(v.devices, "gpu.tessera.dev", limits_for(minor)) == []


def test_own_instances_are_not_published_as_static_mig_devices() -> None:
    created = instance("1g.10gb", 2, gi_id=7)
    foreign = instance("1g.10gb", 5, gi_id=8)
    g = h100(0, instances=(created, foreign))
    v = make_view(inventory_of(g), {}, own_instances={(g.uuid, 7)})
    assert [d.name for d in v.devices] == ["gpu-0-mig-1g10gb-5"]


def test_a_dynamic_gpu_ignores_its_instances_they_are_its_claims_placements() -> None:
    g = h100(0, instances=(instance("1g.10gb", 2, gi_id=7),))
    v = make_view(inventory_of(g), {g.uuid: dynamic(("1g.10gb",))})
    assert "gpu-0-dynmig-1g10gb-2" in v.targets and v.targets["gpu-0-dynmig-1g10gb-2"].mig is None


def test_a_gpu_kept_dynamic_offers_nothing_over_an_instance_tessera_did_not_create() -> None:
    # A GPU stays dynamic while claims are prepared on it (merge_layout), even after someone else creates an
    # instance there (e.g. after a reboot, before recovery re-created the claims'). The scheduler does not count
    # that instance: a placement over it, or the whole GPU, would be allocated and then fail at every prepare.
    created = instance("3g.40gb", 4, gi_id=7, size=4)
    foreign = instance("1g.10gb", 1, gi_id=8)
    g = h100(0, instances=(created, foreign))
    v = make_view(inventory_of(g), {g.uuid: dynamic()}, own_instances={(g.uuid, 7)})
    over_foreign = {name for name, t in v.targets.items()
                    if t.placement is not None and t.placement.start <= 1 < t.placement.start + t.placement.size}
    assert over_foreign == set(), "no placement covering memory slice 1"
    assert "gpu-0" not in v.targets, "the whole GPU covers the other instance too"
    assert {"gpu-0-dynmig-3g40gb-4", "gpu-0-dynmig-1g10gb-0", "gpu-0-dynmig-1g10gb-2",
            "gpu-0-dynmig-2g20gb-2"} <= set(v.targets), "placements clear of it stay, the claim's own included"
    assert [d.name for d in v.devices] == list(v.targets) and len(v.counter_sets) == 1


def test_other_gpus_keep_their_forms_beside_a_dynamic_one() -> None:
    g = h100(0)
    v = make_view(inventory_of(g, l4(1)), {g.uuid: dynamic(("7g.80gb",))})
    assert [d.name for d in v.devices] == ["gpu-0", "gpu-0-dynmig-7g80gb-0", "gpu-1"]
    assert not wire(v, "gpu-1").get("consumesCounters") and len(v.counter_sets) == 1


def test_a_gpu_without_mig_mode_cannot_be_dynamic() -> None:
    g = h100(0, mig_enabled=False)
    with pytest.raises(ValueError, match="not in MIG mode"):
        make_view(inventory_of(g), {g.uuid: dynamic()})


def test_a_dynamic_gpu_whose_profiles_vanished_publishes_nothing_rather_than_uncounted_devices() -> None:
    g = h100(0, table=())
    v = make_view(inventory_of(g), {g.uuid: dynamic()})
    assert v.devices == () and v.counter_sets == ()


def test_dynamic_form_needs_its_policy() -> None:
    with pytest.raises(ValueError, match="dynamic MIG policy goes with strategy DynamicMig"):
        GpuForm(strategy="DynamicMig", count=1, memory_bytes_per_share=1)
    with pytest.raises(ValueError, match="no share count"):
        GpuForm(strategy="DynamicMig", count=2, memory_bytes_per_share=1,
                  dynamic_mig=DynamicMigPolicy(profiles=("1g.10gb",)))
    assert dynamic().device_type == "mig"
