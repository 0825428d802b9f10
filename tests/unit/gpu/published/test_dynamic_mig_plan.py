"""The sharing-plan entry dynamicMig: syntax and one-line errors, which GPUs get the dynamic form and why
the others do not (logged once, never an empty slice), own instances, check-plan's view of it."""

from __future__ import annotations

import logging
import textwrap
from collections.abc import Sequence
from pathlib import Path

import pytest
import yaml

from driver.cli import main
from driver.commands.run.plansource import PlanSource
from driver.config import Settings
from driver.gpu.discovery.inventory import GpuInfo
from driver.gpu.published.planuse import plan_use, render_plan
from driver.gpu.published.sharelayout import DynamicMigPolicy
from driver.gpu.published.sharingplan import PlanError, SharingPlan, SharingPlans, load_plans, resolve_plan
from tests.support.mig import h100, instance, inventory_of, l4

ALL_H100 = ("1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb")  # table order


def plan_of(entry: str, match: str = "{all: true}") -> SharingPlan:
    text = f"plans:\n  p:\n    gpus:\n    - match: {match}\n" + textwrap.indent(entry, "      ") + "\n"
    return SharingPlans.model_validate(yaml.safe_load(text)).plans["p"]


def plan_error(tmp_path: Path, entry: str) -> str:
    path = tmp_path / "plans.yaml"
    path.write_text("plans:\n  p:\n    gpus:\n    - match: {all: true}\n" + textwrap.indent(entry, "      ") + "\n")
    with pytest.raises(PlanError) as info:
        load_plans(path)
    return str(info.value).replace(f"{path}: ", "")


# --- syntax ------------------------------------------------------------------------------------


def test_defaults_and_fields() -> None:
    entry = plan_of("dynamicMig: {}").gpus[0].dynamicMig
    assert entry is not None and entry.profiles is None and entry.alsoWholeGpu is True
    entry = plan_of("dynamicMig: {profiles: [1g.10gb, 3g.40gb], alsoWholeGpu: false}").gpus[0].dynamicMig
    assert entry is not None and entry.profiles == ["1g.10gb", "3g.40gb"] and entry.alsoWholeGpu is False
    assert SharingPlans().partitionableDevicesGate is False


@pytest.mark.parametrize(("entry", "expected"), [
    ("dynamicMig: {profiles: [1g.10gb, 3g40gb]}",
     'plans.p.gpus[0].dynamicMig.profiles[1]: "3g40gb" is not a MIG profile name (e.g. 1g.10gb, 3g.40gb, 1g.10gb+me)'),
    ("dynamicMig: {profiles: []}",
     "plans.p.gpus[0].dynamicMig.profiles: an empty list allows no profile; leave profiles out to allow every profile"),
    ("dynamicMig: {profiles: [1g.10gb, 1g.10gb]}",
     "plans.p.gpus[0].dynamicMig.profiles: 1g.10gb listed more than once"),
    ("dynamicMig: {alsoWholeGpu: yes please}", "plans.p.gpus[0].dynamicMig.alsoWholeGpu: expected true or false"),
    ("dynamicMig: {profile: [1g.10gb]}",
     'plans.p.gpus[0].dynamicMig: unknown field "profile" (known fields: profiles, alsoWholeGpu)'),
    ("dynamicMig: {}\nwhole: true",
     "plans.p.gpus[0]: set exactly one of mps, timeSlicing, consumable, dynamicMig, whole: true (got dynamicMig, "
     "whole)"),
    ("dynamicMig: {}\nallowMultipleSharesPerClaim: true",
     "plans.p.gpus[0]: allowMultipleSharesPerClaim applies only to mps or timeSlicing entries"),
])
def test_errors_are_one_line_naming_the_field(tmp_path: Path, entry: str, expected: str) -> None:
    message = plan_error(tmp_path, entry)
    assert len(message.splitlines()) == 1
    assert message.startswith(expected), message


def test_the_gate_is_a_top_level_key(tmp_path: Path) -> None:
    path = tmp_path / "plans.yaml"
    path.write_text("partitionableDevicesGate: true\nplans: {}\n")
    assert load_plans(path).partitionableDevicesGate is True


# --- resolution --------------------------------------------------------------------------------


def test_a_mig_gpu_without_instances_is_dynamic_with_every_profile_by_default() -> None:
    gpu = h100(0)
    resolved = resolve_plan(plan_of("dynamicMig: {}"), inventory_of(gpu), "p")
    shares = resolved.layout[gpu.uuid]
    assert shares.strategy == "DynamicMig" and shares.dynamic_mig == DynamicMigPolicy(profiles=ALL_H100)
    assert resolved.notes == {}


