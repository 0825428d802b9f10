"""Client-side ResourceSlice validation (driver.kubeletplugin.slicevalidation) and the limits it checks
(driver.kubeletplugin.slicelimits). Splitting into slices is tested with the planner."""

from __future__ import annotations

from decimal import Decimal

import pytest

from driver.kubeletplugin.slicelimits import limits_for
from driver.kubeletplugin.slicemodel import (
    Device,
    DeviceCapacity,
    DeviceTaint,
    int_attr,
    string_attr,
    version_attr,
)
from driver.kubeletplugin.slicevalidation import (
    quantity_value,
    validate_devices,
    validate_driver_and_pool,
)

DRIVER = "gpu.tessera.dev"
L34, L35, L36 = limits_for(34), limits_for(35), limits_for(36)


def problems_of(device: Device, minor: int = 36) -> list[str]:
    return validate_devices([device], DRIVER, limits_for(minor))


def tainted(name: str, effect: str = "NoSchedule") -> Device:
    return Device(name=name, taints=[DeviceTaint(key="example.com/unhealthy", effect=effect)])


# ----- limits --------------------------------------------------------------------------------


def test_limits_per_release() -> None:
    assert (L34.max_devices_per_slice, L34.max_taints_per_device, L34.taints_restrict_slice) == (128, 4, False)
    assert "None" not in L34.taint_effects
    assert (L35.max_taints_per_device, L35.taints_restrict_slice) == (16, True)
    assert not L35.list_attributes_restrict_slice
    assert "None" in L35.taint_effects
    assert (L36.list_attributes_restrict_slice, L36.max_devices_per_slice_restricted) == (True, 64)
    assert limits_for(37).max_attributes_and_capacities == 32


def test_newer_release_gets_newest_known_limits_and_older_is_refused() -> None:
    newer = limits_for(40)
    assert newer.minor_version == 40
    assert newer.max_taints_per_device == 16 and newer.list_attributes_restrict_slice
    with pytest.raises(ValueError, match=r"Kubernetes 1\.33 is not supported"):
        limits_for(33)


# ----- driver and pool ----------------------------------------------------------------------


def test_valid_driver_and_pool() -> None:
    assert validate_driver_and_pool(DRIVER, "node-1") == []
    assert validate_driver_and_pool("GPU.Example.com", "rack-1/node-1") == []  # upper case is tolerated


@pytest.mark.parametrize(("driver", "pool", "message"), [
    ("", "node-1", "driver name is required"),
    ("gpu_tessera.dev", "node-1", 'driver name "gpu_tessera.dev" must be a DNS subdomain (e.g. "gpu.example.com")'),
    ("a" * 64, "node-1", f'driver name "{"a" * 64}" is 64 characters, the limit is 63'),
    (DRIVER, "", "pool name is required"),
    (DRIVER, "Node_1", 'pool name "Node_1": part "Node_1" must be a DNS subdomain '
                       "(lower-case alphanumerics, '-' and '.')"),
    (DRIVER, "rack//node", 'pool name "rack//node": part "" must be a DNS subdomain '
                           "(lower-case alphanumerics, '-' and '.')"),
    (DRIVER, "n" * 254, f'pool name "{"n" * 254}" is 254 characters, the limit is 253'),
])
def test_invalid_driver_or_pool(driver: str, pool: str, message: str) -> None:
    assert validate_driver_and_pool(driver, pool) == [message]


# ----- device names -------------------------------------------------------------------------


def test_valid_device_has_no_problems() -> None:
    device = Device(
        name="gpu-0",
        attributes={"type": string_attr("gpu"), "index": int_attr(0), "driverVersion": version_attr("580.95.5"),
                    "resource.kubernetes.io/pciBusID": string_attr("0000:3b:00.0")},
        capacity={"memory": DeviceCapacity(value="81559Mi")},
        taints=[DeviceTaint(key="gpu.tessera.dev/xid", value="79", effect="NoExecute")],
    )
    assert problems_of(device) == []


def test_device_name_must_be_dns_label() -> None:
    assert problems_of(Device(name="GPU_0")) == [
        'device "GPU_0": name must be a DNS label (at most 63 lower-case alphanumerics or \'-\', '
        "starting and ending with an alphanumeric)"]
    assert problems_of(Device(name="g" * 64))
    assert problems_of(Device(name="g" * 63)) == []


def test_device_name_with_trailing_newline_is_rejected() -> None:
    name = "gpu-0\n"
    assert problems_of(Device(name=name)) == [
        f'device "{name}": name must be a DNS label (at most 63 lower-case alphanumerics or \'-\', '
        "starting and ending with an alphanumeric)"]


@pytest.mark.parametrize(("driver", "pool"), [("gpu.tessera.dev\n", "node-a"), ("gpu.tessera.dev", "node-a\n")])
def test_driver_and_pool_names_with_trailing_newline_are_rejected(driver: str, pool: str) -> None:
    assert len(validate_driver_and_pool(driver, pool)) == 1


