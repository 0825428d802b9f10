"""The opaque config API: quantities, strict decoding with readable errors, and MPS limit resolution."""

from __future__ import annotations

from typing import Any

import pytest

from driver.gpu.claimconfig.api import (
    API_VERSION,
    ConfigError,
    GpuConfig,
    MigDeviceConfig,
    MpsConfig,
    MpsLimits,
    parse_config,
    resolve_mps_limits,
)
from driver.gpu.claimconfig.quantity import parse_quantity
from driver.units import GIB, MIB

# --- quantities -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("0", 0),
        ("1024", 1024),
        (1073741824, GIB),
        ("1Ki", 1024),
        ("10Mi", 10 * MIB),
        ("10Gi", 10 * GIB),
        ("2Ti", 2 * 1024**4),
        ("1Pi", 1024**5),
        ("1k", 1000),
        ("5M", 5_000_000),
        ("1G", 10**9),
        ("3T", 3 * 10**12),
        ("1.5Gi", 3 * GIB // 2),
        ("0.5Mi", MIB // 2),
        (".5Ki", 512),
        ("1e9", 10**9),
        ("1E3", 1000),
        ("2.5e3", 2500),
        ("1e-3", 0),  # a thousandth of a byte rounds down
        ("1500m", 1),  # 1.5 bytes rounds down
        ("1.9", 1),
        ("+4Ki", 4096),
        ("1E", 10**18),  # "E" alone is the exa suffix, not an exponent
    ],
)
def test_parse_quantity_accepts_kubernetes_syntax(value: str | int, expected: int) -> None:
    assert parse_quantity(value, "limit") == expected


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("10GB", "is not a valid quantity"),
        ("10gi", "is not a valid quantity"),
        ("1ki", "is not a valid quantity"),
        ("", "is not a valid quantity"),
        (" 1Gi", "is not a valid quantity"),
        ("NaN", "is not a valid quantity"),
        ("1_000", "is not a valid quantity"),
        ("1e", "is not a valid quantity"),
        ("-1Gi", "is negative"),
        (-5, "is negative"),
        ("1e99999", "is out of range"),
        ("9Ei", "is too large"),
        pytest.param(10**5000, "is too large", id="huge-int"),  # repr() of this int would itself raise
        pytest.param("1" * 10**6 + "Gi", "is too long for a quantity", id="huge-text"),
        # int(), Decimal() and re's \\d read other scripts' digits: these would parse as 10Gi.
        ("\u0661\u0660Gi", "contains '\u0661' (U+0661), which is not an ASCII digit"),
        ("1\uff10Gi", "(U+FF10), which is not an ASCII digit"),
        ("1\u00b2", "(U+00B2)"),
        (True, "expected"),
        (1.5, "expected"),
    ],
)
def test_parse_quantity_rejects_bad_input_naming_the_field(value: Any, problem: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_quantity(value, "spec.memory")
    message = str(info.value)
    assert message.startswith("spec.memory: ")
    assert problem in message
    assert '"10Gi"' in message  # an example of what is expected


def test_quantity_errors_do_not_echo_huge_input() -> None:
    with pytest.raises(ValueError) as info:
        parse_quantity("9" * 10**6, "limit")
    assert len(str(info.value)) < 300


# --- decoding ---------------------------------------------------------------------------------


def gpu_config(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "GpuConfig", **fields}


def mig_config(**fields: Any) -> dict[str, Any]:
    return {"apiVersion": API_VERSION, "kind": "MigDeviceConfig", **fields}


def config_error(parameters: Any) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(parameters)
    return str(info.value)


def test_parses_full_mps_config() -> None:
    cfg = parse_config(
        gpu_config(
            sharing={
                "strategy": "MPS",
                "mpsConfig": {
                    "defaultActiveThreadPercentage": 50,
                    "defaultPinnedDeviceMemoryLimit": "10Gi",
                    "defaultPerDevicePinnedMemoryLimit": {"0": "4Gi", "GPU-b": 2048},
                },
            }
        )
    )
    assert isinstance(cfg, GpuConfig)
    assert cfg.sharing is not None and cfg.sharing.mpsConfig is not None
    mps = cfg.sharing.mpsConfig
    assert mps.defaultActiveThreadPercentage == 50
    assert mps.defaultPinnedDeviceMemoryLimit == 10 * GIB
    assert mps.defaultPerDevicePinnedMemoryLimit == {"0": 4 * GIB, "GPU-b": 2048}


def test_parses_time_slicing_with_default_interval() -> None:
    cfg = parse_config(gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {}}))
    assert isinstance(cfg, GpuConfig)
    assert cfg.sharing is not None and cfg.sharing.timeSlicingConfig is not None
    assert cfg.sharing.timeSlicingConfig.interval == "Default"


def test_parses_empty_configs_of_both_kinds() -> None:
    assert parse_config(gpu_config()) == GpuConfig()
    assert parse_config(mig_config()) == MigDeviceConfig()
    mig = parse_config(mig_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 10}}))
    assert isinstance(mig, MigDeviceConfig)
    assert mig.sharing is not None and mig.sharing.mpsConfig is not None
    assert mig.sharing.mpsConfig.defaultActiveThreadPercentage == 10


