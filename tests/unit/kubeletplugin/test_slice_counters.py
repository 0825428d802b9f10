"""Counter sets in ResourceSlices: the split (1.35+) and combined (1.34) layouts of a node with dynamic
MIG GPUs, checked against each release's strict schema and the API server double's rules, and every
counter limit caught before publishing."""

from __future__ import annotations

from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from driver.gpu.published.devices import make_view
from driver.gpu.published.sharelayout import DynamicMigPolicy, GpuForm
from driver.gpu.published.targets import NodeView
from driver.kubeletplugin.slicelimits import limits_for
from driver.kubeletplugin.slicemodel import CounterSet, Device, DeviceCounterConsumption, PlannedSlice, counters
from driver.kubeletplugin.sliceplanner import InvalidDevices, canonical_spec, plan_slices, slice_writes
from driver.simulation.apiobjects import ApiError
from driver.simulation.apiserver import FakeApiServer
from tests.support.mig import H100_MEMORY, h100, inventory_of, l4

DRIVER = "gpu.tessera.dev"
NODE = "node-1"
ALL_H100 = ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")  # table order


def dynamic_view(h100s: int, *, with_l4: bool = True) -> NodeView:
    gpus = [h100(i) for i in range(h100s)] + ([l4(h100s)] if with_l4 else [])
    shares = GpuForm(strategy="DynamicMig", count=1, memory_bytes_per_share=H100_MEMORY,
                       dynamic_mig=DynamicMigPolicy(profiles=ALL_H100))
    return make_view(inventory_of(*gpus), {g.uuid: shares for g in gpus[:h100s]})


def slice_objects(slices: list[PlannedSlice]) -> list[dict[str, Any]]:
    return slice_writes([], slices, driver_name=DRIVER, node_name=NODE, owner=None, adopted={}).creates


def planned(view: NodeView, minor: int) -> list[PlannedSlice]:
    return plan_slices(list(view.devices), DRIVER, limits_for(minor), list(view.counter_sets))


def shape(slices: list[PlannedSlice]) -> list[tuple[int, list[str]]]:
    return [(len(s.devices), [c.name for c in s.shared_counters]) for s in slices]


def test_split_layout_from_1_35_counters_first_then_devices() -> None:
    view = dynamic_view(2)
    for minor in (35, 36, 37):
        assert shape(planned(view, minor)) == [(0, ["gpu-0-counter-set", "gpu-1-counter-set"]), (53, [])]


def test_combined_layout_on_1_34_one_slice_per_gpu_with_its_counter_set() -> None:
    assert shape(planned(dynamic_view(2), 34)) == [(1, []), (26, ["gpu-0-counter-set"]), (26, ["gpu-1-counter-set"])]


def test_more_than_8_counter_sets_take_more_counter_slices_and_devices_split_at_64() -> None:
    slices = planned(dynamic_view(9, with_l4=False), 36)
    assert [len(s.shared_counters) for s in slices] == [8, 1, 0, 0, 0, 0]
    assert [len(s.devices) for s in slices[2:]] == [64, 64, 64, 42]  # 9 x 26 = 234 devices, all consuming


@pytest.mark.parametrize("minor", [34, 35, 36, 37])
def test_every_slice_passes_the_strict_schema_and_the_api_servers_rules(minor: int) -> None:
    objects = slice_objects(planned(dynamic_view(3), minor))
    counts = {o["spec"]["pool"]["resourceSliceCount"] for o in objects}
    assert counts == {len(objects)} and {o["spec"]["pool"]["generation"] for o in objects} == {1}
    fake = FakeApiServer(minor_version=minor, partitionable_devices_gate=True)
    for obj in objects:
        kubernetes_validate.validate(obj, f"1.{minor}", strict=True)
        stored = fake.create_object("resourceslices", "", obj)
        assert canonical_spec(stored["spec"]) == canonical_spec(obj["spec"]), "nothing dropped or changed"
    names = [d["name"] for o in objects for d in o["spec"].get("devices", [])]
    assert len(names) == len(set(names)) == 3 * 26 + 1
    sets = {c["name"] for o in objects for c in o["spec"].get("sharedCounters", [])}
    consumed = {e["counterSet"] for o in objects for d in o["spec"].get("devices", [])
                for e in d.get("consumesCounters", [])}
    assert consumed == sets == {"gpu-0-counter-set", "gpu-1-counter-set", "gpu-2-counter-set"}