def test_allowed_profiles_keep_the_gpus_order_and_the_whole_gpu_setting() -> None:
    gpu = h100(0)
    entry = "dynamicMig: {profiles: [3g.40gb, 1g.10gb], alsoWholeGpu: false}"
    policy = resolve_plan(plan_of(entry), inventory_of(gpu), "p").layout[gpu.uuid].dynamic_mig
    assert policy == DynamicMigPolicy(profiles=("1g.10gb", "3g.40gb"), also_whole_gpu=False)


def test_profiles_a_gpu_does_not_offer_are_reported_and_the_others_published() -> None:
    gpu = h100(0)
    resolved = resolve_plan(plan_of("dynamicMig: {profiles: [1g.5gb, 1g.10gb]}"), inventory_of(gpu), "p")
    assert resolved.layout[gpu.uuid].dynamic_mig == DynamicMigPolicy(profiles=("1g.10gb",))
    assert resolved.notes[gpu.uuid].startswith(
        "dynamicMig.profiles 1g.5gb not offered by this GPU (it offers 1g.10gb, ")


def test_no_allowed_profile_on_a_gpu_is_a_plan_error_naming_entry_and_gpu() -> None:
    with pytest.raises(PlanError) as info:
        resolve_plan(plan_of("dynamicMig: {profiles: [1g.5gb, 3g.20gb]}"), inventory_of(h100(0)), "p")
    assert str(info.value) == (
        "plans.p.gpus[0] (GPU minor 0, GPU-h100-0, NVIDIA H100 80GB HBM3): dynamicMig.profiles: none of 1g.5gb, "
        "3g.20gb is offered by this GPU; it offers 1g.10gb, 1g.10gb+me, 1g.20gb, 2g.20gb, 3g.40gb, 4g.40gb, 7g.80gb")


@pytest.mark.parametrize(("gpu", "note"), [
    (l4(0), "no MIG support, published as a whole GPU"),
    (h100(0, mig_enabled=False),
     "MIG mode is off (Tessera never changes it; an operator enables it with 'nvidia-smi -i GPU-h100-0 -mig 1'), "
     "published as a whole GPU"),
    (h100(0, instances=(instance("1g.10gb", 0, gi_id=1), instance("1g.10gb", 3, gi_id=2))),
     "has MIG instances Tessera did not create (1g.10gb@0, 1g.10gb@3), published as those MIG devices"),
    (h100(0, table=()), "NVML lists no MIG profiles for it; no devices for it until MIG instances are created"),
    (h100(0, memory_bytes=None), "its memory size or a profile spanning all 8 memory slices is unknown"),
])
def test_gpus_that_cannot_be_dynamic_keep_their_form_and_say_why(gpu: GpuInfo, note: str) -> None:
    resolved = resolve_plan(plan_of("dynamicMig: {}"), inventory_of(gpu), "p")
    assert resolved.layout == {}
    assert resolved.notes[gpu.uuid].startswith(note)


def test_a_server_without_partitionable_devices_gets_no_placements() -> None:
    gpu = h100(0)
    resolved = resolve_plan(plan_of("dynamicMig: {}"), inventory_of(gpu), "p", partitionable_supported=False)
    assert resolved.layout == {}
    assert "the API server does not keep partitionable devices" in resolved.notes[gpu.uuid]


def test_instances_tessera_created_keep_the_gpu_dynamic() -> None:
    gpu = h100(0, instances=(instance("3g.40gb", 4, gi_id=5, size=4),))
    entry = plan_of("dynamicMig: {}")
    assert resolve_plan(entry, inventory_of(gpu), "p").layout == {}
    resolved = resolve_plan(entry, inventory_of(gpu), "p", own_instances={(gpu.uuid, 5)})
    assert resolved.layout[gpu.uuid].strategy == "DynamicMig" and resolved.notes == {}


def test_time_slicing_and_mps_on_a_mig_gpu_are_still_refused() -> None:
    for entry in ("mps: {shares: 2}", "timeSlicing: {shares: 2}"):
        with pytest.raises(PlanError, match="not possible on a MIG-enabled GPU"):
            resolve_plan(plan_of(entry, match="{minor: 0}"), inventory_of(h100(0)), "p")


def test_a_product_match_makes_only_the_h100s_dynamic_and_the_l4_says_nothing() -> None:
    gpus = inventory_of(h100(0), l4(1))
    resolved = resolve_plan(plan_of("dynamicMig: {}", match='{product: "NVIDIA H100*"}'), gpus, "p")
    assert list(resolved.layout) == ["GPU-h100-0"] and resolved.notes == {}


