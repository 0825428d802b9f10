"""The pure ResourceSlice planner (driver.kubeletplugin.sliceplanner): devices -> slices, and slices
on the server -> the writes that make them match. No HTTP here."""

from __future__ import annotations

from typing import Any

import pytest

from driver.kubeletplugin.slicelimits import limits_for
from driver.kubeletplugin.slicemodel import Device, DeviceTaint, PlannedSlice
from driver.kubeletplugin.sliceplanner import (
    InvalidDevices,
    canonical_spec,
    dropped_fields,
    missing_fields,
    plan_slices,
    slice_index,
    slice_name_prefix,
    slice_writes,
)
from tests.support.kubeletplugin import DRIVER, NODE, OWNER, gpu, gpus

# ----- naming -------------------------------------------------------------------------------


def test_slice_names_carry_the_index() -> None:
    assert slice_name_prefix(0, DRIVER, NODE) == "00000-gpu.tessera.dev-node-1-"
    assert slice_name_prefix(0x1A, DRIVER, NODE) == "0001a-gpu.tessera.dev-node-1-"
    assert slice_name_prefix(0x123456, DRIVER, NODE).startswith("123456-")
    assert slice_index("0001a-gpu.tessera.dev-node-1-x7k2p", DRIVER, NODE) == 26
    assert slice_index("123456-gpu.tessera.dev-node-1-x7k2p", DRIVER, NODE) == 0x123456


@pytest.mark.parametrize("name", [
    "node-1-gpu.tessera.dev-x7k2p",               # the 1.34/1.35 naming
    "00000-other.dev-node-1-x7k2p",               # another driver
    "00000-gpu.tessera.dev-node-10-x7k2p",        # another node
    "00000-gpu.tessera.dev-node-1-",              # no generated suffix
    "0000g-gpu.tessera.dev-node-1-x7k2p",
])
def test_names_not_ours_have_no_index(name: str) -> None:
    assert slice_index(name, DRIVER, NODE) is None


def test_index_of_a_name_the_apiserver_cut_to_58_characters() -> None:
    node = "ip-10-0-12-34.us-west-2.compute.internal"
    generated = slice_name_prefix(3, DRIVER, node)[:58] + "abcde"
    assert slice_index(generated, DRIVER, node) == 3


# ----- comparison ---------------------------------------------------------------------------


def test_quantities_compare_by_value_and_missing_devices_is_empty() -> None:
    def memory(value: str) -> dict[str, Any]:
        return {"devices": [{"name": "gpu-0", "capacity": {"memory": {"value": value}}}]}

    assert canonical_spec(memory("1024Mi")) == canonical_spec(memory("1Gi"))
    assert canonical_spec(memory("1024Mi")) != canonical_spec(memory("1G"))
    assert canonical_spec({"driver": "d"}) == canonical_spec({"driver": "d", "devices": []})


def test_missing_fields_names_each_dropped_field_once() -> None:
    sent = {"devices": [{"name": "a", "taints": [{"key": "k"}]}, {"name": "b", "taints": [{"key": "k"}]}],
            "pool": {"generation": 2}}
    stored = {"devices": [{"name": "a"}, {"name": "b"}], "pool": {"generation": 2}, "added": True}
    assert missing_fields(sent, stored) == ["spec.devices[*].taints"]
    assert missing_fields({"pool": {"generation": 2}}, {"pool": {"generation": 3}}) == ["spec.pool.generation"]


# ----- planning -----------------------------------------------------------------------------


def server_slice(index: int, devices: list[Device], generation: int = 1, count: int = 1,
                 owner: dict[str, Any] | None = OWNER, suffix: str = "abcde") -> dict[str, Any]:
    metadata: dict[str, Any] = {"name": slice_name_prefix(index, DRIVER, NODE) + suffix, "uid": f"uid-{index}-{suffix}",
                                "resourceVersion": "7"}
    if owner:
        metadata["ownerReferences"] = [owner]
    pool = {"name": NODE, "generation": generation, "resourceSliceCount": count}
    return {"metadata": metadata, "spec": {
        "driver": DRIVER, "nodeName": NODE, "pool": pool, "devices": [d.to_wire() for d in devices]}}


