"""Opaque config precedence: defaults, class vs claim, request matching, kind checks, grouping."""

from __future__ import annotations

from typing import Any

import pytest

from driver.gpu.claimconfig.api import API_VERSION, ConfigError, GpuConfig, MigDeviceConfig
from driver.gpu.claimconfig.choices import DeviceKind
from driver.gpu.claimconfig.precedence import group_by_config, resolve_configs
from driver.kubeletplugin.claimmodel import DeviceAllocationConfiguration, DeviceRequestAllocationResult

DRIVER = "gpu.tessera.dev"

# Device name -> kind, as the prepare path would derive it from its published devices.
KINDS = {"gpu-0": DeviceKind.GPU, "gpu-1": DeviceKind.GPU, "gpu-2-mig-1g10gb-0": DeviceKind.MIG,
         "gpu-3-mps-0": DeviceKind.MPS, "gpu-3-ts-1": DeviceKind.TIMESLICE}


def kind_of(result: DeviceRequestAllocationResult) -> DeviceKind:
    return KINDS[result.device]


def result(request: str, device: str) -> DeviceRequestAllocationResult:
    return DeviceRequestAllocationResult.model_validate(
        {"request": request, "driver": DRIVER, "pool": "node-1", "device": device}
    )


def entry(source: str, requests: list[str], kind: str = "GpuConfig", **fields: Any) -> DeviceAllocationConfiguration:
    parameters = {"apiVersion": API_VERSION, "kind": kind, **fields}
    return DeviceAllocationConfiguration.model_validate(
        {"source": source, "requests": requests, "opaque": {"driver": DRIVER, "parameters": parameters}}
    )


def mps(percent: int) -> dict[str, Any]:
    return {"strategy": "MPS", "mpsConfig": {"defaultActiveThreadPercentage": percent}}


def percent_of(config: GpuConfig | MigDeviceConfig) -> int | None:
    sharing = config.sharing
    if sharing is None or sharing.mpsConfig is None:
        return None
    return sharing.mpsConfig.defaultActiveThreadPercentage


def test_without_configs_every_device_gets_the_built_in_default_of_its_kind() -> None:
    results = [result("gpu", "gpu-0"), result("mig", "gpu-2-mig-1g10gb-0"), result("share", "gpu-3-mps-0")]
    resolved = resolve_configs([], results, kind_of, whole_gpu_class=DRIVER)
    assert [r.result for r in resolved] == results
    assert [type(r.config) for r in resolved] == [GpuConfig, MigDeviceConfig, GpuConfig]
    assert all(r.config.sharing is None and r.origin == "built-in default" for r in resolved)


def test_claim_entry_beats_class_entry() -> None:
    configs = [entry("FromClass", [], sharing=mps(10)), entry("FromClaim", [], sharing=mps(20))]
    [resolved] = resolve_configs(configs, [result("gpu", "gpu-0")], kind_of, whole_gpu_class=DRIVER)
    assert percent_of(resolved.config) == 20
    assert resolved.origin == "claim config #1 (requests: all)"


def test_later_entry_of_the_same_source_wins_whole_without_merging() -> None:
    configs = [
        entry(
            "FromClaim", ["gpu"], sharing={"strategy": "MPS", "mpsConfig": {"defaultPinnedDeviceMemoryLimit": "1Gi"}}
        ),
        entry("FromClaim", ["gpu"], sharing=mps(40)),
    ]
    [resolved] = resolve_configs(configs, [result("gpu", "gpu-0")], kind_of, whole_gpu_class=DRIVER)
    assert resolved.config.sharing is not None and resolved.config.sharing.mpsConfig is not None
    assert resolved.config.sharing.mpsConfig.defaultActiveThreadPercentage == 40
    assert resolved.config.sharing.mpsConfig.defaultPinnedDeviceMemoryLimit is None  # not merged from #1
    assert resolved.origin == "claim config #2 (requests: [gpu])"