# --- what is logged and shown ------------------------------------------------------------------


def test_the_reason_is_logged_once_per_gpu(caplog: pytest.LogCaptureFixture) -> None:
    gpus = inventory_of(h100(0), l4(1))
    plan = plan_of("dynamicMig: {profiles: [1g.10gb]}")
    resolved = resolve_plan(plan, gpus, "p")
    use = plan_use(plan, "p", Path("plans.yaml"), "test", gpus, resolved.layout, resolved.notes)
    source = PlanSource(Settings(), api=None)  # type: ignore[arg-type]  # _record never calls the API
    with caplog.at_level(logging.INFO, logger="driver.commands.run.plansource"):
        source._record(use)
        source._record(use)  # a rescan that changes nothing logs nothing
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == ["gpu-1 (NVIDIA L4): no MIG support, published as a whole GPU"]
    assert use.gpus[0].published == ("dynamic MIG: the whole GPU and 7 placements (1g.10gb x7), created at prepare; "
                                     "counter set gpu-0-counter-set (11 counters)")
    assert use.gpus[1].published == "whole (memory 23034Mi)"
    # inspect shows the same line under the GPUs of the plan in use
    assert render_plan({"sharing_plan": use.model_dump()})[-1] == (
        "  note: gpu-1 (NVIDIA L4): no MIG support, published as a whole GPU")


def run_cli(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        status = main(list(argv))
    except SystemExit as exc:
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err


def test_check_plan_shows_the_dynamic_gpus_and_the_reasons(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("driver.cli.os.umask", lambda mask: 0o022)
    layout = tmp_path / "layout.yaml"
    layout.write_text("gpus:\n- {model: H100-80GB, mig: []}\n- {model: L4}\n")
    plans = tmp_path / "plans.yaml"
    plans.write_text("defaultPlan: p\npartitionableDevicesGate: true\nplans:\n  p:\n    gpus:\n"
                     "    - match: {all: true}\n      dynamicMig: {profiles: [1g.10gb, 1g.5gb]}\n")
    status, out, err = run_cli(["check-plan", str(plans), "--simulate", str(layout)], capsys)
    assert status == 0 and err == "", err
    assert "partitionableDevicesGate true" in out
    assert "plans.p.gpus[0]: match all: True -> dynamicMig" in out
    assert "-> dynamic MIG: the whole GPU and 7 placements (1g.10gb x7)" in out
    assert ("NOTE: gpu-0 (NVIDIA H100 80GB HBM3): dynamicMig.profiles 1g.5gb not offered by this GPU" in out)
    assert "NOTE: gpu-1 (NVIDIA L4): no MIG support, published as a whole GPU" in out


# --- the chart -----------------------------------------------------------------------------------


def test_the_chart_renders_the_gate_and_a_dynamic_mig_plan_the_plugin_loads(tmp_path: Path) -> None:
    from deploy.render import render_objects

    values = {"sharing": {"partitionableDevicesGate": True, "defaultPlan": "mig", "plans": {"mig": {"gpus": [
        {"match": {"product": "NVIDIA H100*"}, "dynamicMig": {"profiles": ["1g.10gb", "3g.40gb"],
                                                              "alsoWholeGpu": False}}]}}}}
    [config_map] = [o for o in render_objects(values) if o.get("kind") == "ConfigMap"
                    and "plans.yaml" in (o.get("data") or {})]
    path = tmp_path / "plans.yaml"
    path.write_text(config_map["data"]["plans.yaml"])
    plans = load_plans(path)
    assert plans.partitionableDevicesGate is True
    entry = plans.plans["mig"].gpus[0].dynamicMig
    assert entry is not None and entry.profiles == ["1g.10gb", "3g.40gb"] and entry.alsoWholeGpu is False


def test_the_chart_schema_refuses_what_the_plugin_would() -> None:
    from deploy.render import render_objects

    for entry, where in (({"dynamicMig": {"profiles": ["3g40gb"]}}, "dynamicMig/profiles/0': '3g40gb' does not match"),
                         ({"dynamicMig": {}, "allowMultipleSharesPerClaim": True}, "'oneOf' failed"),
                         ({"dynamicMig": {"profile": ["1g.10gb"]}}, "additional properties 'profile' not allowed")):
        values = {"sharing": {"plans": {"p": {"gpus": [{"match": {"all": True}, **entry}]}}}}
        with pytest.raises(Exception, match="values don't meet the specifications") as refused:
            render_objects(values)
        assert where in str(refused.value)
