"""Value normalisation and the inventory → published devices + device index walk."""

from __future__ import annotations

import re
from typing import Any

import pytest

from driver.gpu.discovery.inventory import GpuInfo, MigInstance, NodeInventory
from driver.gpu.published.devices import (
    MAX_ATTRIBUTES_AND_CAPACITIES,
    make_view,
    quantity_from_bytes,
    semver_from_nvidia,
)
from driver.gpu.published.sharelayout import GpuForm, SharingLayout
from driver.kubeletplugin.slicelimits import limits_for
from driver.kubeletplugin.slicemodel import Device
from driver.kubeletplugin.slicevalidation import validate_devices
from driver.units import GIB, MIB

PARENT_KEYS = {
    "productName",
    "brand",
    "architecture",
    "cudaComputeCapability",
    "driverVersion",
    "cudaDriverVersion",
    "resource.kubernetes.io/pciBusID",
    "resource.kubernetes.io/pcieRoot",
}


def h100(minor: int, **changes: Any) -> GpuInfo:
    fields: dict[str, Any] = {
        "minor": minor,
        "index": minor,
        "uuid": f"GPU-0000000{minor}-1111-2222-3333-444444444444",
        "product_name": "NVIDIA H100 80GB HBM3",
        "brand": "Nvidia",
        "architecture": "Hopper",
        "cuda_compute_capability": "9.0",
        "memory_bytes": 81559 * MIB,
        "multiprocessors": 132,
        "pci_bus_id": f"0000:{0x18 + minor:02x}:00.0",
        "pcie_root": "pci0000:17",
        "addressing_mode": "HMM",
        "mig_capable": True,
    }
    fields.update(changes)
    return GpuInfo(**fields)


def mig(start: int, size: int, profile: str = "1g.10gb", ci_id: int = 0, **changes: Any) -> MigInstance:
    fields: dict[str, Any] = {
        "uuid": f"MIG-{start}-{ci_id}",
        "profile": profile,
        "gi_profile_id": 19,
        "placement_start": start,
        "placement_size": size,
        "gi_id": start + 1,
        "ci_id": ci_id,
        "memory_bytes": 9984 * MIB,
        "multiprocessors": 16,
        "copy_engines": 1,
        "decoders": 1,
        "encoders": 0,
        "jpeg_engines": 1,
        "ofa_engines": 0,
    }
    fields.update(changes)
    return MigInstance(**fields)


def inventory_of(*gpus: GpuInfo) -> NodeInventory:
    return NodeInventory(driver_version="580.95.05", cuda_driver_version="13.0", gpus=gpus)


def published(inventory: NodeInventory, layout: SharingLayout | None = None,
              mps_multi_user: bool = False) -> list[Device]:
    return list(make_view(inventory, layout or {}, mps_multi_user).devices)


# --- value normalisation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "semver"),
    [
        ("580.95.05", "580.95.5"),
        ("535.104.12", "535.104.12"),
        ("9.0", "9.0.0"),
        ("13.0", "13.0.0"),
        ("8.9", "8.9.0"),
        ("550", "550.0.0"),
        ("00.01.002", "0.1.2"),
        (" 13.0\n", "13.0.0"),
        ("", None),
        ("v13.0", None),
        ("580.95.05.1", None),
        ("580..5", None),
        ("N/A", None),
        ("13.0-beta", None),
    ],
)
def test_semver_from_nvidia(raw: str, semver: str | None) -> None:
    assert semver_from_nvidia(raw) == semver


@pytest.mark.parametrize(
    ("n", "quantity"),
    [
        (0, "0"),
        (1, "1"),
        (1000, "1000"),
        (1024, "1Ki"),
        (1536, "1536"),
        (81559 * MIB, "81559Mi"),
        (80 * GIB, "80Gi"),
        (2 << 40, "2Ti"),
        (3 * 1024 * 1024 + 512 * 1024, "3584Ki"),
    ],
)
def test_quantity_from_bytes(n: int, quantity: str) -> None:
    assert quantity_from_bytes(n) == quantity


def test_quantity_from_bytes_rejects_negative() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        quantity_from_bytes(-1)


# --- whole GPUs --------------------------------------------------------------------------------


