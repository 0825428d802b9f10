"""MIG profile naming: the go-nvlib rule, its half-away-from-zero rounding, suffixes, name fragments."""

from __future__ import annotations

import pytest

from driver.gpu.discovery.migprofiles import (
    GI_PROFILE_1_SLICE_ALL_ME,
    GI_PROFILE_1_SLICE_GFX,
    GI_PROFILE_1_SLICE_NO_ME,
    GI_PROFILE_1_SLICE_REV1,
    GI_PROFILE_1_SLICE_REV2,
    GI_PROFILE_2_SLICE_REV1,
    device_name_fragment,
    memory_gb,
    profile_name,
)
from driver.units import MIB

# Totals as NVML reports them.
A100_40GB = 40960 * MIB
A30 = 24576 * MIB
H100_80GB = 81559 * MIB
H200 = 143771 * MIB
B200 = 183359 * MIB  # 179.06 GiB: total_gb = 180


@pytest.mark.parametrize(
    ("compute", "gi", "memory_mib", "total", "gi_enum", "expected"),
    [
        (1, 1, 4864, A100_40GB, 0, "1g.5gb"),
        (1, 1, 4864, A100_40GB, GI_PROFILE_1_SLICE_REV1, "1g.5gb+me"),
        (1, 1, 9856, A100_40GB, GI_PROFILE_1_SLICE_REV2, "1g.10gb"),  # REV2: 1g, two memory slices, no suffix
        (2, 2, 9856, A100_40GB, 1, "2g.10gb"),
        (3, 3, 19968, A100_40GB, 2, "3g.20gb"),
        (7, 7, 40192, A100_40GB, 4, "7g.40gb"),
        (1, 1, 9984, H100_80GB, 0, "1g.10gb"),
        (1, 1, 20096, H100_80GB, GI_PROFILE_1_SLICE_REV2, "1g.20gb"),
        (7, 7, 81152, H100_80GB, 4, "7g.80gb"),
        (1, 1, 5952, A30, 0, "1g.6gb"),
        (2, 2, 11968, A30, GI_PROFILE_2_SLICE_REV1, "2g.12gb+me"),
        # The cases Python's round() gets wrong (x.5 rounds to even there).
        (3, 3, 71168, H200, 2, "3g.71gb"),
        (4, 4, 71168, H200, 3, "4g.71gb"),
        (1, 1, 16384, H200, 0, "1g.18gb"),
        (7, 7, 143104, H200, 4, "7g.141gb"),
        (1, 1, 22528, B200, 0, "1g.23gb"),
        # A compute instance smaller than its GPU instance.
        (1, 3, 40448, H100_80GB, 2, "1c.3g.40gb"),
        (2, 4, 40448, H100_80GB, 3, "2c.4g.40gb"),
        # Suffixes by GI enum.
        (1, 1, 9984, H100_80GB, GI_PROFILE_1_SLICE_ALL_ME, "1g.10gb+me.all"),
        (1, 1, 9984, H100_80GB, GI_PROFILE_1_SLICE_GFX, "1g.10gb+gfx"),
        (1, 1, 9984, H100_80GB, GI_PROFILE_1_SLICE_NO_ME, "1g.10gb-me"),
    ],
)
def test_profile_name(compute: int, gi: int, memory_mib: int, total: int, gi_enum: int, expected: str) -> None:
    assert profile_name(compute, gi, memory_mib, total, gi_enum) == expected


def test_half_rounds_away_from_zero_where_python_round_does_not() -> None:
    # H200 3g: 4/8 of 141 GB = 70.5; B200 1g: 1/8 of 180 GB = 22.5.
    assert round(70.5) == 70 and memory_gb(71168, H200) == 71
    assert round(22.5) == 22 and memory_gb(22528, B200) == 23


def test_fraction_rounds_up_to_the_next_eighth() -> None:
    # 4864 MiB is 0.95/8 of a 40 GiB A100: rounds up to 1/8 → 5 GB, not down to 0.
    assert memory_gb(4864, A100_40GB) == 5
    # Exactly half the GPU stays at 4/8.
    assert memory_gb(20480, A100_40GB) == 20


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, 1, 4864, A100_40GB, 0), "compute_slices_ci"),
        ((0, 1, 4864, A100_40GB, 0), "compute_slices_ci"),
        ((1, 0, 4864, A100_40GB, 0), "gi_slices"),
        ((1, 1, 0, A100_40GB, 0), "memory_mib"),
        ((1, 1, 4864, 0, 0), "total_memory_bytes"),
    ],
)
def test_profile_name_rejects_impossible_shapes(args: tuple[int, int, int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        profile_name(*args)


@pytest.mark.parametrize(
    ("profile", "fragment"),
    [
        ("1g.10gb", "1g10gb"),
        ("1g.10gb+me", "1g10gbme"),
        ("1g.10gb-me", "1g10gb-me"),
        ("1g.10gb+me.all", "1g10gbmeall"),
        ("1c.3g.40gb", "1c3g40gb"),
        ("3g.71gb", "3g71gb"),
        ("1G.10GB", "1g10gb"),
        ("1g.10gb_x", "1g10gb-x"),
    ],
)
def test_device_name_fragment(profile: str, fragment: str) -> None:
    assert device_name_fragment(profile) == fragment


@pytest.mark.parametrize("profile", ["", "+.", "-1g", "1g_"])
def test_device_name_fragment_rejects_unusable_profiles(profile: str) -> None:
    with pytest.raises(ValueError, match="device-name fragment"):
        device_name_fragment(profile)
