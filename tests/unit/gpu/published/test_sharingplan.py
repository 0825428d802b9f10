"""The node sharing plan: loading the file, picking the node's plan, resolving it per GPU."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest

from driver.gpu.discovery.inventory import GpuInfo, MigInstance, NodeInventory
from driver.gpu.published.sharelayout import GpuForm
from driver.gpu.published.sharingplan import (
    PlanError,
    SharingPlan,
    SharingPlans,
    entries_matching_no_gpu,
    load_plans,
    resolve_layout,
    resolve_plan,
    select_plan,
)
from driver.units import GIB, MIB

LABEL = "gpu.tessera.dev/sharing-plan"

A100 = GpuInfo(
    minor=0, index=0, uuid="GPU-a100-0", product_name="NVIDIA A100-SXM4-40GB", memory_bytes=40 * GIB, mig_capable=True
)
A100_MIG = GpuInfo(
    minor=1,
    index=1,
    uuid="GPU-a100-1",
    product_name="NVIDIA A100-SXM4-40GB",
    memory_bytes=40 * GIB,
    mig_capable=True,
    mig_enabled=True,
    mig_instances=(
        MigInstance(
            uuid="MIG-1", profile="1g.5gb", gi_profile_id=19, placement_start=0, placement_size=1, gi_id=1, ci_id=0
        ),
    ),
)

T4 = GpuInfo(minor=2, index=2, uuid="GPU-t4-2", product_name="Tesla T4", memory_bytes=15 * GIB + 360 * MIB + 7)
T4_NO_MEMORY = GpuInfo(minor=3, index=3, uuid="GPU-t4-3", product_name="Tesla T4")


def inventory_of(*gpus: GpuInfo) -> NodeInventory:
    return NodeInventory(driver_version="580.95.05", gpus=gpus)


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "sharing-plans.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def plan(*entries: dict[str, Any]) -> SharingPlan:
    return SharingPlan.model_validate({"gpus": list(entries)})


def plan_error(tmp_path: Path, text: str) -> str:
    path = write(tmp_path, text)
    with pytest.raises(PlanError) as info:
        load_plans(path)
    message = str(info.value)
    for line in message.splitlines():
        assert line.startswith(f"{path}: ")  # every problem names the file
    return message.replace(f"{path}: ", "")


# --- loading ----------------------------------------------------------------------------------

EXAMPLE = """\
defaultPlan: whole
plans:
  whole: {}
  a100-mps4:
    gpus:
    - match: {product: "NVIDIA A100*"}
      mps:
        shares: 4
        activeThreadPercentage: 25
        pinnedMemoryLimit: 10Gi
      allowMultipleSharesPerClaim: false
  t4-ts:
    gpus:
    - match: {minor: 3}
      whole: true
    - match: {all: true}
      timeSlicing:
        shares: 4
        interval: Short
        memoryPerShare: 4Gi