def test_class_entry_applies_when_the_claim_has_none_for_that_request() -> None:
    configs = [entry("FromClass", [], sharing=mps(10)), entry("FromClaim", ["other"], sharing=mps(20))]
    [resolved] = resolve_configs(configs, [result("gpu", "gpu-0")], kind_of, whole_gpu_class=DRIVER)
    assert percent_of(resolved.config) == 10
    assert resolved.origin == "class config #1 (requests: all)"


@pytest.mark.parametrize(
    ("entry_requests", "result_request", "applies"),
    [
        (["gpu"], "gpu", True),
        (["gpu"], "gpu/big", True),  # the base name covers every sub-request
        (["gpu/big"], "gpu/big", True),
        (["gpu/small"], "gpu/big", False),
        (["gpu/big"], "gpu", False),
        (["gp"], "gpu", False),
        (["other", "gpu"], "gpu/small", True),
        ([], "anything/sub", True),
    ],
)
def test_request_matching(entry_requests: list[str], result_request: str, applies: bool) -> None:
    configs = [entry("FromClaim", entry_requests, sharing=mps(77))]
    [resolved] = resolve_configs(configs, [result(result_request, "gpu-0")], kind_of, whole_gpu_class=DRIVER)
    assert (percent_of(resolved.config) == 77) is applies


def test_explicit_entry_of_the_wrong_kind_is_an_error() -> None:
    configs = [entry("FromClaim", ["mig"], kind="GpuConfig")]
    with pytest.raises(ConfigError) as info:
        resolve_configs(configs, [result("mig", "gpu-2-mig-1g10gb-0")], kind_of, whole_gpu_class=DRIVER)
    assert str(info.value) == (
        'claim config #1 (requests: [mig]): GpuConfig cannot configure mig device gpu-2-mig-1g10gb-0 (request "mig"); '
        "use MigDeviceConfig for it"
    )


def test_explicit_mig_config_on_a_whole_gpu_is_an_error() -> None:
    configs = [entry("FromClass", ["gpu"], kind="MigDeviceConfig")]
    with pytest.raises(
        ConfigError, match=r"^class config #1 \(requests: \[gpu\]\): MigDeviceConfig cannot configure gpu"
    ):
        resolve_configs(configs, [result("gpu", "gpu-0")], kind_of, whole_gpu_class=DRIVER)


def test_catch_all_entry_of_the_wrong_kind_is_skipped_for_earlier_entries() -> None:
    configs = [
        entry("FromClaim", [], kind="GpuConfig", sharing=mps(30)),
        entry("FromClaim", [], kind="MigDeviceConfig", sharing=mps(60)),
    ]
    gpu, mig = resolve_configs(configs, [result("a", "gpu-0"), result("b", "gpu-2-mig-1g10gb-0")], kind_of,
                               whole_gpu_class=DRIVER)
    assert isinstance(gpu.config, GpuConfig) and percent_of(gpu.config) == 30
    assert isinstance(mig.config, MigDeviceConfig) and percent_of(mig.config) == 60
    assert gpu.origin == "claim config #1 (requests: all)"
    assert mig.origin == "claim config #2 (requests: all)"


def test_catch_all_mig_config_leaves_whole_gpus_on_the_default() -> None:
    configs = [entry("FromClaim", [], kind="MigDeviceConfig", sharing=mps(60))]
    [resolved] = resolve_configs(configs, [result("gpu", "gpu-0")], kind_of, whole_gpu_class=DRIVER)
    assert resolved.config == GpuConfig()
    assert resolved.origin == "built-in default"


@pytest.mark.parametrize("device", ["gpu-3-mps-0", "gpu-3-ts-1"])
@pytest.mark.parametrize("requests", [[], ["share"]])
def test_sharing_config_on_a_plan_share_is_refused(device: str, requests: list[str]) -> None:
    configs = [entry("FromClaim", requests, sharing={"strategy": "TimeSlicing"})]
    with pytest.raises(ConfigError) as info:
        resolve_configs(configs, [result("share", device)], kind_of, whole_gpu_class=DRIVER)
    message = str(info.value)
    assert f"GpuConfig.sharing cannot be applied to {KINDS[device]} device {device}" in message
    assert "node's sharing plan" in message
    assert "request a whole GPU" in message