def test_counter_quantities_compare_by_value() -> None:
    [obj] = slice_objects([PlannedSlice(shared_counters=(CounterSet(name="s", counters=counters({"m": "1Gi"})),))])
    stored = {**obj["spec"], "sharedCounters": [{"name": "s", "counters": {"m": {"value": "1024Mi"}}}]}
    assert canonical_spec(stored) == canonical_spec(obj["spec"])
    assert "devices" not in obj["spec"], "a counters-only slice sends no devices"


# ----- limits caught before publishing ------------------------------------------------------


def counter_set(name: str, count: int) -> CounterSet:
    return CounterSet(name=name, counters=counters({f"c-{i}": "1" for i in range(count)}))


def consumer(name: str, *entries: tuple[str, int]) -> Device:
    return Device(name=name, consumes_counters=tuple(
        DeviceCounterConsumption(counter_set=s, counters=counters({f"c-{i}": "1" for i in range(n)}))
        for s, n in entries))


def problems(devices: list[Device], sets: list[CounterSet], minor: int) -> list[str]:
    with pytest.raises(InvalidDevices) as refused:
        plan_slices(devices, DRIVER, limits_for(minor), sets)
    return refused.value.problems


def test_more_than_32_counters_in_a_set() -> None:
    assert problems([], [counter_set("s", 33)], 36) == [
        'counter set "s": has 33 counters, the limit is 32 on Kubernetes 1.36']
    assert problems([], [counter_set("s", 33)], 34) == [
        'counter set "s": has 33 counters, the limit is 32 on Kubernetes 1.34']
    # 1.34 counts every set of a slice: two sets one device consumes from must share its slice.
    both = [consumer("d", ("a", 1), ("b", 1))]
    assert problems(both, [counter_set("a", 20), counter_set("b", 20)], 34) == [
        "slice 0: its counter sets hold 40 counters, the limit is 32 per slice on Kubernetes 1.34"]
    assert shape(plan_slices([], DRIVER, limits_for(34), [counter_set("a", 20), counter_set("b", 20)])) == [
        (0, ["a"]), (0, ["b"])]
    plan_slices(both, DRIVER, limits_for(36), [counter_set("a", 20), counter_set("b", 20)])  # fine from 1.35


def test_consumption_limits_per_release() -> None:
    sets = [counter_set("a", 32), counter_set("b", 32), counter_set("c", 32)]
    assert problems([consumer("d", ("a", 1), ("b", 1), ("c", 1))], sets, 36) == [
        'device "d": consumes from 3 counter sets, the limit is 2 on Kubernetes 1.36']
    assert problems([consumer("d", ("a", 1), ("a", 1))], sets, 35) == [
        'device "d": consumes from counter set "a" in more than one entry']
    assert problems([consumer("d", ("a", 20), ("b", 20))], sets, 34)[0] == (
        'device "d": consumes 40 counters, the limit is 32 per device on Kubernetes 1.34')


def test_1_34_caps_the_counters_a_slice_consumes_at_1024() -> None:
    devices = [consumer(f"d-{i}", ("a", 32)) for i in range(33)]
    assert problems(devices, [counter_set("a", 32)], 34) == [
        "slice 0: its devices consume 1056 counters in all, the limit is 1024 per slice on Kubernetes 1.34"]
    plan_slices(devices, DRIVER, limits_for(35), [counter_set("a", 32)])  # split: no such limit


def test_1_34_cannot_spread_one_sets_devices_over_slices() -> None:
    devices = [consumer(f"d-{i}", ("a", 1)) for i in range(129)]
    assert problems(devices, [counter_set("a", 1)], 34) == [
        "slice 0: 129 devices share its counter sets, the limit is 128 devices per slice on Kubernetes 1.34"]
    assert [len(s.devices) for s in plan_slices(devices, DRIVER, limits_for(35), [counter_set("a", 1)])] == [
        0, 64, 64, 1]


def test_pool_wide_rules_the_api_server_does_not_check() -> None:
    found = problems([consumer("d", ("missing", 1)), consumer("e", ("a", 2))],
                     [counter_set("a", 1), counter_set("a", 1), CounterSet(name="Bad_Name", counters={})], 36)
    assert found == [
        'counter set "a": name is used more than once in the pool',
        'counter set "Bad_Name": name must be a DNS label (at most 63 lower-case alphanumerics or \'-\', starting '
        "and ending with one)",
        'counter set "Bad_Name": has no counters',
        'device "d": counter set "missing": no such counter set in the pool',
        'device "e": counter set "a": counter "c-1": the counter set has no such counter']