"""


def test_loads_the_documented_example(tmp_path: Path) -> None:
    plans = load_plans(write(tmp_path, EXAMPLE))
    assert plans.defaultPlan == "whole"
    assert set(plans.plans) == {"whole", "a100-mps4", "t4-ts"}
    assert plans.plans["whole"].gpus == []
    [mps_entry] = plans.plans["a100-mps4"].gpus
    assert mps_entry.mps is not None
    assert (mps_entry.mps.shares, mps_entry.mps.activeThreadPercentage) == (4, 25)
    assert mps_entry.mps.pinnedMemoryLimit == 10 * GIB
    whole, ts = plans.plans["t4-ts"].gpus
    assert whole.whole is True and whole.match.minor == 3
    assert ts.timeSlicing is not None and ts.match.match_all is True
    assert (ts.timeSlicing.shares, ts.timeSlicing.interval, ts.timeSlicing.memoryPerShare) == (4, "Short", 4 * GIB)


def test_empty_file_means_no_plans(tmp_path: Path) -> None:
    assert load_plans(write(tmp_path, "")) == SharingPlans()


def test_missing_file_names_the_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.yaml"
    with pytest.raises(PlanError, match=f"^{path}: cannot read the sharing plans file"):
        load_plans(path)


def test_invalid_yaml_names_the_path(tmp_path: Path) -> None:
    path = write(tmp_path, "plans: [unclosed\n")
    with pytest.raises(PlanError, match=f"^{path}: not valid YAML"):
        load_plans(path)


def test_duplicate_keys_are_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "plans:\n  a: {}\n  a: {gpus: []}\n")
    with pytest.raises(PlanError, match='duplicate key "a"'):
        load_plans(path)


def test_shares_out_of_range_names_the_entry_path(tmp_path: Path) -> None:
    message = plan_error(
        tmp_path,
        """\
        plans:
          a100-mps4:
            gpus:
            - match: {all: true}
              mps: {shares: 1}
        """,
    )
    assert message == "plans.a100-mps4.gpus[0].mps.shares: must be between 2 and 48, got 1"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ("mps: {shares: 49}", "gpus[0].mps.shares: must be between 2 and 48, got 49"),
        ("timeSlicing: {shares: 1}", "gpus[0].timeSlicing.shares: must be between 2 and 48, got 1"),
        (
            "mps: {shares: 2, activeThreadPercentage: 0}",
            "gpus[0].mps.activeThreadPercentage: must be between 1 and 100",
        ),
        ("mps: {shares: 2, activeThreadPercentage: 101}", "gpus[0].mps.activeThreadPercentage: must be between 1 and"),
        ('mps: {shares: "4"}', 'gpus[0].mps.shares: expected an integer, got "4"'),
        ("mps: {shares: 2, pinnedMemoryLimit: 10GB}", 'gpus[0].mps.pinnedMemoryLimit: "10GB" is not a valid quantity'),
        ("timeSlicing: {shares: 2, interval: short}", 'gpus[0].timeSlicing.interval: "short" is not allowed'),
        ("mps: {shares: 2, thread: 5}", 'gpus[0].mps: unknown field "thread" (known fields: shares, '),
        ("whole: true\nextra: 1", 'gpus[0]: unknown field "extra"'),
        ("whole: true\nmps: {shares: 2}",
         "gpus[0]: set exactly one of mps, timeSlicing, consumable, dynamicMig, whole: true (got mps, whole)"),
        ("allowMultipleSharesPerClaim: true",
         "gpus[0]: set exactly one of mps, timeSlicing, consumable, dynamicMig, whole: true (got none)"),
        ("whole: false", "gpus[0]: whole: false is not a publishing form"),
        ("whole: true\nallowMultipleSharesPerClaim: true", "gpus[0]: allowMultipleSharesPerClaim applies only to"),
    ],
)
def test_entry_errors_name_field_and_value(tmp_path: Path, body: str, expected: str) -> None:
    text = "plans:\n  p:\n    gpus:\n    - match: {all: true}\n" + textwrap.indent(body, "      ") + "\n"
    message = plan_error(tmp_path, text)
    assert message.startswith("plans.p." + expected)


@pytest.mark.parametrize(
    ("match", "expected"),
    [
        ("{}", "set exactly one of minor, uuid, product, all: true, or migProfile (got none)"),
        ("{minor: 1, uuid: GPU-x}",
         "set exactly one of minor, uuid, product, all: true, or migProfile (got minor, uuid)"),
        ("{all: false}", "all: false matches nothing"),
        ('{minor: "1"}', 'expected an integer, got "1"'),
        ("{name: x}", 'unknown field "name" (known fields: minor, uuid, product, all, migProfile)'),
    ],
)
def test_match_errors(tmp_path: Path, match: str, expected: str) -> None:
    message = plan_error(tmp_path, f"plans:\n  p:\n    gpus:\n    - match: {match}\n      whole: true\n")
    assert message.startswith("plans.p.gpus[0].match")
    assert expected in message


def test_plan_names_must_be_label_values(tmp_path: Path) -> None:
    message = plan_error(tmp_path, "plans:\n  Bad Name: {}\n")
    assert message.startswith('plans: plan name "Bad Name" is not a valid label value')
    message = plan_error(tmp_path, f"plans:\n  {'x' * 64}: {{}}\n")
    assert "is not a valid label value" in message


def test_unquoted_yaml_boolean_plan_name_is_reported(tmp_path: Path) -> None:
    assert plan_error(tmp_path, "plans:\n  yes: {}\n") == "plans: key true: expected a string (quote the key)"


def test_default_plan_must_exist(tmp_path: Path) -> None:
    message = plan_error(tmp_path, "defaultPlan: missing\nplans:\n  b: {}\n  a: {}\n")
    assert message == 'defaultPlan "missing" is not defined; known plans: a, b'


def test_unknown_top_level_field(tmp_path: Path) -> None:
    assert plan_error(tmp_path, "plan: {}\n") == (
        'unknown field "plan" (known fields: defaultPlan, consumableCapacityGate, partitionableDevicesGate, plans)')


def test_every_problem_is_reported(tmp_path: Path) -> None:
    message = plan_error(
        tmp_path,
        """\
        plans:
          a:
            gpus:
            - match: {all: true}
              mps: {shares: 1}
          b:
            gpus:
            - match: {all: true}
              timeSlicing: {shares: 99}
        """,
    )
    assert message.splitlines() == [
        "plans.a.gpus[0].mps.shares: must be between 2 and 48, got 1",
        "plans.b.gpus[0].timeSlicing.shares: must be between 2 and 48, got 99",
    ]


# --- selection --------------------------------------------------------------------------------

PLANS = SharingPlans.model_validate({"defaultPlan": "base", "plans": {"base": {}, "mps": {}, "ts": {}}})


def test_label_selects_the_plan() -> None:
    name, selected = select_plan(PLANS, {LABEL: "mps", "other": "ts"}, LABEL)
    assert name == "mps"
    assert selected is PLANS.plans["mps"]


def test_no_label_uses_the_default_plan() -> None:
    name, selected = select_plan(PLANS, {"other": "ts"}, LABEL)
    assert name == "base"
    assert selected is PLANS.plans["base"]


def test_no_label_and_no_default_is_an_empty_plan() -> None:
    assert select_plan(SharingPlans(), {}, LABEL) == (None, SharingPlan())


def test_label_key_is_configurable() -> None:
    assert select_plan(PLANS, {"example.com/plan": "ts", LABEL: "mps"}, "example.com/plan")[0] == "ts"


def test_label_naming_an_unknown_plan_lists_the_known_ones() -> None:
    with pytest.raises(PlanError) as info:
        select_plan(PLANS, {LABEL: "mps8"}, LABEL)
    assert str(info.value) == (
        'node label gpu.tessera.dev/sharing-plan="mps8" names no sharing plan; known plans: base, mps, ts'
    )


# --- resolution -------------------------------------------------------------------------------


def test_mps_defaults_split_threads_and_memory_equally() -> None:
    layout = resolve_layout(plan({"match": {"uuid": "GPU-t4-2"}, "mps": {"shares": 3}}), inventory_of(A100, T4), "p")
    assert layout == {
        "GPU-t4-2": GpuForm(
            strategy="MPS",
            count=3,
            active_thread_percentage=33,  # floor(100 / 3)
            memory_bytes_per_share=5240 * MIB,  # floor(15720 MiB / 3), whole MiB
        )
    }


def test_mps_explicit_values_are_used_and_rounded_to_whole_mib() -> None:
    entry = {
        "match": {"product": "NVIDIA A100*"},
        "mps": {"shares": 4, "activeThreadPercentage": 50, "pinnedMemoryLimit": 10 * GIB + 100},
        "allowMultipleSharesPerClaim": True,
    }
    layout = resolve_layout(plan(entry), inventory_of(A100, T4), "p")
    assert layout == {
        "GPU-a100-0": GpuForm(
            strategy="MPS",
            count=4,
            active_thread_percentage=50,
            memory_bytes_per_share=10 * GIB,
            allow_multiple_shares_per_claim=True,
        )
    }


def test_time_slicing_defaults_and_explicit_values() -> None:
    layout = resolve_layout(plan({"match": {"all": True}, "timeSlicing": {"shares": 4}}), inventory_of(A100), "p")
    assert layout["GPU-a100-0"] == GpuForm(
        strategy="TimeSlicing", count=4, memory_bytes_per_share=10 * GIB, interval="Default"
    )
    explicit = {"match": {"minor": 0}, "timeSlicing": {"shares": 2, "interval": "Long", "memoryPerShare": "3Gi"}}
    layout = resolve_layout(plan(explicit), inventory_of(A100), "p")
    assert layout["GPU-a100-0"] == GpuForm(
        strategy="TimeSlicing", count=2, memory_bytes_per_share=3 * GIB, interval="Long"
    )


def test_first_matching_entry_wins_and_unmatched_gpus_stay_whole() -> None:
    shared_plan = plan(
        {"match": {"minor": 2}, "whole": True},
        {"match": {"product": "Tesla*"}, "timeSlicing": {"shares": 2, "memoryPerShare": "1Gi"}},
        {"match": {"all": True}, "mps": {"shares": 8}},
    )
    layout = resolve_layout(shared_plan, inventory_of(A100, T4, T4_NO_MEMORY), "p")
    assert set(layout) == {"GPU-t4-3", "GPU-a100-0"}  # T4 minor 2 is whole by the first entry
    assert layout["GPU-t4-3"].strategy == "TimeSlicing"
    assert layout["GPU-a100-0"].strategy == "MPS"


def test_product_glob_is_case_sensitive() -> None:
    assert resolve_layout(plan({"match": {"product": "nvidia a100*"}, "mps": {"shares": 2}}), inventory_of(A100),
                          "p") == {}


def test_empty_plan_publishes_everything_whole() -> None:
    assert resolve_layout(SharingPlan(), inventory_of(A100, T4), None) == {}


def test_mig_enabled_gpu_matched_as_whole_is_fine() -> None:
    assert resolve_layout(plan({"match": {"minor": 1}, "whole": True}), inventory_of(A100_MIG), "p") == {}


@pytest.mark.parametrize(("form", "strategy"), [("mps", "MPS"), ("timeSlicing", "time slicing")])
def test_sharing_a_mig_enabled_gpu_named_by_minor_is_an_error(form: str, strategy: str) -> None:
    with pytest.raises(PlanError) as info:
        resolve_layout(plan({"match": {"minor": 1}, form: {"shares": 2}}), inventory_of(A100, A100_MIG), "a100")
    assert str(info.value).startswith(
        "plans.a100.gpus[0] (GPU minor 1, GPU-a100-1, NVIDIA A100-SXM4-40GB): "
        f"{strategy} sharing is not possible on a MIG-enabled GPU"
    )


@pytest.mark.parametrize(
    ("form", "expected"),
    [
        ({"mps": {"shares": 4, "pinnedMemoryLimit": "11Gi"}}, "4 shares x mps.pinnedMemoryLimit 11264 MiB is more"),
        ({"timeSlicing": {"shares": 2, "memoryPerShare": "21Gi"}}, "2 shares x timeSlicing.memoryPerShare 21504 MiB"),
        ({"mps": {"shares": 2, "pinnedMemoryLimit": "1000Ki"}}, "mps.pinnedMemoryLimit is less than 1 MiB"),
        ({"timeSlicing": {"shares": 2, "memoryPerShare": 0}}, "timeSlicing.memoryPerShare must be more than 0"),
    ],
)
def test_memory_errors_name_entry_and_gpu(form: dict[str, Any], expected: str) -> None:
    with pytest.raises(PlanError) as info:
        resolve_layout(plan({"match": {"minor": 0}, **form}), inventory_of(A100), "p")
    prefix = "plans.p.gpus[0] (GPU minor 0, GPU-a100-0, NVIDIA A100-SXM4-40GB): "
    assert str(info.value).startswith(prefix + expected)


@pytest.mark.parametrize(
    ("form", "field"),
    [({"mps": {"shares": 2}}, "mps.pinnedMemoryLimit"), ({"timeSlicing": {"shares": 2}}, "memoryPerShare")],
)
def test_gpu_without_known_memory_needs_an_explicit_value(form: dict[str, Any], field: str) -> None:
    with pytest.raises(PlanError) as info:
        resolve_layout(plan({"match": {"minor": 3}, **form}), inventory_of(T4_NO_MEMORY), "p")
    message = str(info.value)
    assert message.startswith("plans.p.gpus[0] (GPU minor 3, GPU-t4-3, Tesla T4): the GPU's memory size is unknown")
    assert field in message


def test_gpu_too_small_for_the_default_share_is_an_error() -> None:
    tiny = GpuInfo(minor=5, index=5, uuid="GPU-tiny", product_name="Tiny", memory_bytes=3 * MIB)
    with pytest.raises(PlanError, match=r"gpus\[0\] \(GPU minor 5, GPU-tiny, Tiny\): .* less than 1 MiB to each of 4"):
        resolve_layout(plan({"match": {"all": True}, "mps": {"shares": 4}}), inventory_of(tiny), "p")


def test_gpu_without_known_memory_accepts_an_explicit_value() -> None:
    layout = resolve_layout(
        plan({"match": {"minor": 3}, "mps": {"shares": 2, "pinnedMemoryLimit": "4Gi"}}), inventory_of(T4_NO_MEMORY), "p"
    )
    assert layout["GPU-t4-3"].memory_bytes_per_share == 4 * GIB


def test_errors_for_several_gpus_are_all_reported() -> None:
    with pytest.raises(PlanError) as info:
        resolve_layout(plan({"match": {"product": "*"}, "mps": {"shares": 2}},
                            {"match": {"migProfile": "*"},
                             "mps": {"shares": 40}}), inventory_of(A100_MIG, T4_NO_MEMORY), "p")
    assert len(str(info.value).splitlines()) == 2


def test_entries_matching_no_gpu_are_listed() -> None:
    shared_plan = plan(
        {"match": {"product": "NVIDIA H100*"}, "mps": {"shares": 2}},
        {"match": {"minor": 0}, "whole": True},
        {"match": {"uuid": "GPU-gone"}, "whole": True},
    )
    assert entries_matching_no_gpu(shared_plan, inventory_of(A100), "p") == [
        "plans.p.gpus[0] (match product: NVIDIA H100*)",
        "plans.p.gpus[2] (match uuid: GPU-gone)",
    ]
    # Matching no GPU is not an error for resolution.
    assert resolve_layout(shared_plan, inventory_of(A100), "p") == {}


def test_one_problem_on_many_gpus_of_an_entry_is_one_line_naming_them_all() -> None:
    second = A100.model_copy(update={"minor": 4, "index": 4, "uuid": "GPU-a100-4"})
    with pytest.raises(PlanError) as info:
        resolve_layout(plan({"match": {"all": True}, "mps": {"shares": 4, "pinnedMemoryLimit": "11Gi"}}),
                       inventory_of(A100, second, T4), "p")
    lines = str(info.value).splitlines()
    assert lines[0] == ("plans.p.gpus[0] (2 GPUs, minors 0, 4, NVIDIA A100-SXM4-40GB): 4 shares x "
                        "mps.pinnedMemoryLimit 11264 MiB is more than the GPU's 40960 MiB; lower "
                        "mps.pinnedMemoryLimit or the number of shares")
    assert len(lines) == 2 and lines[1].startswith("plans.p.gpus[0] (GPU minor 2, GPU-t4-2, Tesla T4): ")


@pytest.mark.parametrize("match", [{"all": True}, {"product": "NVIDIA A100*"}])
@pytest.mark.parametrize("form", ["mps", "timeSlicing"])
def test_an_entry_for_a_family_of_gpus_splits_the_others_and_passes_over_a_mig_enabled_one(
        match: dict[str, Any], form: str) -> None:
    resolved = resolve_plan(plan({"match": match, form: {"shares": 2}}), inventory_of(A100, A100_MIG), "p")
    assert set(resolved.layout) == {"GPU-a100-0"}, "the MIG GPU is published as its MIG devices"
    assert resolved.notes["GPU-a100-1"].startswith("plans.p.gpus[0] (match ")
    assert "does not split a MIG-enabled GPU: its MIG instances are published" in resolved.notes["GPU-a100-1"]
