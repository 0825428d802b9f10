"""SIMULATION: simulated GPU models, layouts and the simulated Discovery."""

from __future__ import annotations

from pathlib import Path

import pytest

from driver.gpu.discovery.migprofiles import profile_name
from driver.gpu.published.devices import make_view
from driver.simulation.discovery import (
    SIMULATED_CUDA_DRIVER_VERSION,
    SIMULATED_DRIVER_VERSION,
    SimulatedDiscovery,
    available_layouts,
    simulated_pci_bus_id,
)
from driver.simulation.gpus import SimulationError, gpu_model, gpu_models
from driver.units import GIB


def write_layout(tmp_path: Path, body: str) -> str:
    path = tmp_path / "node.yaml"
    path.write_text(body)
    return str(path)


def test_models_and_their_mig_tables() -> None:
    models = gpu_models()
    assert sorted(models) == ["A100-40GB", "A100-80GB", "H100-80GB", "H200", "L4"]
    l4 = models["L4"]
    assert (l4.product_name, l4.architecture, l4.compute_capability, l4.multiprocessors) == (
        "NVIDIA L4",
        "Ada Lovelace",
        "8.9",
        58,
    )
    assert l4.mig_profiles == ()
    assert 22 * GIB < l4.memory_bytes <= 24 * GIB
    assert models["A100-40GB"].product_name == "NVIDIA A100-SXM4-40GB"
    assert models["H200"].profile("3g.71gb") is not None
    assert [p.gi_profile_id for p in models["H100-80GB"].mig_profiles] == [19, 20, 15, 14, 9, 5, 0]


def test_every_simulated_profile_name_follows_the_naming_rule() -> None:
    # The table's names and the simulated memory totals must agree, or the simulation would
    # publish names real hardware never shows.
    for model in gpu_models().values():
        for spec in model.mig_profiles:
            computed = profile_name(
                spec.compute_slices, spec.compute_slices, spec.memory_mib, model.memory_bytes, spec.gi_enum
            )
            assert computed == spec.name, model.name


def test_unknown_model_is_named_in_the_error() -> None:
    with pytest.raises(SimulationError, match=r"unknown simulated GPU model 'V100'.*H100-80GB"):
        gpu_model("V100")


def test_available_layouts() -> None:
    assert {"demo", "dgx-h100", "h200-mig", "a100-80gb", "l4"} <= set(available_layouts())


@pytest.mark.parametrize("layout", ["demo", "dgx-h100", "h200-mig", "a100-80gb", "l4"])
def test_every_builtin_layout_loads_and_publishes(layout: str) -> None:
    inventory = SimulatedDiscovery(layout, "node-a").discover()
    assert inventory.gpus
    assert make_view(inventory, {}).devices