def test_device_name_is_required() -> None:
    assert validate_devices([Device(name="gpu-0"), Device(name="")], DRIVER, L36) == [
        "device at index 1: name is required"]


def test_device_names_unique_across_the_whole_pool() -> None:
    devices = [Device(name="gpu-0"), Device(name="gpu-1"), Device(name="gpu-0")]
    assert validate_devices(devices, DRIVER, L36) == [
        'device "gpu-0": name is used more than once in the pool (indexes 0 and 2)']


# ----- attribute and capacity names ---------------------------------------------------------


@pytest.mark.parametrize(("key", "message"), [
    ("a/b/c", 'attribute "a/b/c": name must be <id> or <domain>/<id>; it contains more than one \'/\''),
    ("/model", 'attribute "/model": domain before \'/\' is empty'),
    ("example.com/", 'attribute "example.com/": name is empty'),
    ("bad_domain!/model", 'attribute "bad_domain!/model": domain "bad_domain!" must be a DNS subdomain'),
    ("d" * 64 + "/model", f'attribute "{"d" * 64}/model": domain is 64 characters, the limit is 63'),
    ("1model", 'attribute "1model": identifier "1model" must be a C identifier '
               "(letters, digits and '_', not starting with a digit)"),
    ("model-name", 'attribute "model-name": identifier "model-name" must be a C identifier '
                   "(letters, digits and '_', not starting with a digit)"),
    ("m" * 33, f'attribute "{"m" * 33}": identifier "{"m" * 33}" is 33 characters, the limit is 32'),
    ("model\n", 'attribute "model\n": identifier "model\n" must be a C identifier '
                 "(letters, digits and '_', not starting with a digit)"),
])
def test_attribute_name_rules(key: str, message: str) -> None:
    assert problems_of(Device(name="gpu-0", attributes={key: int_attr(1)})) == [f'device "gpu-0": {message}']


def test_capacity_names_follow_the_same_rules() -> None:
    device = Device(name="gpu-0", capacity={"mem-ory": DeviceCapacity(value="1Gi")})
    assert problems_of(device) == [
        'device "gpu-0": capacity "mem-ory": identifier "mem-ory" must be a C identifier '
        "(letters, digits and '_', not starting with a digit)"]


def test_longest_valid_identifier_and_domain() -> None:
    key = "d" * 63 + "/" + "m" * 32
    assert problems_of(Device(name="gpu-0", attributes={key: int_attr(1)})) == []


def test_unqualified_and_driver_qualified_name_are_duplicates() -> None:
    device = Device(name="gpu-0", attributes={"model": string_attr("a"), f"{DRIVER}/model": string_attr("b")})
    assert problems_of(device) == [
        f'device "gpu-0": attribute "{DRIVER}/model" duplicates "model" '
        "(an unqualified name is in the driver's domain)"]
    other_domain = Device(name="gpu-0", attributes={"model": string_attr("a"), "other.dev/model": string_attr("b")})
    assert problems_of(other_domain) == []


# ----- attribute values ---------------------------------------------------------------------


def test_string_value_limit_is_64_bytes_not_characters() -> None:
    long_ascii = Device(name="gpu-0", attributes={"productName": string_attr("x" * 80)})
    assert problems_of(long_ascii) == [
        'device "gpu-0": attribute "productName": string value is 80 bytes, the limit is 64']
    multibyte = Device(name="gpu-0", attributes={"productName": string_attr("é" * 33)})
    assert problems_of(multibyte) == [
        'device "gpu-0": attribute "productName": string value is 66 bytes, the limit is 64']
    assert problems_of(Device(name="gpu-0", attributes={"productName": string_attr("x" * 64)})) == []


@pytest.mark.parametrize("version", ["580.95.5", "9.0.0", "1.0.0-rc.1+build.5", "0.0.0", "1.2.3-alpha.0"])
def test_strict_semver_accepted(version: str) -> None:
    assert problems_of(Device(name="gpu-0", attributes={"v": version_attr(version)})) == []


@pytest.mark.parametrize("version", ["v1.2.3", "580.95.05", "9.0", "01.2.3", "1.2.3-01", "1.2.3.4", "latest",
                                     "580.95.5\n", "580.95.5\u0663", "1.2.3-rc.1\u0663"])  # U+0663: a digit 3
def test_non_semver_rejected(version: str) -> None:
    assert problems_of(Device(name="gpu-0", attributes={"v": version_attr(version)})) == [
        f'device "gpu-0": attribute "v": version value "{version}" is not strict semantic versioning 2.0.0 '
        '(MAJOR.MINOR.PATCH, no leading zeros, no "v"; e.g. "580.95.5")']


def test_version_longer_than_64_rejected() -> None:
    version = "1.2.3+" + "b" * 59
    assert problems_of(Device(name="gpu-0", attributes={"v": version_attr(version)})) == [
        'device "gpu-0": attribute "v": version value is 65 characters, the limit is 64']