def test_whole_gpu_device() -> None:
    [device] = published(inventory_of(h100(0)))
    assert device.to_wire() == {
        "name": "gpu-0",
        "attributes": {
            "addressingMode": {"string": "HMM"},
            "architecture": {"string": "Hopper"},
            "brand": {"string": "Nvidia"},
            "cudaComputeCapability": {"version": "9.0.0"},
            "cudaDriverVersion": {"version": "13.0.0"},
            "driverVersion": {"version": "580.95.5"},
            "productName": {"string": "NVIDIA H100 80GB HBM3"},
            "resource.kubernetes.io/pciBusID": {"string": "0000:18:00.0"},
            "resource.kubernetes.io/pcieRoot": {"string": "pci0000:17"},
            "type": {"string": "gpu"},
            "uuid": {"string": "GPU-00000000-1111-2222-3333-444444444444"},
        },
        "capacity": {"memory": {"value": "81559Mi"}, "multiprocessors": {"value": "132"}},
    }


def test_unknown_sources_are_left_out() -> None:
    bare = GpuInfo(minor=4, index=0, uuid="GPU-bare", product_name="NVIDIA L4")
    [device] = published(NodeInventory(gpus=(bare,)))
    assert device.to_wire() == {
        "name": "gpu-4",
        "attributes": {
            "productName": {"string": "NVIDIA L4"},
            "type": {"string": "gpu"},
            "uuid": {"string": "GPU-bare"},
        },
    }


def test_unparsable_versions_are_left_out() -> None:
    inventory = NodeInventory(driver_version="unknown", cuda_driver_version="13.0", gpus=(h100(0),))
    [device] = published(inventory)
    assert "driverVersion" not in device.attributes
    assert device.attributes["cudaDriverVersion"].version == "13.0.0"


def test_long_strings_are_cut_to_64_bytes() -> None:
    [device] = published(inventory_of(h100(0, product_name="NVIDIA " + "é" * 40)))
    product = device.attributes["productName"].string
    assert product is not None
    assert len(product.encode()) <= 64
    assert product.startswith("NVIDIA é")


def test_mig_capable_gpu_with_mig_disabled_is_published_whole() -> None:
    [device] = published(inventory_of(h100(0, mig_enabled=False, mig_instances=(mig(0, 1),))))
    assert device.name == "gpu-0"


# --- MIG ---------------------------------------------------------------------------------------


def test_mig_enabled_gpu_publishes_only_its_instances_in_placement_order() -> None:
    gpu = h100(
        1,
        mig_enabled=True,
        mig_instances=(mig(4, 4, "3g.40gb", gi_profile_id=9), mig(0, 1), mig(2, 2, "1g.20gb", gi_profile_id=15)),
    )
    devices = published(inventory_of(gpu))
    assert [d.name for d in devices] == ["gpu-1-mig-1g10gb-0", "gpu-1-mig-1g20gb-2", "gpu-1-mig-3g40gb-4"]


def test_mig_device_attributes_and_capacity() -> None:
    gpu = h100(1, mig_enabled=True, mig_instances=(mig(2, 2, "1g.20gb", uuid="MIG-abc", memory_bytes=20096 * MIB),))
    [device] = published(inventory_of(gpu))
    wire = device.to_wire()
    assert set(wire["attributes"]) == {"type", "uuid", "parentUUID", "profile"} | PARENT_KEYS
    assert wire["attributes"]["type"] == {"string": "mig"}
    assert wire["attributes"]["uuid"] == {"string": "MIG-abc"}
    assert wire["attributes"]["parentUUID"] == {"string": gpu.uuid}
    assert wire["attributes"]["profile"] == {"string": "1g.20gb"}
    assert wire["attributes"]["resource.kubernetes.io/pciBusID"] == {"string": "0000:19:00.0"}
    assert wire["capacity"] == {
        "memory": {"value": "20096Mi"},
        "multiprocessors": {"value": "16"},
        "copyEngines": {"value": "1"},
        "decoders": {"value": "1"},
        "encoders": {"value": "0"},
        "jpegEngines": {"value": "1"},
        "ofaEngines": {"value": "0"},
        "memorySlice2": {"value": "1"},
        "memorySlice3": {"value": "1"},
    }


def test_mig_capacities_without_source_are_left_out() -> None:
    sparse = mig(0, 1, memory_bytes=None, decoders=None, encoders=None, jpeg_engines=None, ofa_engines=None)
    [device] = published(inventory_of(h100(0, mig_enabled=True, mig_instances=(sparse,))))
    assert set(device.capacity) == {"multiprocessors", "copyEngines", "memorySlice0"}


def test_mig_enabled_gpu_without_instances_publishes_nothing() -> None:
    devices = published(inventory_of(h100(0), h100(1, mig_enabled=True), h100(2)))
    assert [d.name for d in devices] == ["gpu-0", "gpu-2"]


def test_compute_instances_sharing_a_gpu_instance_publish_one_device() -> None:
    gpu = h100(0, mig_enabled=True, mig_instances=(mig(0, 4, "1c.3g.40gb", ci_id=2), mig(0, 4, "1c.3g.40gb", ci_id=1)))
    [device] = published(inventory_of(gpu))
    assert device.name == "gpu-0-mig-1c3g40gb-0"
    assert device.attributes["uuid"].string == "MIG-0-1"