def test_percentage_out_of_range_names_the_path_and_value() -> None:
    message = config_error(gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 150}}))
    assert message == (
        "GpuConfig.sharing.mpsConfig.defaultActiveThreadPercentage: 150 is out of range; "
        "expected an integer from 1 to 100"
    )


def test_zero_percentage_is_out_of_range() -> None:
    message = config_error(gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 0}}))
    assert "0 is out of range" in message


def test_unknown_field_lists_the_known_ones() -> None:
    assert config_error(gpu_config(sharng={})) == (
        'GpuConfig: unknown field "sharng" (known fields: apiVersion, kind, sharing)'
    )


def test_unknown_nested_field_names_its_parent() -> None:
    message = config_error(gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"threads": 5}}))
    assert message.startswith('GpuConfig.sharing.mpsConfig: unknown field "threads" (known fields: ')
    assert "defaultActiveThreadPercentage" in message


def test_nvidia_api_version_is_refused_with_the_fix() -> None:
    message = config_error({"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"})
    assert message.startswith(
        'apiVersion "resource.nvidia.com/v1beta1" is not served by this driver; use gpu.tessera.dev/v1alpha1'
    )


def test_missing_api_version_and_unknown_kind() -> None:
    assert "apiVersion: required field is missing" in config_error({"kind": "GpuConfig"})
    assert "kind: required field is missing" in config_error({"apiVersion": API_VERSION})
    message = config_error({"apiVersion": API_VERSION, "kind": "VfioDeviceConfig"})
    assert message == 'kind "VfioDeviceConfig" is not served by this driver; expected one of GpuConfig, MigDeviceConfig'


def test_parameters_must_be_a_mapping() -> None:
    assert "expected a mapping" in config_error(["GpuConfig"])


def test_strings_are_not_coerced_to_integers() -> None:
    message = config_error(
        gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": "50"}})
    )
    assert message == 'GpuConfig.sharing.mpsConfig.defaultActiveThreadPercentage: expected an integer, got "50"'


def test_bad_strategy_and_interval_show_the_allowed_values() -> None:
    message = config_error(gpu_config(sharing={"strategy": "mps"}))
    assert message.startswith('GpuConfig.sharing.strategy: "mps" is not allowed; expected ')
    assert "'MPS'" in message and "'TimeSlicing'" in message
    message = config_error(gpu_config(sharing={"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Fast"}}))
    assert message.startswith('GpuConfig.sharing.timeSlicingConfig.interval: "Fast" is not allowed')
    assert "'Short'" in message


def test_missing_strategy_is_reported() -> None:
    assert config_error(gpu_config(sharing={})) == "GpuConfig.sharing.strategy: required field is missing"


@pytest.mark.parametrize(
    ("sharing", "named"),
    [
        ({"strategy": "MPS", "timeSlicingConfig": {}}, ("timeSlicingConfig", '"MPS"')),
        ({"strategy": "TimeSlicing", "mpsConfig": {}}, ("mpsConfig", '"TimeSlicing"')),
    ],
)
def test_config_block_must_match_strategy(sharing: dict[str, Any], named: tuple[str, str]) -> None:
    message = config_error(gpu_config(sharing=sharing))
    assert message.startswith("GpuConfig.sharing: ")
    for word in named:
        assert word in message


@pytest.mark.parametrize(
    "sharing", [{"strategy": "TimeSlicing"}, {"strategy": "MPS", "timeSlicingConfig": {"interval": "Short"}}]
)
def test_time_slicing_on_mig_is_refused_with_the_reason(sharing: dict[str, Any]) -> None:
    message = config_error(mig_config(sharing=sharing))
    assert message.startswith("MigDeviceConfig.sharing: TimeSlicing is not supported on MIG devices")
    assert "no settable time slice" in message
    assert "already isolates" in message


def test_bad_quantities_name_the_field_and_key() -> None:
    message = config_error(
        gpu_config(
            sharing={
                "strategy": "MPS",
                "mpsConfig": {
                    "defaultPinnedDeviceMemoryLimit": "10GB",
                    "defaultPerDevicePinnedMemoryLimit": {"GPU-a": [1]},
                },
            }
        )
    )
    lines = message.splitlines()
    assert len(lines) == 2  # one line per problem
    assert lines[0].startswith('GpuConfig.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit: "10GB" is not a valid')
    assert lines[1].startswith(
        "GpuConfig.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit.GPU-a: expected a quantity"
    )
    assert "[1]" in lines[1]


def test_every_problem_is_reported() -> None:
    message = config_error(
        gpu_config(extra=1, sharing={"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": 101}})
    )
    assert len(message.splitlines()) == 2
    assert 'unknown field "extra"' in message
    assert "101 is out of range" in message


# --- MPS limit resolution ---------------------------------------------------------------------