def test_attributes_plus_capacities_limit() -> None:
    attributes = {f"a{i}": int_attr(i) for i in range(30)}
    capacity = {f"c{i}": DeviceCapacity(value="1") for i in range(3)}
    assert problems_of(Device(name="gpu-0", attributes=attributes, capacity=capacity)) == [
        'device "gpu-0": has 33 attributes and capacities, the limit is 32']
    del attributes["a0"]
    assert problems_of(Device(name="gpu-0", attributes=attributes, capacity=capacity)) == []


@pytest.mark.parametrize("value", ["80Gi", "132", "1.5", "500m", "1e3", ".5", "5.", "+1Ki", "1E-2"])
def test_valid_quantities(value: str) -> None:
    assert problems_of(Device(name="gpu-0", capacity={"memory": DeviceCapacity(value=value)})) == []


@pytest.mark.parametrize("value", ["80 GB", "80GB", "Gi", "", "1.2.3", "0x10", "1iB", "80Gi\n", "\u0663Gi", "1e\u0663",
                                   "1E9999999", "1e" + "9" * 5000])
def test_invalid_quantities(value: str) -> None:
    assert problems_of(Device(name="gpu-0", capacity={"memory": DeviceCapacity(value=value)})) == [
        f'device "gpu-0": capacity "memory": value "{value}" is not a Kubernetes quantity '
        '(expected e.g. "80Gi", "132", "1.5", "500m")']


def test_quantity_values_compare_by_amount() -> None:
    assert quantity_value("1Gi") == quantity_value("1024Mi") == Decimal(2**30)
    assert quantity_value("500m") == Decimal("0.5")
    assert quantity_value("1e3") == quantity_value("1k") == Decimal(1000)
    assert quantity_value("80 GB") is None


def test_quantity_too_large_for_decimal_is_invalid_not_an_exception() -> None:
    assert quantity_value("1E9999999") is None  # decimal.Overflow
    assert quantity_value("1e" + "9" * 5000) is None  # an exponent longer than int() converts


# ----- taints -------------------------------------------------------------------------------


def test_taint_count_limit_depends_on_release() -> None:
    taints = [DeviceTaint(key=f"example.com/t{i}", effect="NoSchedule") for i in range(5)]
    device = Device(name="gpu-0", taints=taints)
    assert problems_of(device, minor=34) == ['device "gpu-0": has 5 taints, the limit is 4 on Kubernetes 1.34']
    assert problems_of(device, minor=35) == []


def test_taint_effect_none_only_from_1_35() -> None:
    assert problems_of(tainted("gpu-0", effect="None"), minor=34) == [
        'device "gpu-0": taint 0: effect "None" is not one of NoSchedule, NoExecute (Kubernetes 1.34)']
    assert problems_of(tainted("gpu-0", effect="None"), minor=35) == []
    assert problems_of(tainted("gpu-0", effect="PreferNoSchedule"), minor=36) == [
        'device "gpu-0": taint 0: effect "PreferNoSchedule" is not one of None, NoSchedule, NoExecute '
        "(Kubernetes 1.36)"]


def test_taint_key_and_value_format() -> None:
    bad_key = Device(name="gpu-0", taints=[DeviceTaint(key="Bad Prefix/-x", effect="NoSchedule")])
    assert problems_of(bad_key) == [
        'device "gpu-0": taint 0: key "Bad Prefix/-x": prefix "Bad Prefix" must be a DNS subdomain',
        'device "gpu-0": taint 0: key "Bad Prefix/-x": name part must be at most 63 alphanumerics, \'-\', \'_\' '
        "or '.', starting and ending with an alphanumeric"]
    bad_value = Device(name="gpu-0", taints=[DeviceTaint(key="xid", value="not ok", effect="NoSchedule")])
    assert problems_of(bad_value) == [
        'device "gpu-0": taint 0: value "not ok" must be a label value (at most 63 alphanumerics, '
        "'-', '_' or '.', starting and ending with an alphanumeric)"]
    assert problems_of(Device(name="gpu-0", taints=[DeviceTaint(key="", effect="NoSchedule")])) == [
        'device "gpu-0": taint 0: key is required']


def test_taint_key_and_value_with_trailing_newline_are_rejected() -> None:
    assert len(problems_of(Device(name="gpu-0", taints=[DeviceTaint(key="xid\n", effect="NoSchedule")]))) == 1
    assert len(problems_of(Device(name="gpu-0", taints=[DeviceTaint(key="xid", value="79\n",
                                                                     effect="NoSchedule")]))) == 1


def test_every_problem_is_reported_at_once() -> None:
    devices = [
        Device(name="gpu-0", attributes={"productName": string_attr("x" * 65), "a/b/c": int_attr(1)}),
        Device(name="Bad"),
        Device(name="gpu-0", capacity={"memory": DeviceCapacity(value="lots")}),
    ]
    problems = validate_devices(devices, DRIVER, L36)
    assert len(problems) == 5
    assert [p.split(":")[0] for p in problems] == [
        'device "gpu-0"', 'device "gpu-0"', 'device "Bad"', 'device "gpu-0"', 'device "gpu-0"']