def writes_for(existing: list[dict[str, Any]], desired: list[list[Device]], adopted: dict[str, str] | None = None,
         owner: dict[str, Any] | None = OWNER) -> Any:
    slices = [PlannedSlice(devices=tuple(devices)) for devices in desired]
    return slice_writes(existing, slices, driver_name=DRIVER, node_name=NODE, owner=owner, adopted=adopted or {})


def test_plan_from_nothing_creates_every_slice_at_generation_1() -> None:
    result = writes_for([], [gpus(2), [gpu(5)]])
    assert result.generation == 1 and not result.deletes and not result.updates
    assert [c["metadata"]["generateName"] for c in result.creates] == [
        "00000-gpu.tessera.dev-node-1-", "00001-gpu.tessera.dev-node-1-"]
    first = result.creates[0]
    assert first["metadata"]["ownerReferences"] == [OWNER]
    assert first["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 2}
    assert first["spec"]["nodeName"] == NODE and first["spec"]["driver"] == DRIVER
    assert [d["name"] for d in first["spec"]["devices"]] == ["gpu-0", "gpu-1"]


def test_plan_for_matching_state_is_empty() -> None:
    assert writes_for([server_slice(0, gpus(2), generation=4)], [gpus(2)]).empty


def test_one_changed_slice_keeps_the_generation() -> None:
    existing = [server_slice(0, gpus(2), generation=3, count=2), server_slice(1, [gpu(2)], generation=3, count=2)]
    result = writes_for(existing, [gpus(2), [gpu(2, product="changed")]])
    assert result.generation == 3 and not result.creates and not result.deletes
    assert [u["metadata"]["name"] for u in result.updates] == [existing[1]["metadata"]["name"]]
    assert result.updates[0]["metadata"]["resourceVersion"] == "7"  # the update is conditional


def test_two_changed_slices_bump_the_generation_and_rewrite_all() -> None:
    existing = [server_slice(i, [gpu(i)], generation=3, count=3) for i in range(3)]
    result = writes_for(existing, [[gpu(0, "x")], [gpu(1, "x")], [gpu(2)]])
    assert result.generation == 4
    assert len(result.updates) == 3
    assert {u["spec"]["pool"]["generation"] for u in result.updates} == {4}


def test_a_missing_slice_bumps_the_generation() -> None:
    result = writes_for([server_slice(0, [gpu(0)], generation=2)], [[gpu(0)], [gpu(1)]])
    assert result.generation == 3
    assert len(result.updates) == 1 and len(result.creates) == 1
    assert result.updates[0]["spec"]["pool"]["resourceSliceCount"] == 2


def test_obsolete_slices_are_deleted() -> None:
    current = server_slice(0, [gpu(0)], generation=5, count=2)
    beyond = server_slice(1, [gpu(1)], generation=5)
    older = server_slice(0, [gpu(0)], generation=4, suffix="old00")
    old_naming = {**server_slice(0, [gpu(0)], generation=5), "metadata": {
        "name": f"{NODE}-{DRIVER}-x7k2p", "uid": "u", "resourceVersion": "1"}}
    other_pool = server_slice(0, [gpu(0)], generation=5, suffix="pool0")
    other_pool["spec"]["pool"]["name"] = "elsewhere"
    result = writes_for([current, beyond, older, old_naming, other_pool], [[gpu(0)]])
    deleted = {d["metadata"]["name"] for d in result.deletes}
    assert deleted == {beyond["metadata"]["name"], older["metadata"]["name"], old_naming["metadata"]["name"],
                       other_pool["metadata"]["name"]}
    assert not result.creates
    assert [u["metadata"]["name"] for u in result.updates] == [current["metadata"]["name"]]  # count 2 -> 1


def test_duplicate_index_keeps_one_slice() -> None:
    first, second = server_slice(0, [gpu(0)], suffix="aaaaa"), server_slice(0, [gpu(0)], suffix="bbbbb")
    result = writes_for([first, second], [[gpu(0)]])
    assert [d["metadata"]["name"] for d in result.deletes] == [second["metadata"]["name"]]
    assert not result.updates and not result.creates


def test_taint_time_added_by_the_server_is_kept() -> None:
    taint = DeviceTaint(key="example.com/xid", effect="NoSchedule")
    existing = server_slice(0, [gpu(0, taints=[taint])])
    existing["spec"]["devices"][0]["taints"][0]["timeAdded"] = "2026-01-01T00:00:00Z"
    assert writes_for([existing], [[gpu(0, taints=[taint])]]).empty


def test_adopted_server_version_is_not_rewritten() -> None:
    tainted = [gpu(0, taints=[DeviceTaint(key="k", effect="NoSchedule")])]
    stored = server_slice(0, [gpu(0)])
    sent_spec = {**stored["spec"], "devices": [d.to_wire() for d in tainted]}
    assert len(writes_for([stored], [tainted]).updates) == 1
    adopted = {canonical_spec(sent_spec): canonical_spec(stored["spec"])}
    assert writes_for([stored], [tainted], adopted=adopted).empty


def test_missing_owner_reference_is_added() -> None:
    existing = server_slice(0, [gpu(0)], owner=None)
    result = writes_for([existing], [[gpu(0)]])
    assert result.updates[0]["metadata"]["ownerReferences"] == [OWNER]
    assert writes_for([existing], [[gpu(0)]], owner=None).empty




def test_dropped_fields_name_the_feature_gate() -> None:
    sent = {"devices": [{"name": "a", "taints": [{"key": "k", "effect": "NoSchedule"}]}]}
    assert dropped_fields(sent, {"devices": [{"name": "a"}]}) == (["spec.devices[*].taints"], ["DRADeviceTaints"])
    defaulted = {"devices": [{"name": "a", "taints": [{"key": "k", "effect": "NoSchedule", "timeAdded": "t"}]}]}
    assert dropped_fields(sent, defaulted) == ([], [])


# ----- devices -> slices --------------------------------------------------------------------

L34, L35, L36 = limits_for(34), limits_for(35), limits_for(36)


def plain(count: int, start: int = 0) -> list[Device]:
    return [Device(name=f"gpu-{i}") for i in range(start, start + count)]


def tainted(name: str) -> Device:
    return Device(name=name, taints=[DeviceTaint(key="example.com/unhealthy", effect="NoSchedule")])


def sizes(slices: list[PlannedSlice]) -> list[int]:
    return [len(s.devices) for s in slices]


def test_no_devices_still_gives_one_empty_slice() -> None:
    assert plan_slices([], DRIVER, L36) == [PlannedSlice()]


def test_plain_devices_split_at_128() -> None:
    assert sizes(plan_slices(plain(128), DRIVER, L36)) == [128]
    assert sizes(plan_slices(plain(129), DRIVER, L36)) == [128, 1]
    assert sizes(plan_slices(plain(300), DRIVER, L34)) == [128, 128, 44]


def test_tainted_devices_split_at_64_from_1_35_only() -> None:
    devices = [tainted(f"gpu-{i}") for i in range(130)]
    assert sizes(plan_slices(devices, DRIVER, L35)) == [64, 64, 2]
    assert sizes(plan_slices(devices, DRIVER, L34)) == [128, 2]


def test_one_tainted_device_lowers_the_cap_of_its_slice_only() -> None:
    devices = [*plain(100), tainted("gpu-t"), *plain(100, start=200)]
    slices = plan_slices(devices, DRIVER, L36)
    # The tainted device cannot join the 100 plain ones (cap 64), so it starts a slice; that
    # slice then holds 63 more devices; the rest fill a plain slice.
    assert sizes(slices) == [100, 64, 37]
    assert slices[1].devices[0].name == "gpu-t"


def test_split_keeps_device_order() -> None:
    devices = [*plain(70), *[tainted(f"t-{i}") for i in range(70)], *plain(70, start=500)]
    slices = plan_slices(devices, DRIVER, L36)
    assert [d.name for s in slices for d in s.devices] == [d.name for d in devices]
    assert all(len(s.devices) <= 64 for s in slices if any(d.taints for d in s.devices))


def test_invalid_devices_are_refused_with_every_problem() -> None:
    with pytest.raises(InvalidDevices) as refused:
        plan_slices([gpu(0, product="x" * 80), Device(name="gpu-0")], DRIVER, L36)
    assert refused.value.problems == [
        'device "gpu-0": attribute "productName": string value is 80 bytes, the limit is 64',
        'device "gpu-0": name is used more than once in the pool (indexes 0 and 1)']