def test_plain_gpu_config_on_a_plan_share_is_accepted() -> None:
    configs = [entry("FromClaim", ["share"])]
    [resolved] = resolve_configs(configs, [result("share", "gpu-3-mps-0")], kind_of, whole_gpu_class=DRIVER)
    assert resolved.origin == "claim config #1 (requests: [share])"


def test_decoding_errors_name_source_and_position() -> None:
    configs = [
        entry("FromClass", []),
        entry("FromClaim", ["gpu"]),
        entry("FromClaim", ["gpu"], sharing=mps(150), sharng={}),
    ]
    with pytest.raises(ConfigError) as info:
        resolve_configs(configs, [result("gpu", "gpu-0")], kind_of, whole_gpu_class=DRIVER)
    lines = sorted(str(info.value).splitlines())
    assert lines == [
        "claim config #2 (requests: [gpu]): GpuConfig.sharing.mpsConfig.defaultActiveThreadPercentage: "
        "150 is out of range; expected an integer from 1 to 100",
        'claim config #2 (requests: [gpu]): GpuConfig: unknown field "sharng" '
        "(known fields: apiVersion, kind, sharing)",
    ]


def test_broken_entry_is_an_error_even_if_it_applies_to_no_result() -> None:
    configs = [entry("FromClaim", ["unused"], kind="Bogus")]
    with pytest.raises(ConfigError, match=r'^claim config #1 \(requests: \[unused\]\): kind "Bogus"'):
        resolve_configs(configs, [result("gpu", "gpu-0")], kind_of, whole_gpu_class=DRIVER)


def test_entry_without_opaque_parameters_is_an_error() -> None:
    configs = [DeviceAllocationConfiguration.model_validate({"source": "FromClaim", "requests": []})]
    with pytest.raises(ConfigError, match="no opaque parameters"):
        resolve_configs(configs, [result("gpu", "gpu-0")], kind_of, whole_gpu_class=DRIVER)


def test_problems_of_several_results_are_all_reported() -> None:
    configs = [entry("FromClaim", ["a", "b"], sharing=mps(10))]
    with pytest.raises(ConfigError) as info:
        resolve_configs(configs, [result("a", "gpu-3-mps-0"), result("b", "gpu-3-ts-1")], kind_of,
                        whole_gpu_class=DRIVER)
    assert len(str(info.value).splitlines()) == 2


def test_grouping_follows_the_winning_config_object() -> None:
    configs = [
        entry("FromClass", [], sharing=mps(10)),
        entry("FromClaim", ["b", "c"], sharing=mps(20)),
        entry("FromClaim", ["d"], sharing=mps(20)),  # equal to #1 but a separate object: its own group
    ]
    results = [
        result("a", "gpu-0"),
        result("b", "gpu-1"),
        result("m", "gpu-2-mig-1g10gb-0"),
        result("c/sub", "gpu-0"),
        result("d", "gpu-1"),
    ]
    groups = group_by_config(resolve_configs(configs, results, kind_of, whole_gpu_class=DRIVER))
    assert [[r.request for r in members] for _, members in groups] == [["a"], ["b", "c/sub"], ["m"], ["d"]]
    assert [percent_of(config) for config, _ in groups] == [10, 20, None, 20]
    assert isinstance(groups[2][0], MigDeviceConfig)


def test_defaults_group_every_unconfigured_device_of_a_kind_together() -> None:
    results = [result("a", "gpu-0"), result("b", "gpu-1"), result("m", "gpu-2-mig-1g10gb-0")]
    groups = group_by_config(resolve_configs([], results, kind_of, whole_gpu_class=DRIVER))
    assert [[r.request for r in members] for _, members in groups] == [["a", "b"], ["m"]]


def test_group_by_config_of_nothing_is_empty() -> None:
    assert group_by_config([]) == []
