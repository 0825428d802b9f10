"""The simulated allocator (SIMULATION): DeviceClass types, selectors it understands, count, taken devices, config."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from driver.simulation.allocator import AllocationError, allocate, claim_from_template, class_types

DRIVER = "gpu.tessera.dev"
Obj = dict[str, Any]


def _device(name: str, type_: str, **attributes: str) -> Obj:
    attrs: Obj = {"type": {"string": type_}}
    for key, value in attributes.items():
        attrs[key] = {"string": value}
    return {"name": name, "attributes": attrs}


def _pcie_root(value: str) -> dict[str, str]:
    return {"resource.kubernetes.io/pcieRoot": value}


def _slices() -> list[Obj]:
    return [
        {"spec": {"driver": DRIVER, "pool": {"name": "node-a"}, "devices": [
            _device("gpu-0", "gpu", productName="NVIDIA H100 80GB HBM3", **_pcie_root("pci0000:17")),
            _device("gpu-1-mig-1g10gb-6", "mig", profile="1g.10gb"),
            _device("gpu-1-mig-2g20gb-4", "mig", profile="2g.20gb"),
            _device("gpu-2", "gpu", productName="NVIDIA L4", **_pcie_root("pci0000:33")),
        ]}},
        {"spec": {"driver": DRIVER, "pool": {"name": "node-b"}, "devices": [
            _device("gpu-0-mps-0", "mps"),
            _device("gpu-0-ts-0", "timeslice"),
        ]}},
    ]


def _claim(*requests: Obj, config: list[Obj] | None = None) -> Obj:
    devices: Obj = {"requests": list(requests)}
    if config is not None:
        devices["config"] = config
    return {"metadata": {"name": "c", "namespace": "default", "uid": "u"}, "spec": {"devices": devices}}


def _request(name: str, device_class: str = DRIVER, count: int | None = None, *selectors: str) -> Obj:
    exactly: Obj = {"deviceClassName": device_class}
    if count is not None:
        exactly["count"] = count
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": s}} for s in selectors]
    return {"name": name, "exactly": exactly}


def _results(allocated: Obj) -> list[Obj]:
    results: list[Obj] = allocated["status"]["allocation"]["devices"]["results"]
    return results


def test_class_types_follow_the_driver_name() -> None:
    assert class_types("gpu.example.com") == {"gpu.example.com": "gpu", "mig.gpu.example.com": "mig",
                                              "mps.gpu.example.com": "mps",
                                              "timeslice.gpu.example.com": "timeslice",
                                              "consumable.gpu.example.com": "consumable"}


@pytest.mark.parametrize(("device_class", "device", "pool"), [
    (DRIVER, "gpu-0", "node-a"),
    (f"mig.{DRIVER}", "gpu-1-mig-1g10gb-6", "node-a"),
    (f"mps.{DRIVER}", "gpu-0-mps-0", "node-b"),
    (f"timeslice.{DRIVER}", "gpu-0-ts-0", "node-b"),
])
def test_device_class_selects_devices_of_its_type(device_class: str, device: str, pool: str) -> None:
    allocated = allocate(_claim(_request("r", device_class)), _slices(), DRIVER, set())
    assert _results(allocated) == [{"request": "r", "driver": DRIVER, "pool": pool, "device": device}]


def test_equality_selector_on_a_driver_attribute() -> None:
    sel = f"device.attributes['{DRIVER}'].productName == 'NVIDIA L4'"
    allocated = allocate(_claim(_request("r", DRIVER, None, sel)), _slices(), DRIVER, set())
    assert [r["device"] for r in _results(allocated)] == ["gpu-2"]


def test_selector_on_another_domain_uses_the_qualified_attribute() -> None:
    sel = "device.attributes['resource.kubernetes.io'].pcieRoot == \"pci0000:33\""
    allocated = allocate(_claim(_request("r", DRIVER, None, sel)), _slices(), DRIVER, set())
    assert [r["device"] for r in _results(allocated)] == ["gpu-2"]


def test_conjunction_must_hold_entirely() -> None:
    sel = (f"device.attributes['{DRIVER}'].productName == 'NVIDIA L4' && "
           "device.attributes['resource.kubernetes.io'].pcieRoot == 'pci0000:17'")
    with pytest.raises(AllocationError, match="no free gpu device"):
        allocate(_claim(_request("r", DRIVER, None, sel)), _slices(), DRIVER, set())


def test_several_selectors_must_all_match() -> None:
    sels = (f"device.attributes['{DRIVER}'].profile == '2g.20gb'", f"device.attributes['{DRIVER}'].type == 'mig'")
    allocated = allocate(_claim(_request("r", f"mig.{DRIVER}", None, *sels)), _slices(), DRIVER, set())
    assert [r["device"] for r in _results(allocated)] == ["gpu-1-mig-2g20gb-4"]


@pytest.mark.parametrize("expression", [
    "device.capacity['gpu.tessera.dev'].memory.isGreaterThan(quantity('10Gi'))",
    f"device.attributes['{DRIVER}'].productName != 'NVIDIA L4'",
    f"device.attributes['{DRIVER}'].productName == 'A' || device.attributes['{DRIVER}'].productName == 'B'",
])
def test_unsupported_selector_is_refused_loudly(expression: str) -> None:
    with pytest.raises(AllocationError, match="cannot evaluate the selector"):
        allocate(_claim(_request("r", DRIVER, None, expression)), _slices(), DRIVER, set())


def _with_memory(slices: list[Obj], memory: dict[str, str]) -> list[Obj]:
    for device in slices[0]["spec"]["devices"]:
        if device["name"] in memory:
            device["capacity"] = {"memory": {"value": memory[device["name"]]}}
    return slices


@pytest.mark.parametrize(("selector", "chosen"), [
    # The example gpu-cel-product-memory.yaml: prefix of an attribute and a capacity compared as a quantity.
    (f"device.attributes['{DRIVER}'].productName.startsWith('NVIDIA H100') && "
     f"device.capacity['{DRIVER}'].memory.compareTo(quantity('40Gi')) >= 0", "gpu-0"),
    (f"device.capacity['{DRIVER}'].memory.compareTo(quantity('40Gi')) < 0", "gpu-2"),
    (f"device.capacity['{DRIVER}'].memory.compareTo(quantity('23034Mi')) == 0", "gpu-2"),
    (f"device.attributes['{DRIVER}'].productName.startsWith('NVIDIA L')", "gpu-2"),
])
def test_prefix_and_capacity_selectors(selector: str, chosen: str) -> None:
    slices = _with_memory(_slices(), {"gpu-0": "81559Mi", "gpu-2": "23034Mi"})
    allocated = allocate(_claim(_request("r", DRIVER, None, selector)), slices, DRIVER, set())
    assert [r["device"] for r in _results(allocated)] == [chosen]


def test_capacity_selector_does_not_match_a_device_without_that_capacity() -> None:
    slices = _with_memory(_slices(), {"gpu-2": "10Gi"})
    with pytest.raises(AllocationError, match="no free gpu device matches"):
        allocate(_claim(_request("r", DRIVER, None, f"device.capacity['{DRIVER}'].memory.compareTo("
                                 "quantity('40Gi')) >= 0")), slices, DRIVER, set())


def test_count_allocates_that_many_distinct_devices() -> None:
    allocated = allocate(_claim(_request("r", f"mig.{DRIVER}", 2)), _slices(), DRIVER, set())
    assert sorted(r["device"] for r in _results(allocated)) == ["gpu-1-mig-1g10gb-6", "gpu-1-mig-2g20gb-4"]


def test_count_beyond_free_devices_fails() -> None:
    with pytest.raises(AllocationError, match="request 'r': no free mig device"):
        allocate(_claim(_request("r", f"mig.{DRIVER}", 3)), _slices(), DRIVER, set())


def test_taken_devices_are_skipped_and_new_ones_recorded() -> None:
    taken = {"gpu-0"}
    allocated = allocate(_claim(_request("r", DRIVER)), _slices(), DRIVER, taken)
    assert [r["device"] for r in _results(allocated)] == ["gpu-2"]
    assert taken == {"gpu-0", "gpu-2"}
    with pytest.raises(AllocationError):
        allocate(_claim(_request("again", DRIVER)), _slices(), DRIVER, taken)


def test_requests_in_one_claim_do_not_share_a_device() -> None:
    allocated = allocate(_claim(_request("a", DRIVER), _request("b", DRIVER)), _slices(), DRIVER, set())
    assert [(r["request"], r["device"]) for r in _results(allocated)] == [("a", "gpu-0"), ("b", "gpu-2")]


def test_unknown_device_class_is_refused() -> None:
    with pytest.raises(AllocationError, match=r"unknown DeviceClass 'other\.example\.com'"):
        allocate(_claim(_request("r", "other.example.com")), _slices(), DRIVER, set())


def test_first_available_requests_are_refused() -> None:
    request = {"name": "r", "firstAvailable": [{"name": "a", "deviceClassName": DRIVER}]}
    with pytest.raises(AllocationError, match="only handles 'exactly'"):
        allocate(_claim(request), _slices(), DRIVER, set())


def test_opaque_config_is_copied_with_source_from_claim() -> None:
    opaque = {"driver": DRIVER, "parameters": {"apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "GpuConfig"}}
    config: list[Obj] = [{"requests": ["r"], "opaque": opaque}, {"requests": ["r"]}]
    allocated = allocate(_claim(_request("r"), config=config), _slices(), DRIVER, set())
    assert allocated["status"]["allocation"]["devices"]["config"] == [
        {"source": "FromClaim", "requests": ["r"], "opaque": opaque}]


def test_config_without_requests_applies_to_all() -> None:
    opaque = {"driver": DRIVER, "parameters": {}}
    allocated = allocate(_claim(_request("r"), config=[{"opaque": opaque}]), _slices(), DRIVER, set())
    assert allocated["status"]["allocation"]["devices"]["config"] == [
        {"source": "FromClaim", "requests": [], "opaque": opaque}]


def test_input_claim_is_not_modified() -> None:
    claim = _claim(_request("r"))
    before = copy.deepcopy(claim)
    allocated = allocate(claim, _slices(), DRIVER, set())
    assert claim == before
    assert allocated["metadata"] == claim["metadata"] and allocated["spec"] == claim["spec"]


def test_claim_from_template_copies_the_spec_and_gets_a_fresh_uid() -> None:
    template = {"spec": {"spec": {"devices": {"requests": [_request("gpu")]}}}}
    first = claim_from_template(template, "pod-gpu", "team-a")
    second = claim_from_template(template, "pod-gpu", "team-a")
    assert first["kind"] == "ResourceClaim" and first["apiVersion"] == "resource.k8s.io/v1"
    assert first["metadata"]["name"] == "pod-gpu" and first["metadata"]["namespace"] == "team-a"
    assert first["spec"] == template["spec"]["spec"]
    assert first["metadata"]["uid"] != second["metadata"]["uid"]


def test_admin_access_sees_every_device_others_hold_and_takes_none() -> None:
    request = _request("watch", DRIVER)
    tolerations = [{"key": f"{DRIVER}/unhealthy", "operator": "Exists"}]
    request["exactly"].update(adminAccess=True, allocationMode="All", tolerations=tolerations)
    taken = {"gpu-0"}
    results = _results(allocate(_claim(request), _slices(), DRIVER, taken))
    assert [(r["device"], r["adminAccess"]) for r in results] == [("gpu-0", True), ("gpu-2", True)]
    assert all(r["tolerations"] == tolerations for r in results) and taken == {"gpu-0"}
    # Without admin access, All takes what is free and marks it taken.
    every = _request("all", DRIVER)
    every["exactly"]["allocationMode"] = "All"
    assert [r["device"] for r in _results(allocate(_claim(every), _slices(), DRIVER, taken))] == ["gpu-2"]
    assert taken == {"gpu-0", "gpu-2"} and "adminAccess" not in _results(allocate(_claim(every), _slices(), DRIVER,
                                                                                   set()))[0]
