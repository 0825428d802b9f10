"""The device naming scheme and its parser."""

from __future__ import annotations

import pytest

from driver.gpu.published.devicenames import (
    ParsedDeviceName,
    device_kind,
    dynamic_mig_device_name,
    gpu_device_name,
    mig_device_name,
    parse_device_name,
    share_device_name,
)


def test_names() -> None:
    assert gpu_device_name(0) == "gpu-0"
    assert mig_device_name(0, "1g.10gb", 3) == "gpu-0-mig-1g10gb-3"
    assert mig_device_name(12, "1g.10gb+me", 6) == "gpu-12-mig-1g10gbme-6"
    assert mig_device_name(1, "1g.10gb-me", 0) == "gpu-1-mig-1g10gb-me-0"
    assert dynamic_mig_device_name(0, "3g.40gb", 4) == "gpu-0-dynmig-3g40gb-4"
    assert share_device_name(2, "MPS", 0) == "gpu-2-mps-0"
    assert share_device_name(2, "TimeSlicing", 7) == "gpu-2-ts-7"


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("gpu-0", ParsedDeviceName(kind="gpu", minor=0)),
        ("gpu-15", ParsedDeviceName(kind="gpu", minor=15)),
        ("gpu-0-mig-1g10gb-3", ParsedDeviceName(kind="mig", minor=0, mig_profile="1g10gb", placement_start=3)),
        ("gpu-1-mig-1g10gb-me-0", ParsedDeviceName(kind="mig", minor=1, mig_profile="1g10gb-me", placement_start=0)),
        ("gpu-0-dynmig-3g40gb-4",
         ParsedDeviceName(kind="mig", minor=0, mig_profile="3g40gb", placement_start=4, dynamic=True)),
        ("gpu-3-mps-2", ParsedDeviceName(kind="mps", minor=3, share_index=2)),
        ("gpu-3-ts-11", ParsedDeviceName(kind="timeslice", minor=3, share_index=11)),
    ],
)
def test_parse_device_name(name: str, parsed: ParsedDeviceName) -> None:
    assert parse_device_name(name) == parsed
    assert device_kind(name) == parsed.kind


def test_built_names_parse_back() -> None:
    assert parse_device_name(gpu_device_name(7)) == ParsedDeviceName(kind="gpu", minor=7)
    assert parse_device_name(mig_device_name(7, "2c.4g.40gb", 4)) == ParsedDeviceName(
        kind="mig", minor=7, mig_profile="2c4g40gb", placement_start=4
    )
    assert parse_device_name(mig_device_name(7, "1g.10gb+me.all", 6)).mig_profile == "1g10gbmeall"
    assert parse_device_name(share_device_name(7, "MPS", 47)) == ParsedDeviceName(kind="mps", minor=7, share_index=47)
    assert parse_device_name(share_device_name(7, "TimeSlicing", 0)).kind == "timeslice"


def test_a_placement_never_has_the_name_of_the_instance_that_could_stand_there() -> None:
    # A claim for a placement must not resolve to an instance someone else later creates at that place
    # (docs/sharing.md, D: "Why the names differ from static MIG names").
    for profile, start in (("1g.10gb", 0), ("3g.40gb", 4), ("7g.80gb", 0), ("1g.10gb+me", 6)):
        placement, instance = dynamic_mig_device_name(0, profile, start), mig_device_name(0, profile, start)
        assert placement != instance
        assert parse_device_name(placement).dynamic and not parse_device_name(instance).dynamic


@pytest.mark.parametrize(
    "name", ["gpu", "gpu-", "gpu-01", "gpu-a", "GPU-0", "gpu-0-mig-1g10gb", "gpu-0-mps-", "gpu-0-vgpu-1", "nic-0", ""]
)
def test_parse_device_name_rejects_foreign_names(name: str) -> None:
    with pytest.raises(ValueError, match="not one of this driver's"):
        parse_device_name(name)


def test_name_builders_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="minor"):
        gpu_device_name(-1)
    with pytest.raises(ValueError, match="placement start"):
        mig_device_name(0, "1g.10gb", -1)
    with pytest.raises(ValueError, match="placement start"):
        dynamic_mig_device_name(0, "1g.10gb", -1)
    with pytest.raises(ValueError, match="share index"):
        share_device_name(0, "MPS", -1)
    with pytest.raises(ValueError, match="strategy"):
        share_device_name(0, "mps", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="longer than 63"):
        mig_device_name(0, "1g." + "x" * 60, 0)