# --- shares ------------------------------------------------------------------------------------


def test_mps_share_devices() -> None:
    shares = GpuForm(strategy="MPS", count=3, active_thread_percentage=33, memory_bytes_per_share=26 * GIB)
    gpu = h100(0)
    devices = published(inventory_of(gpu), {gpu.uuid: shares})
    assert [d.name for d in devices] == ["gpu-0-mps-0", "gpu-0-mps-1", "gpu-0-mps-2"]
    wire = devices[1].to_wire()
    assert set(wire["attributes"]) == PARENT_KEYS | {
        "type",
        "parentUUID",
        "sharingStrategy",
        "shareIndex",
        "shareCount",
        "activeThreadPercentage",
        "memoryLimitEnforcement",
        "computeLimitEnforcement",
        "mpsMultiUser",
    }
    assert wire["attributes"]["mpsMultiUser"] == {"bool": False}
    assert wire["attributes"]["type"] == {"string": "mps"}
    assert wire["attributes"]["parentUUID"] == {"string": gpu.uuid}
    assert wire["attributes"]["sharingStrategy"] == {"string": "MPS"}
    assert wire["attributes"]["shareIndex"] == {"int": 1}
    assert wire["attributes"]["shareCount"] == {"int": 3}
    assert wire["attributes"]["activeThreadPercentage"] == {"int": 33}
    assert wire["attributes"]["memoryLimitEnforcement"] == {"string": "mps-per-process"}
    assert wire["attributes"]["computeLimitEnforcement"] == {"string": "mps-per-process"}
    assert wire["capacity"] == {"memory": {"value": "26Gi"}}


@pytest.mark.parametrize(("node_multi_user", "capability", "multi_user"),
                         [(True, "9.0", True), (True, "7.0", True), (True, "6.0", False), (True, None, False),
                          (False, "9.0", False)])
def test_mps_shares_say_whether_several_uids_can_run_at_once(
    node_multi_user: bool, capability: str | None, multi_user: bool
) -> None:
    gpu = h100(0, cuda_compute_capability=capability)
    shares = GpuForm(strategy="MPS", count=2, memory_bytes_per_share=GIB)
    devices = published(inventory_of(gpu), {gpu.uuid: shares}, mps_multi_user=node_multi_user)
    assert [d.to_wire()["attributes"]["mpsMultiUser"] for d in devices] == [{"bool": multi_user}] * 2
    timesliced = published(inventory_of(gpu), {gpu.uuid: GpuForm(strategy="TimeSlicing", count=2,
                                                               memory_bytes_per_share=GIB)}, mps_multi_user=True)
    assert all("mpsMultiUser" not in d.attributes for d in timesliced)


def test_timeslice_share_devices() -> None:
    gpu = h100(3)
    shares = GpuForm(strategy="TimeSlicing", count=2, memory_bytes_per_share=40 * GIB, interval="Long")
    devices = published(inventory_of(gpu), {gpu.uuid: shares})
    assert [d.name for d in devices] == ["gpu-3-ts-0", "gpu-3-ts-1"]
    attributes = devices[0].to_wire()["attributes"]
    assert attributes["type"] == {"string": "timeslice"}
    assert attributes["sharingStrategy"] == {"string": "TimeSlicing"}
    assert attributes["timeSliceInterval"] == {"string": "Long"}
    assert attributes["memoryLimitEnforcement"] == {"string": "none"}
    assert attributes["computeLimitEnforcement"] == {"string": "none"}
    assert "activeThreadPercentage" not in attributes


def test_timeslice_interval_defaults_to_default() -> None:
    gpu = h100(0)
    shares = GpuForm(strategy="TimeSlicing", count=2, memory_bytes_per_share=GIB)
    [first, _] = published(inventory_of(gpu), {gpu.uuid: shares})
    assert first.attributes["timeSliceInterval"].string == "Default"


def test_shared_gpu_is_not_also_published_whole_and_others_are() -> None:
    shared, whole = h100(0), h100(1)
    shares = GpuForm(strategy="MPS", count=2, memory_bytes_per_share=GIB)
    names = [d.name for d in published(inventory_of(whole, shared), {shared.uuid: shares})]
    assert names == ["gpu-0-mps-0", "gpu-0-mps-1", "gpu-1"]


def test_sharing_a_mig_enabled_gpu_is_refused() -> None:
    gpu = h100(2, mig_enabled=True, mig_instances=(mig(0, 1),))
    shares = GpuForm(strategy="MPS", count=2, memory_bytes_per_share=GIB)
    with pytest.raises(ValueError, match=r"minor 2\) has MIG enabled"):
        published(inventory_of(gpu), {gpu.uuid: shares})