UUIDS = ["GPU-a", "GPU-b", "GPU-c"]
MEMORY = {"GPU-a": 40 * GIB, "GPU-b": 40 * GIB, "GPU-c": 80 * GIB}


def mps(**fields: Any) -> MpsConfig:
    return MpsConfig.model_validate(fields)


def test_default_limit_applies_to_every_device_and_per_device_entries_win() -> None:
    cfg = mps(
        defaultActiveThreadPercentage=30,
        defaultPinnedDeviceMemoryLimit="10Gi",
        defaultPerDevicePinnedMemoryLimit={"1": "5Gi", "GPU-c": "60Gi"},
    )
    # Passed unsorted on purpose: index keys refer to the UUID-sorted order regardless.
    limits = resolve_mps_limits(cfg, ["GPU-c", "GPU-a", "GPU-b"], MEMORY)
    assert limits == MpsLimits(
        active_thread_percentage=30,
        pinned_memory_bytes={"GPU-a": 10 * GIB, "GPU-b": 5 * GIB, "GPU-c": 60 * GIB},
    )


def test_no_limits_configured_gives_empty_limits() -> None:
    assert resolve_mps_limits(mps(), UUIDS, MEMORY) == MpsLimits()


def test_per_device_only_limits_leave_other_devices_unlimited() -> None:
    limits = resolve_mps_limits(mps(defaultPerDevicePinnedMemoryLimit={"0": "1Gi"}), UUIDS, MEMORY)
    assert limits.pinned_memory_bytes == {"GPU-a": GIB}


def test_device_with_unknown_memory_is_not_size_checked() -> None:
    limits = resolve_mps_limits(mps(defaultPinnedDeviceMemoryLimit="100Gi"), ["MIG-x"], {})
    assert limits.pinned_memory_bytes == {"MIG-x": 100 * GIB}


@pytest.mark.parametrize(
    ("cfg", "expected"),
    [
        (
            {"defaultPerDevicePinnedMemoryLimit": {"3": "1Gi"}},
            "mpsConfig.defaultPerDevicePinnedMemoryLimit.3: index 3 is out of range",
        ),
        (
            {"defaultPerDevicePinnedMemoryLimit": {"GPU-z": "1Gi"}},
            'mpsConfig.defaultPerDevicePinnedMemoryLimit.GPU-z: "GPU-z" is not one of this config\'s devices',
        ),
        (
            {"defaultPerDevicePinnedMemoryLimit": {"0": "1Gi", "GPU-a": "2Gi"}},
            'mpsConfig.defaultPerDevicePinnedMemoryLimit.GPU-a: names the same device (GPU-a) as key "0"',
        ),
        (
            {"defaultPinnedDeviceMemoryLimit": "50Gi"},
            "mpsConfig.defaultPinnedDeviceMemoryLimit: 51200 MiB is more than the 40960 MiB of memory on device GPU-a",
        ),
        (
            {"defaultPerDevicePinnedMemoryLimit": {"2": "81Gi"}},
            "mpsConfig.defaultPerDevicePinnedMemoryLimit.2: 82944 MiB is more than the 81920 MiB",
        ),
        (
            {"defaultPinnedDeviceMemoryLimit": "1000Ki"},
            "mpsConfig.defaultPinnedDeviceMemoryLimit: 1024000 bytes is less than 1 MiB",
        ),
    ],
)
def test_bad_limits_name_the_key(cfg: dict[str, Any], expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_mps_limits(mps(**cfg), UUIDS, MEMORY)
    assert str(info.value).startswith(expected)


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        ("-1", "mpsConfig.defaultPerDevicePinnedMemoryLimit.-1: index -1 is negative; the claim's devices"),
        ("7", "mpsConfig.defaultPerDevicePinnedMemoryLimit.7: index 7 is out of range"),
        ("9" * 60, f"mpsConfig.defaultPerDevicePinnedMemoryLimit.{'9' * 60}: index {'9' * 60} is out of range"),
        # "\u0661" is an Arabic-Indic one: isdecimal() is true and int() reads it as 1.
        ("\u0661", "mpsConfig.defaultPerDevicePinnedMemoryLimit.\u0661: an index is written in ASCII digits 0-9"),
    ],
)
def test_odd_device_keys_are_claim_errors(key: str, expected: str) -> None:
    with pytest.raises(ConfigError) as info:
        resolve_mps_limits(mps(defaultPerDevicePinnedMemoryLimit={key: "1Gi"}), UUIDS, MEMORY)
    assert str(info.value).startswith(expected)


def test_a_huge_device_key_is_a_short_config_error() -> None:
    # int() of a 10**6-digit string raises a plain ValueError (past 4300 digits), which would have
    # surfaced as an internal error; the key is refused while decoding, without echoing it.
    huge = "1" * 10**6
    message = config_error(
        gpu_config(sharing={"strategy": "MPS", "mpsConfig": {"defaultPerDevicePinnedMemoryLimit": {huge: "1Gi"}}})
    )
    assert message.startswith(
        'GpuConfig.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit: key "11111111111111111111..." is too long '
        "(1000000 characters)"
    )
    assert len(message) < 300
