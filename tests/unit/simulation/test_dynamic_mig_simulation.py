"""SIMULATION for dynamic MIG prepare: the simulated NVML keeps the host tree's /proc capability files and
/dev/nvidia-caps nodes as the NVIDIA driver does (created with an instance, gone with it, back to the layout's
after a reboot), its injected hangs, and what the driver side reads of a node: a checkpoint rebuilt from CDI
specs keeps a claim's instance, ``check-node`` and ``inspect`` say which instances are Tessera's."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from driver.commands.checknode.mig import dynamic_mig_checks
from driver.commands.inspect import build_report, render_text
from driver.config import Settings
from driver.gpu.claim.rebuild import rebuild_checkpoint
from driver.gpu.runtime.mig import MigCreateError
from driver.kubeletplugin.types import Deadline
from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.hostroot import build_host_root, capability_minors
from driver.simulation.migengine import SimulatedMigHost, SimulatedMigPartitioner
from driver.simulation.migstate import Fault
from tests.support.dynamicmignode import DynamicMigNode
from tests.support.statenode import claim

CAPS = "proc/driver/nvidia/capabilities"


def engine_on(host: Path, state: Path, layout: str = "dynamic-mig") -> SimulatedMigPartitioner:
    return SimulatedMigPartitioner.for_layout(layout, "node-a", state, host=SimulatedMigHost(host))


def test_created_and_destroyed_instances_come_and_go_in_proc_and_dev(tmp_path: Path) -> None:
    inventory = SimulatedDiscovery("dynamic-mig", "node-a").discover()
    build_host_root(tmp_path / "host", inventory)
    engine = engine_on(tmp_path / "host", tmp_path / "mig.json")
    gpu = inventory.gpus[0]
    profiles = {p.name: p for p in gpu.mig_profiles}
    made = engine.create(gpu.uuid, profiles["2g.20gb"], 2)
    gi_minor, ci_minor = capability_minors(0, made.gi_id, made.ci_id)
    access = tmp_path / "host" / CAPS / "gpu0" / "mig" / f"gi{made.gi_id}"
    assert f"DeviceFileMinor: {gi_minor}" in (access / "access").read_text()
    assert f"DeviceFileMinor: {ci_minor}" in (access / "ci0" / "access").read_text()
    # The kernel module makes no capability node (nvidia-modprobe does, on demand): neither does the simulation.
    assert not list((tmp_path / "host" / "dev" / "nvidia-caps").glob("*"))
    engine.destroy(gpu.uuid, made.gi_id, made.ci_id)
    assert not (tmp_path / "host" / CAPS / "gpu0" / "mig").exists() or not any(
        (tmp_path / "host" / CAPS / "gpu0" / "mig").iterdir())


def test_a_create_or_destroy_touches_only_its_own_instances_files(tmp_path: Path) -> None:
    inventory = SimulatedDiscovery("dynamic-mig-2", "node-a").discover()
    build_host_root(tmp_path / "host", inventory)
    engine = engine_on(tmp_path / "host", tmp_path / "mig.json", "dynamic-mig-2")
    first, second = inventory.gpus[0], inventory.gpus[1]
    one_g = {g.uuid: next(p for p in g.mig_profiles if p.name == "1g.10gb")
             for g in (first, second)}
    kept = engine.create(second.uuid, one_g[second.uuid], 0)
    kept_file = tmp_path / "host" / CAPS / f"gpu{second.minor}" / "mig" / f"gi{kept.gi_id}" / "ci0" / "access"
    own = engine.create(first.uuid, one_g[first.uuid], 1)
    neighbour = engine.create(first.uuid, one_g[first.uuid], 2)
    inodes = {path: path.stat().st_ino for path in (tmp_path / "host" / CAPS).rglob("access")}
    engine.destroy(first.uuid, own.gi_id, own.ci_id)
    engine.create(second.uuid, one_g[second.uuid], 1)
    after = {path: path.stat().st_ino for path in (tmp_path / "host" / CAPS).rglob("access")}
    gone = {p for p in inodes if f"gpu{first.minor}/mig/gi{own.gi_id}/" in str(p)}
    assert len(gone) == 2 and not gone & set(after)
    assert {p: i for p, i in after.items() if p in inodes} == {p: i for p, i in inodes.items() if p not in gone}, \
        "every other instance's files are the same files, never rewritten"
    assert kept_file in after and neighbour.gi_id != own.gi_id


def test_a_reboot_leaves_only_the_layouts_instances_in_the_tree(tmp_path: Path) -> None:
    inventory = SimulatedDiscovery("demo", "node-a").discover()
    build_host_root(tmp_path / "host", inventory)
    before = sorted(str(p.relative_to(tmp_path / "host")) for p in (tmp_path / "host" / CAPS).rglob("access"))
    engine = engine_on(tmp_path / "host", tmp_path / "mig.json", "demo")
    gpu = inventory.gpus[1]  # the demo's MIG GPU: 3g.40gb@0, 2g.20gb@4, 1g.10gb@6 (the layout's)
    for mig in gpu.mig_instances:
        engine.destroy(gpu.uuid, mig.gi_id, mig.ci_id)
    assert not list((tmp_path / "host" / CAPS).glob("gpu*/mig/**/access"))
    engine.reboot()
    assert sorted(str(p.relative_to(tmp_path / "host")) for p in (tmp_path / "host" / CAPS).rglob("access")) == before


def test_a_tree_without_the_simulation_marker_is_never_written(tmp_path: Path) -> None:
    engine = engine_on(tmp_path / "not-simulated", tmp_path / "mig.json")
    gpu = SimulatedDiscovery("dynamic-mig", "node-a").discover().gpus[0]
    engine.create(gpu.uuid, gpu.mig_profiles[-1], 0)
    assert not (tmp_path / "not-simulated").exists()


def test_an_injected_hang_blocks_until_its_time_and_then_undoes_the_create(tmp_path: Path) -> None:
    engine = engine_on(tmp_path / "host", tmp_path / "mig.json")
    gpu = SimulatedDiscovery("dynamic-mig", "node-a").discover().gpus[0]
    one_g = next(p for p in gpu.mig_profiles if p.name == "1g.10gb")
    engine.inject_failure("create-ci", placement=3, effect="hang-after", seconds=30)
    seen: list[int] = []

    def create() -> None:
        with pytest.raises(MigCreateError, match="injected hang ended"):
            engine.create(gpu.uuid, one_g, 3, Deadline.after(0.5))

    worker = threading.Thread(target=create)
    worker.start()
    while worker.is_alive():  # the instance exists while the create hangs, as NVML's would before it returns
        seen.extend(m.placement_start for m in engine.instances(gpu.uuid))
        time.sleep(0.01)
    assert 3 in seen and engine.instances(gpu.uuid) == [], "ended by the caller's deadline, what it made destroyed"


def test_only_creates_can_hang() -> None:
    with pytest.raises(ValueError, match="only creates can hang"):
        Fault(call="destroy-gi", effect="hang")


def test_a_rebuilt_checkpoint_keeps_the_claims_instance(tmp_path: Path) -> None:
    mig_node = DynamicMigNode(tmp_path)
    state = mig_node.state()
    state.prepare(claim("u1", "gpu-0-dynmig-3g40gb-4"))
    [before] = state.prepared_claims()
    rebuilt = rebuild_checkpoint(mig_node.paths.cdi_root, state.names, "node-a", "now")
    [dev] = rebuilt.claims["u1"].devices
    assert dev.dynamic_mig == before.devices[0].dynamic_mig and dev.mig_gi_id == before.devices[0].mig_gi_id
    assert rebuilt.layout == {mig_node.gpu().uuid: mig_node.layout()[mig_node.gpu().uuid]}, "its GPU stays dynamic"
    assert rebuilt.claims["u1"].exclusive_gpus == []


def test_check_node_says_which_mig_gpus_dynamic_mig_can_serve(tmp_path: Path) -> None:
    mig_node = DynamicMigNode(tmp_path)
    state = mig_node.state()
    state.prepare(claim("u1", "gpu-0-dynmig-3g40gb-4"))
    settings = Settings(plugins_dir=mig_node.paths.state_dir.parent)
    (mig_node.paths.state_dir.parent / "gpu.tessera.dev").mkdir(exist_ok=True)
    (mig_node.paths.state_dir.parent / "gpu.tessera.dev" / "checkpoint.json").write_bytes(
        (mig_node.paths.state_dir / "checkpoint.json").read_bytes())
    lines = {r.check: r.detail for r in dynamic_mig_checks(settings, mig_node.inventory())}
    assert set(lines) == {"dynamic MIG GPU 0", "dynamic MIG GPU 1"}, "the L4 has no MIG"
    assert "no instances Tessera did not create; 1 instance(s) created by Tessera" in lines["dynamic MIG GPU 0"]
    assert "MIG mode is off" in lines["dynamic MIG GPU 1"]
    profiles = {p.name: p for p in mig_node.gpu().mig_profiles}
    mig_node.engine.create(mig_node.gpu().uuid, profiles["1g.10gb"], 0)
    lines = {r.check: r.detail for r in dynamic_mig_checks(settings, mig_node.inventory())}
    assert "has MIG instances Tessera did not create (1g.10gb@0)" in lines["dynamic MIG GPU 0"]


def test_inspect_shows_each_claims_created_instance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mig_node = DynamicMigNode(tmp_path)
    state = mig_node.state()
    state.prepare(claim("u1", "gpu-0-dynmig-3g40gb-4"))
    [made] = mig_node.engine.instances(mig_node.gpu().uuid)
    monkeypatch.setenv("TESSERA_SIM_MIG_STATE", str(mig_node.mig_state))
    settings = Settings(plugins_dir=tmp_path, simulate="dynamic-mig", node_name="node-a", host_root=mig_node.host,
                        driver_root=mig_node.host, cdi_root=mig_node.paths.cdi_root)
    (tmp_path / "gpu.tessera.dev").symlink_to(mig_node.paths.state_dir)
    report = build_report(settings)
    [dev] = report["claims"][0]["devices"]
    assert dev["dynamic_mig"] == {"gpu": mig_node.gpu().uuid, "gpu_minor": 0, "profile": "3g.40gb",
                                  "placement_start": 4,
                                  "placement_size": 4, "gi_id": made.gi_id, "ci_id": 0, "mig_uuid": made.uuid,
                                  "state": "created"}
    [gpu0] = [g for g in report["gpus"] if g["minor"] == 0]
    assert gpu0["mig_instances"][0]["claim"] == "default/claim-u1"
    text = render_text(report)
    assert (f"MIG instance created by Tessera: 3g.40gb at placement 4 (memory slices 4-7) on GPU 0 GI {made.gi_id} "
            f"CI 0 {made.uuid}") in text
    assert "(created by Tessera for claim default/claim-u1)" in text