# --- node-wide properties ----------------------------------------------------------------------


def _largest_node() -> tuple[NodeInventory, dict[str, GpuForm]]:
    full = mig(0, 8, "7g.80gb", gi_profile_id=0, memory_bytes=81152 * MIB, multiprocessors=132, copy_engines=8)
    gpus = (
        h100(2, mig_enabled=True, mig_instances=(full,)),
        h100(0),
        h100(1),
        h100(3, mig_enabled=True, mig_instances=(mig(6, 1, "1g.10gb+me"), mig(0, 4, "3g.40gb"), mig(4, 2, "2g.20gb"))),
    )
    layout = {
        gpus[2].uuid: GpuForm(strategy="MPS", count=48, active_thread_percentage=2, memory_bytes_per_share=GIB),
    }
    return inventory_of(*gpus), layout


def test_order_is_by_minor_then_placement_or_share_index() -> None:
    inventory, layout = _largest_node()
    names = [d.name for d in published(inventory, layout)]
    assert names[0] == "gpu-0"
    assert names[1:49] == [f"gpu-1-mps-{k}" for k in range(48)]
    assert names[49:] == ["gpu-2-mig-7g80gb-0", "gpu-3-mig-3g40gb-0", "gpu-3-mig-2g20gb-4", "gpu-3-mig-1g10gbme-6"]


def test_largest_devices_stay_within_the_api_limits() -> None:
    inventory, layout = _largest_node()
    devices = published(inventory, layout)
    full_mig = next(d for d in devices if d.name == "gpu-2-mig-7g80gb-0")
    # The largest device: a MIG instance over all 8 memory slices with every source known.
    assert len(full_mig.attributes) + len(full_mig.capacity) == 27
    for device in devices:
        assert len(device.attributes) + len(device.capacity) <= MAX_ATTRIBUTES_AND_CAPACITIES
        assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", device.name) and len(device.name) <= 63
    assert validate_devices(devices, "gpu.tessera.dev", limits_for(34)) == []


def test_too_many_memory_slices_is_an_error_not_an_invalid_slice() -> None:
    huge = mig(0, 16, "7g.160gb")
    with pytest.raises(ValueError, match="at most 32"):
        published(inventory_of(h100(0, mig_enabled=True, mig_instances=(huge,))))


# --- the device index, from the same walk ------------------------------------------------------


def test_every_published_device_is_indexed_under_its_name_with_its_type() -> None:
    inventory, layout = _largest_node()
    timesliced = h100(4)
    inventory = inventory_of(*inventory.gpus, timesliced)
    layout = {**layout, timesliced.uuid: GpuForm(strategy="TimeSlicing", count=2, memory_bytes_per_share=GIB)}
    view = make_view(inventory, layout)
    assert [d.name for d in view.devices] == list(view.targets)
    for device in view.devices:
        target = view.targets[device.name]
        assert device.attributes["type"].string == target.kind
        if target.kind in ("gpu", "mig"):
            assert device.attributes["uuid"].string == target.cuda_uuid
        if target.kind != "gpu":
            assert device.attributes["parentUUID"].string == target.gpu.uuid
        if target.share_index is not None:
            assert device.attributes["shareIndex"].int_value == target.share_index
    assert {t.kind for t in view.targets.values()} == {"gpu", "mig", "mps", "timeslice"}


def test_the_indexed_mig_instance_is_the_published_one() -> None:
    gpu = h100(0, mig_enabled=True, mig_instances=(mig(0, 4, "1c.3g.40gb", ci_id=2), mig(0, 4, "1c.3g.40gb", ci_id=1)))
    view = make_view(inventory_of(gpu), {})
    [device] = view.devices
    target = view.targets[device.name]
    assert target.mig is not None and target.mig.ci_id == 1
    assert device.attributes["uuid"].string == target.mig.uuid == "MIG-0-1"


def test_view_keeps_its_own_layout_and_ignores_entries_for_absent_gpus() -> None:
    gpu = h100(0)
    layout = {gpu.uuid: GpuForm(strategy="MPS", count=2, memory_bytes_per_share=GIB),
              "GPU-not-on-this-node": GpuForm(strategy="MPS", count=2, memory_bytes_per_share=GIB)}
    view = make_view(inventory_of(gpu), layout)
    layout.clear()
    assert set(view.layout) == {gpu.uuid, "GPU-not-on-this-node"}
    assert list(view.targets) == ["gpu-0-mps-0", "gpu-0-mps-1"]
