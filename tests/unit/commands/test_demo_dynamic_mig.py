"""``python -m driver demo --dynamic-mig``: its options, the plan its node gets, and the claims it makes from
the dynamic MIG example, placed by the allocator stand-in as the demo promises (pure parts; the run itself is
in tests/integration/test_demo_dynamic_mig.py)."""

from __future__ import annotations

from typing import Any

import pytest

from driver.commands.demo.args import EXAMPLES_DIR, parse_options
from driver.commands.demo.mig import FULL, MIX, claim_for, dynamic_mig_plan, template
from driver.config import DEFAULT_DRIVER_NAME
from driver.gpu.published.devices import make_view
from driver.gpu.published.sharingplan import SharingPlans, resolve_layout
from driver.simulation.allocator import AllocationError, allocate, claim_from_template
from driver.simulation.discovery import SimulatedDiscovery, available_layouts

LAYOUTS = available_layouts()


def test_the_flag_picks_the_dynamic_mig_layout_and_no_other_examples() -> None:
    options = parse_options(["--dynamic-mig"], LAYOUTS)
    assert options.dynamic_mig and options.layout == "dynamic-mig" and options.examples == ()
    options = parse_options(["--dynamic-mig", "--layout", "dgx-h100", "--example", "gpu-whole.yaml"], LAYOUTS)
    assert options.layout == "dgx-h100" and options.examples == (EXAMPLES_DIR / "gpu-whole.yaml",)
    assert not parse_options([], LAYOUTS).dynamic_mig


def test_the_plan_makes_every_mig_gpu_without_instances_dynamic() -> None:
    plan, text = dynamic_mig_plan(SimulatedDiscovery("dynamic-mig", "demo-node").discover())
    assert plan["plans"]["demo"] == {"gpus": [{"match": {"minor": 0}, "dynamicMig": {}}]}
    assert text.startswith("gpu-0 (NVIDIA H100 80GB HBM3) dynamic MIG")
    plan, text = dynamic_mig_plan(SimulatedDiscovery("demo", "demo-node").discover())  # its MIG GPU has instances
    assert plan["plans"]["demo"] == {"gpus": []} and "try --layout dynamic-mig" in text


def test_claims_change_only_the_examples_profile() -> None:
    base = template()
    doc = claim_for(base, "2g.20gb", "b")
    assert doc["metadata"]["name"] == "mig-dynamic-2g20gb-b"
    [request] = doc["spec"]["spec"]["devices"]["requests"]
    assert request["exactly"]["selectors"][0]["cel"]["expression"] == \
        "device.attributes['gpu.tessera.dev'].profile == '2g.20gb'"
    assert base["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]["expression"].endswith(
        "'3g.40gb'"), "the template itself is left as it is"


def _slices() -> list[dict[str, Any]]:
    inventory = SimulatedDiscovery("dynamic-mig", "demo-node").discover()
    plan, _ = dynamic_mig_plan(inventory)
    layout = resolve_layout(SharingPlans.model_validate(plan).plans["demo"], inventory, "demo")
    view = make_view(inventory, layout)
    return [{"spec": {"driver": DEFAULT_DRIVER_NAME, "pool": {"name": "demo-node"},
                      "devices": [d.to_wire() for d in view.devices],
                      "sharedCounters": [c.to_wire() for c in view.counter_sets]}}]


def test_the_mix_fits_side_by_side_and_the_full_gpu_only_after_it() -> None:
    slices, taken = _slices(), set[str]()
    for index, profile in enumerate(MIX):
        allocate(claim_from_template(claim_for(template(), profile, "abc"[index]), "c"), slices, DEFAULT_DRIVER_NAME,
                 taken)
    assert taken == {"gpu-0-dynmig-2g20gb-0", "gpu-0-dynmig-2g20gb-2", "gpu-0-dynmig-3g40gb-4"}
    with pytest.raises(AllocationError):
        allocate(claim_from_template(claim_for(template(), FULL, "a"), "c"), slices, DEFAULT_DRIVER_NAME, taken)
    allocate(claim_from_template(claim_for(template(), FULL, "a"), "c"), slices, DEFAULT_DRIVER_NAME, set())