def test_demo_node() -> None:
    inventory = SimulatedDiscovery("demo", "node-a").discover()
    assert inventory.driver_version == SIMULATED_DRIVER_VERSION == "580.95.05"
    assert inventory.cuda_driver_version == SIMULATED_CUDA_DRIVER_VERSION == "13.0"
    h100, mig_h100, l4 = inventory.gpus
    assert [g.minor for g in inventory.gpus] == [0, 1, 2]
    assert (h100.product_name, h100.mig_capable, h100.mig_enabled) == ("NVIDIA H100 80GB HBM3", True, False)
    assert (l4.mig_capable, l4.mig_enabled) == (False, False)
    assert mig_h100.mig_enabled
    assert [(m.profile, m.placement_start, m.placement_size) for m in mig_h100.mig_instances] == [
        ("3g.40gb", 0, 4),
        ("2g.20gb", 4, 2),
        ("1g.10gb", 6, 1),
    ]
    assert [m.gi_profile_id for m in mig_h100.mig_instances] == [9, 14, 19]
    assert len({m.gi_id for m in mig_h100.mig_instances}) == 3
    assert all(m.uuid.startswith("MIG-") for m in mig_h100.mig_instances)
    names = [d.name for d in make_view(inventory, {}).devices]
    assert names == ["gpu-0", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6", "gpu-2"]


def test_identities_are_deterministic_per_node() -> None:
    first = SimulatedDiscovery("demo", "node-a").discover()
    again = SimulatedDiscovery("demo", "node-a").discover()
    other = SimulatedDiscovery("demo", "node-b").discover()
    assert first == again
    assert [g.uuid for g in first.gpus] != [g.uuid for g in other.gpus]
    uuids = [g.uuid for g in first.gpus] + [m.uuid for g in first.gpus for m in g.mig_instances]
    assert len(set(uuids)) == len(uuids)
    assert all(g.uuid.startswith("GPU-") for g in first.gpus)


def test_pci_addresses_are_distinct_and_well_formed() -> None:
    inventory = SimulatedDiscovery("dgx-h100", "node-a").discover()
    bus_ids = [g.pci_bus_id for g in inventory.gpus]
    assert len(set(bus_ids)) == 8
    assert simulated_pci_bus_id(0) == ("0000:18:00.0", "pci0000:17")
    assert simulated_pci_bus_id(9)[0].startswith("0001:")


def test_layout_from_file_and_empty_mig(tmp_path: Path) -> None:
    path = write_layout(tmp_path, "gpus:\n  - model: H100-80GB\n    mig: []\n  - model: L4\n")
    inventory = SimulatedDiscovery(path, "node-a").discover()
    assert inventory.gpus[0].mig_enabled and inventory.gpus[0].mig_instances == ()
    assert [d.name for d in make_view(inventory, {}).devices] == ["gpu-1"]


def test_close_is_harmless() -> None:
    discovery = SimulatedDiscovery("l4", "node-a")
    discovery.close()
    assert discovery.discover().gpus[0].product_name == "NVIDIA L4"


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ("gpus:\n  - model: V100\n", r"gpu 0 \(V100\): unknown GPU model"),
        ("gpus:\n  - model: L4\n    mig: []\n", r"gpu 0 \(L4\): model L4 does not support MIG"),
        (
            "gpus:\n  - model: H100-80GB\n  - model: H100-80GB\n    mig: [{profile: 5g.50gb, start: 0}]\n",
            r"gpu 1 \(H100-80GB\) mig\[0\] \(5g.50gb@0\): H100-80GB has no MIG profile '5g.50gb'",
        ),
        (
            "gpus:\n  - model: A100-40GB\n    mig: [{profile: 3g.20gb, start: 2}]\n",
            r"mig\[0\] \(3g.20gb@2\): 3g.20gb cannot start at 2; valid starts: 0, 4",
        ),
        (
            "gpus:\n  - model: A100-40GB\n    mig: [{profile: 3g.20gb, start: 0}, {profile: 2g.10gb, start: 2}]\n",
            r"mig\[1\] \(2g.10gb@2\): overlaps mig\[0\] \(3g.20gb@0\) on memory slice 2",
        ),
        (
            "gpus:\n  - model: H100-80GB\n    mig: [{profile: 1g.10gb+me, start: 0}, "
            "{profile: 1g.10gb+me, start: 1}]\n",
            r"mig\[1\] \(1g.10gb\+me@1\): H100-80GB allows at most 1 x 1g.10gb\+me",
        ),
        ("gpus:\n  - model: L4\n    memory: 3\n", r"not a valid simulated node"),
        ("gpus:\n  - model: H200\n    mig: [{profile: 1g.18gb, start: -1}]\n", r"not a valid simulated node"),
        ("gpus: [\n", r"cannot read it as YAML"),
    ],
)
def test_bad_layouts_are_rejected_naming_the_entry(tmp_path: Path, body: str, message: str) -> None:
    path = write_layout(tmp_path, body)
    with pytest.raises(SimulationError, match=message):
        SimulatedDiscovery(path, "node-a")


def test_a_fully_packed_gpu_is_accepted(tmp_path: Path) -> None:
    body = "gpus:\n  - model: H100-80GB\n    mig: [{profile: 3g.40gb, start: 4}, {profile: 4g.40gb, start: 0}]\n"
    [gpu] = SimulatedDiscovery(write_layout(tmp_path, body), "node-a").discover().gpus
    assert [(m.profile, m.placement_start) for m in gpu.mig_instances] == [("4g.40gb", 0), ("3g.40gb", 4)]
    assert sum(m.placement_size for m in gpu.mig_instances) == 8


def test_unknown_layout_name() -> None:
    with pytest.raises(SimulationError, match=r"unknown simulated layout 'nope'.*demo"):
        SimulatedDiscovery("nope", "node-a")