def test_a_device_that_could_never_fit_its_set_is_refused() -> None:
    too_big = Device(name="d", consumes_counters=(
        DeviceCounterConsumption(counter_set="a", counters=counters({"memory": "2Gi"})),))
    assert problems([too_big], [CounterSet(name="a", counters=counters({"memory": "1Gi"}))], 36) == [
        'device "d": counter set "a": counter "memory": consumes 2Gi, more than the set\'s 1073741824']


# ----- the API server double's own rules ----------------------------------------------------


def body(spec: dict[str, Any]) -> dict[str, Any]:
    full = {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 1, "resourceSliceCount": 1},
            **spec}
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": "s"}, "spec": full}


def rejected(minor: int, spec: dict[str, Any]) -> str:
    fake = FakeApiServer(minor_version=minor, partitionable_devices_gate=True)
    with pytest.raises(ApiError) as err:
        fake.create_object("resourceslices", "", body(spec))
    assert err.value.code == 422 and err.value.reason == "Invalid"
    return err.value.message


def wire_set(name: str, count: int) -> dict[str, Any]:
    return counter_set(name, count).to_wire()


def wire_device(name: str, *entries: tuple[str, int]) -> dict[str, Any]:
    return consumer(name, *entries).to_wire()


def test_double_refuses_devices_beside_counter_sets_from_1_35_only() -> None:
    spec = {"sharedCounters": [wire_set("a", 2)], "devices": [wire_device("d", ("a", 2))]}
    assert "spec: Invalid value: only one of `devices` or `sharedCounters` may be set" in rejected(35, spec)
    FakeApiServer(minor_version=34, partitionable_devices_gate=True).create_object("resourceslices", "", body(spec))


def test_double_enforces_the_numeric_limits_per_release() -> None:
    assert "spec.sharedCounters: Too many: 9: must have at most 8 items" in rejected(
        36, {"sharedCounters": [wire_set(f"s-{i}", 1) for i in range(9)]})
    assert "spec.sharedCounters[0].counters: Too many: 33: must have at most 32 items" in rejected(
        36, {"sharedCounters": [wire_set("s", 33)]})
    assert "spec.devices[0].consumesCounters: Too many: 3: must have at most 2 items" in rejected(
        36, {"devices": [wire_device("d", ("a", 1), ("b", 1), ("c", 1))]})
    assert 'spec.devices[0].consumesCounters[1].counterSet: Duplicate value: "a"' in rejected(
        35, {"devices": [wire_device("d", ("a", 1), ("a", 1))]})
    assert "the total number of counters must not exceed 32" in rejected(
        34, {"sharedCounters": [wire_set("a", 20), wire_set("b", 20)]})
    many = [wire_device(f"d-{i}", ("a", 32)) for i in range(33)]
    assert "the total number of consumed counters must not exceed 1024" in rejected(
        34, {"sharedCounters": [wire_set("a", 32)], "devices": many})
    assert "must reference a counterSet defined in the ResourceSlice sharedCounters" in rejected(
        34, {"devices": [wire_device("d", ("a", 1))]})
    assert "spec.devices: Too many: 65: must have at most 64 items" in rejected(
        35, {"devices": [wire_device(f"d-{i}", ("a", 1)) for i in range(65)]})


def test_double_drops_counters_where_the_gate_is_off() -> None:
    spec = {"sharedCounters": [wire_set("a", 2)], "devices": [wire_device("d", ("a", 2))]}
    for minor, gate, kept in ((34, False, False), (35, False, False), (35, True, True), (36, False, True)):
        fake = FakeApiServer(minor_version=minor, partitionable_devices_gate=gate)
        stored = fake.create_object("resourceslices", "", body(
            {"sharedCounters": spec["sharedCounters"]} if minor >= 35 else spec))
        assert ("sharedCounters" in stored["spec"]) is kept
    stored = FakeApiServer(minor_version=34).create_object("resourceslices", "", body(spec))
    assert "consumesCounters" not in stored["spec"]["devices"][0]
