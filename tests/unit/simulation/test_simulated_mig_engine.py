"""SIMULATION: the simulated node's MIG partitioner keeps NVIDIA's placement rules and answers as NVML does.

Profiles come from what the simulated discovery reports for the GPU (``mig_profiles``), as the prepare path will
take them; refusals carry the reason ``mig.create_refusal_reason`` gives NVML's code for each case.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.synchronize
import random
import re
from pathlib import Path

import pytest

from driver.config import Settings
from driver.gpu.discovery.inventory import GpuInfo, MigInstance, MigProfileInfo
from driver.gpu.runtime.mig import CreatedMig, MigCreateError, MigError, MigGpuInstance, MigPartitioner, overlaps
from driver.nodelayout import open_mig_partitioner
from driver.simulation.discovery import SimulatedDiscovery, mig_profile_infos, simulated_gpu_uuid
from driver.simulation.gpus import mig_tables
from driver.simulation.migengine import SimulatedMigGpu, SimulatedMigPartitioner, simulated_mig_device_uuid
from driver.simulation.migstate import STATE_ENV, MigStateFile
from driver.units import MIB

NODE = "node-a"
MIG_GPU = simulated_gpu_uuid(NODE, 0)  # dynamic-mig: an H100 80GB in MIG mode, no instances
WHOLE_GPU = simulated_gpu_uuid(NODE, 1)  # an H100 80GB, MIG off
L4 = simulated_gpu_uuid(NODE, 2)
MIG_UUID = re.compile(r"^MIG-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "mig.json"


@pytest.fixture
def engine(state: Path) -> SimulatedMigPartitioner:
    # The real boot ID, as the simulated discovery reads the file with it.
    return SimulatedMigPartitioner.for_layout("dynamic-mig", NODE, state)


def gpu(state: Path, minor: int = 0, layout: str = "dynamic-mig") -> GpuInfo:
    inventory = SimulatedDiscovery(layout, NODE, mig_state=state).discover()
    found = inventory.gpu_by_minor(minor)
    assert found is not None
    return found


def profiles_of(state: Path, minor: int = 0, layout: str = "dynamic-mig") -> dict[str, MigProfileInfo]:
    return {p.name: p for p in gpu(state, minor, layout).mig_profiles}


def refusal(engine: SimulatedMigPartitioner, gpu_uuid: str, profile: MigProfileInfo, start: int) -> str:
    with pytest.raises(MigCreateError) as err:
        engine.create(gpu_uuid, profile, start)
    assert gpu_uuid in str(err.value) and profile.name in str(err.value) and f"placement {start}" in str(err.value)
    return err.value.reason


def placements(engine: SimulatedMigPartitioner, gpu_uuid: str = MIG_GPU) -> list[tuple[int, int]]:
    return [(m.placement_start, m.placement_size) for m in engine.instances(gpu_uuid)]


# ----------------------------------------------------------------------------------------------- H100 80GB


def test_seven_1g_fit_and_the_eighth_has_no_room(engine: SimulatedMigPartitioner, state: Path) -> None:
    one_g = profiles_of(state)["1g.10gb"]
    made = [engine.create(MIG_GPU, one_g, start) for start in range(7)]
    assert [m.placement_start for m in made] == list(range(7))
    assert len({m.uuid for m in made}) == 7 and all(MIG_UUID.match(m.uuid) for m in made)
    assert refusal(engine, MIG_GPU, one_g, 0) == "insufficient-resources"
    assert refusal(engine, MIG_GPU, one_g, 7) == "invalid"  # slice 7 is no 1g placement


def test_4g_and_3g_fill_the_gpu_and_a_second_4g_is_refused(engine: SimulatedMigPartitioner, state: Path) -> None:
    table = profiles_of(state)
    engine.create(MIG_GPU, table["4g.40gb"], 0)
    assert refusal(engine, MIG_GPU, table["3g.40gb"], 0) == "occupied"  # a 3g still fits, at 4
    engine.create(MIG_GPU, table["3g.40gb"], 4)
    assert refusal(engine, MIG_GPU, table["4g.40gb"], 0) in ("occupied", "insufficient-resources")
    assert refusal(engine, MIG_GPU, table["1g.10gb"], 6) == "insufficient-resources"  # all 7 compute slices used
    assert placements(engine) == [(0, 4), (4, 4)]


def test_a_placement_start_the_profile_does_not_allow_is_invalid(engine: SimulatedMigPartitioner,
                                                                 state: Path) -> None:
    table = profiles_of(state)
    assert refusal(engine, MIG_GPU, table["3g.40gb"], 2) == "invalid"
    assert refusal(engine, MIG_GPU, table["2g.20gb"], 6) == "invalid"
    wrong_size = table["2g.20gb"].model_copy(update={"memory_slices": 1})
    assert refusal(engine, MIG_GPU, wrong_size, 0) == "invalid"
    assert engine.instances(MIG_GPU) == []


def test_max_instances_per_profile_is_kept(engine: SimulatedMigPartitioner, state: Path) -> None:
    table = profiles_of(state)
    engine.create(MIG_GPU, table["1g.10gb+me"], 0)
    assert refusal(engine, MIG_GPU, table["1g.10gb+me"], 1) == "insufficient-resources"  # one +me per GPU
    engine.create(MIG_GPU, table["1g.10gb"], 1)


def test_gpus_not_in_mig_mode_and_unknown_gpus(engine: SimulatedMigPartitioner, state: Path) -> None:
    one_g = profiles_of(state)["1g.10gb"]
    unknown_profile = one_g.model_copy(update={"gi_profile_id": 42})
    assert refusal(engine, MIG_GPU, unknown_profile, 0) == "invalid"  # MIG on, but no such profile on an H100
    assert refusal(engine, WHOLE_GPU, one_g, 0) == "not-mig-mode"
    assert refusal(engine, L4, one_g, 0) == "not-mig-mode"
    assert refusal(engine, simulated_gpu_uuid("elsewhere", 0), one_g, 0) == "failed"
    assert engine.instances(WHOLE_GPU) == [] and engine.instances(L4) == []
    engine.destroy(WHOLE_GPU, 1, 0)  # MIG off: nothing to destroy
    with pytest.raises(MigError, match="Not Found"):
        engine.instances(simulated_gpu_uuid("elsewhere", 0))


def test_destroy_then_create_again_at_the_same_placement(engine: SimulatedMigPartitioner, state: Path) -> None:
    three_g = profiles_of(state)["3g.40gb"]
    first = engine.create(MIG_GPU, three_g, 4)
    engine.destroy(MIG_GPU, first.gi_id, first.ci_id)
    assert engine.instances(MIG_GPU) == []
    engine.destroy(MIG_GPU, first.gi_id, first.ci_id)  # gone already: done
    again = engine.create(MIG_GPU, three_g, 4)
    assert (again.placement_start, again.placement_size) == (4, 4)
    # By default a new instance gets a UUID of its own, even at the same ids and placement.
    assert (again.gi_id, again.ci_id) == (first.gi_id, first.ci_id)
    assert again.uuid != first.uuid
    assert again.uuid == simulated_mig_device_uuid(MIG_GPU, again.gi_id, again.ci_id, 2)


def test_with_name_derived_uuids_an_instance_made_again_at_the_same_ids_has_the_old_uuid(
        engine: SimulatedMigPartitioner, state: Path) -> None:
    engine.use_name_derived_uuids()
    three_g = profiles_of(state)["3g.40gb"]
    first = engine.create(MIG_GPU, three_g, 4)
    engine.destroy(MIG_GPU, first.gi_id, first.ci_id)
    again = engine.create(MIG_GPU, three_g, 4)
    assert (again.gi_id, again.ci_id, again.uuid) == (first.gi_id, first.ci_id, first.uuid)
    assert again.uuid == simulated_mig_device_uuid(MIG_GPU, first.gi_id, first.ci_id, None)
    # Another process on the same state file (the driver's) makes them the same way, also after a reboot.
    engine.reboot()
    other = SimulatedMigPartitioner.for_layout("dynamic-mig", NODE, state)
    assert other.create(MIG_GPU, three_g, 4).uuid == first.uuid


def test_a_gi_whose_ci_is_left_is_in_use(engine: SimulatedMigPartitioner, state: Path) -> None:
    made = engine.create(MIG_GPU, profiles_of(state)["2g.20gb"], 2)
    with pytest.raises(MigError, match=r"NVML error 19.*CI 0"):
        engine.destroy(MIG_GPU, made.gi_id, None)
    assert engine.instances(MIG_GPU) == [made]


def test_it_satisfies_the_protocol_and_nodelayout_picks_it_for_a_simulated_node(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STATE_ENV, str(tmp_path / "elsewhere.json"))
    opened: MigPartitioner = open_mig_partitioner(Settings(simulate="dynamic-mig", node_name=NODE,
                                                           driver_root=tmp_path))
    assert isinstance(opened, SimulatedMigPartitioner)
    assert opened.state_file.path == tmp_path / "elsewhere.json"
    monkeypatch.delenv(STATE_ENV)
    opened = open_mig_partitioner(Settings(simulate="dynamic-mig", driver_root=tmp_path))
    assert isinstance(opened, SimulatedMigPartitioner)
    assert opened.state_file.path == tmp_path / "var/lib/tessera-sim-mig.json"
    opened.close()


# ----------------------------------------------------------------------------------------------- other tables


def table_gpu(key: str) -> tuple[SimulatedMigGpu, dict[str, MigProfileInfo]]:
    table = mig_tables()[key]
    return (SimulatedMigGpu(uuid="GPU-" + key, mig_enabled=True, table=table),
            {p.name: p for p in mig_profile_infos(table.profiles)})


def test_a100_40gb_h200_and_b200_tables(state: Path) -> None:
    a100, a100_profiles = table_gpu("A100-SXM4-40GB")
    h200, h200_profiles = table_gpu("H200-141GB")
    b200, b200_profiles = table_gpu("B200-180GB")
    engine = SimulatedMigPartitioner(state, {g.uuid: g for g in (a100, h200, b200)})

    engine.create(a100.uuid, a100_profiles["3g.20gb"], 0)
    engine.create(a100.uuid, a100_profiles["3g.20gb"], 4)
    assert refusal(engine, a100.uuid, a100_profiles["3g.20gb"], 0) == "insufficient-resources"
    assert refusal(engine, a100.uuid, a100_profiles["1g.5gb"], 3) == "insufficient-resources"

    engine.create(h200.uuid, h200_profiles["7g.141gb"], 0)
    assert refusal(engine, h200.uuid, h200_profiles["1g.18gb"], 0) == "insufficient-resources"

    # B200: only the rows the reference table captured fully (1g.45gb, 2g.45gb) are simulated.
    assert set(b200_profiles) == {"1g.45gb", "2g.45gb"}
    for start in (0, 2, 4):
        engine.create(b200.uuid, b200_profiles["2g.45gb"], start)
    engine.create(b200.uuid, b200_profiles["1g.45gb"], 6)
    assert refusal(engine, b200.uuid, b200_profiles["1g.45gb"], 6) == "insufficient-resources"
    assert [m.placement_start for m in engine.instances(b200.uuid)] == [0, 2, 4, 6]


def test_a_static_layouts_instances_hold_their_slices_until_destroyed(tmp_path: Path) -> None:
    state = tmp_path / "mig.json"
    engine = SimulatedMigPartitioner.for_layout("demo", NODE, state)
    demo_mig = simulated_gpu_uuid(NODE, 1)  # 3g.40gb@0, 2g.20gb@4, 1g.10gb@6
    before = gpu(state, 1, "demo").mig_instances
    assert [(m.uuid, m.gi_id) for m in engine.instances(demo_mig)] == [(m.uuid, m.gi_id) for m in before]
    one_g = profiles_of(state, 1, "demo")["1g.10gb"]
    assert refusal(engine, demo_mig, one_g, 6) == "insufficient-resources"  # every 1g placement is taken
    assert refusal(engine, demo_mig, profiles_of(state, 1, "demo")["1g.20gb"], 6) == "insufficient-resources"
    static = next(m for m in before if m.placement_start == 6)
    engine.destroy(demo_mig, static.gi_id, static.ci_id)
    assert [m.placement_start for m in gpu(state, 1, "demo").mig_instances] == [0, 4]
    assert engine.create(demo_mig, one_g, 6).gi_id == static.gi_id  # the lowest free id again


# ----------------------------------------------------------------------------------------------- processes


def _create_all(state: str, tries: list[tuple[str, int]], barrier: multiprocessing.synchronize.Barrier,
                results: multiprocessing.Queue[list[tuple[int, int, int]]]) -> None:
    """One process's attempts, started together with the others'; what it made goes to ``results``."""
    engine = SimulatedMigPartitioner.for_layout("dynamic-mig", NODE, Path(state))
    table = {p.name: p for p in SimulatedDiscovery("dynamic-mig", NODE).discover().gpus[0].mig_profiles}
    barrier.wait()
    made = []
    for name, start in tries:
        try:
            m = engine.create(MIG_GPU, table[name], start)
        except MigCreateError:
            continue
        made.append((m.gi_id, m.placement_start, m.placement_size))
    results.put(made)


def test_processes_creating_at_once_never_overlap(engine: SimulatedMigPartitioner, state: Path) -> None:
    table = profiles_of(state)
    tries = [(p.name, start) for p in table.values() for start in p.placement_starts]
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(4)
    results: multiprocessing.Queue[list[tuple[int, int, int]]] = context.Queue()
    workers = [context.Process(target=_create_all, args=(str(state), random.Random(seed).sample(tries, len(tries)),
                                                          barrier, results)) for seed in range(4)]
    for worker in workers:
        worker.start()
    made = [m for _ in workers for m in results.get(timeout=120)]
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    final = engine.instances(MIG_GPU)
    assert made and sorted(made) == sorted((m.gi_id, m.placement_start, m.placement_size) for m in final)
    assert len({m.gi_id for m in final}) == len(final)  # no GI reported made by two processes
    gis: list[MigGpuInstance] = []
    for m in final:
        assert overlaps(m.placement_start, m.placement_size, gis) == []
        gis.append(m)
    by_id = {p.gi_profile_id: p for p in table.values()}
    assert sum(by_id[m.gi_profile_id].compute_slices for m in final) <= 7


# ----------------------------------------------------------------------------------------------- failures


def test_injected_create_failures(engine: SimulatedMigPartitioner, state: Path) -> None:
    table = profiles_of(state)
    engine.inject_failure("create-gi", gpu=MIG_GPU, profile="1g.10gb", placement=3)
    assert refusal(engine, MIG_GPU, table["1g.10gb"], 3) == "failed"
    engine.create(MIG_GPU, table["1g.10gb"], 3)  # once only

    engine.inject_failure("create-ci", profile="2g.20gb")
    assert refusal(engine, MIG_GPU, table["2g.20gb"], 0) == "failed"
    assert placements(engine) == [(3, 1)] and engine.bare_gpu_instances(MIG_GPU) == []  # GI destroyed again

    engine.inject_failure("create-ci", profile="2g.20gb")
    engine.inject_failure("destroy-gi", profile="2g.20gb")
    with pytest.raises(MigCreateError, match="holds its memory slices"):
        engine.create(MIG_GPU, table["2g.20gb"], 0)
    [bare] = engine.bare_gpu_instances(MIG_GPU)
    assert (bare.placement_start, bare.placement_size) == (0, 2)
    assert refusal(engine, MIG_GPU, table["1g.10gb"], 0) == "occupied"  # the bare GI holds its slices
    engine.destroy(MIG_GPU, bare.gi_id, None)
    assert engine.bare_gpu_instances(MIG_GPU) == []


def test_injected_destroy_failures_always_until_cleared(engine: SimulatedMigPartitioner, state: Path) -> None:
    made = engine.create(MIG_GPU, profiles_of(state)["1g.10gb"], 0)
    engine.inject_failure("destroy-ci", times=None)
    for _ in range(2):
        with pytest.raises(MigError, match="destroying CI 0 failed"):
            engine.destroy(MIG_GPU, made.gi_id, made.ci_id)
    engine.clear_failures()
    engine.inject_failure("destroy-gi")
    with pytest.raises(MigError, match="destroying GI"):
        engine.destroy(MIG_GPU, made.gi_id, made.ci_id)
    assert engine.instances(MIG_GPU) == [] and len(engine.bare_gpu_instances(MIG_GPU)) == 1  # the CI went first
    engine.destroy(MIG_GPU, made.gi_id, made.ci_id)
    assert engine.bare_gpu_instances(MIG_GPU) == []


def test_failures_injected_through_one_engine_reach_another(engine: SimulatedMigPartitioner, state: Path) -> None:
    other = SimulatedMigPartitioner.for_layout("dynamic-mig", NODE, state)  # the driver's, say
    engine.inject_failure("create-gi")
    assert refusal(other, MIG_GPU, profiles_of(state)["1g.10gb"], 0) == "failed"


# ----------------------------------------------------------------------------------------------- reboots, discovery


def test_reboot_wipes_created_instances(engine: SimulatedMigPartitioner, state: Path) -> None:
    engine.create(MIG_GPU, profiles_of(state)["7g.80gb"], 0)
    engine.inject_failure("create-gi", times=None)
    engine.reboot()
    assert engine.instances(MIG_GPU) == [] and gpu(state).mig_instances == ()
    assert MigStateFile(state).read().faults != []  # the tests' injections stay


def test_instances_from_another_boot_are_gone(state: Path, tmp_path: Path) -> None:
    before = SimulatedMigPartitioner.for_layout("dynamic-mig", NODE, state, boot_id=lambda: "boot-a")
    before.create(MIG_GPU, profiles_of(tmp_path / "none.json")["7g.80gb"], 0)
    after_reboot = SimulatedMigPartitioner.for_layout("dynamic-mig", NODE, state, boot_id=lambda: "boot-b")
    assert after_reboot.instances(MIG_GPU) == []
    after_reboot.create(MIG_GPU, profiles_of(tmp_path / "none.json")["1g.10gb"], 0)


def test_discovery_reports_created_instances_as_nvml_would(engine: SimulatedMigPartitioner, state: Path) -> None:
    three_g = profiles_of(state)["3g.40gb"]
    made = engine.create(MIG_GPU, three_g, 4)
    info = gpu(state)
    assert info.mig_instances == (MigInstance(
        uuid=made.uuid, profile="3g.40gb", gi_profile_id=9, placement_start=4, placement_size=4,
        gi_id=made.gi_id, ci_id=made.ci_id, memory_bytes=40448 * MIB, multiprocessors=60, copy_engines=3,
        decoders=3, encoders=0, jpeg_engines=3, ofa_engines=0),)
    assert CreatedMig(uuid=made.uuid, gi_id=made.gi_id, ci_id=made.ci_id, gi_profile_id=9, placement_start=4,
                      placement_size=4) == made
    # The discovery the driver runs reads the file at every discover(), so it sees instances made later.
    discovery = SimulatedDiscovery("dynamic-mig", NODE, mig_state=state)
    engine.create(MIG_GPU, profiles_of(state)["1g.10gb"], 0)
    assert [m.profile for m in discovery.discover().gpus[0].mig_instances] == ["1g.10gb", "3g.40gb"]
    # Without the state file the node is its layout.
    assert SimulatedDiscovery("dynamic-mig", NODE).discover().gpus[0].mig_instances == ()


def test_simulated_profile_tables(state: Path) -> None:
    mig_gpu, whole, l4 = SimulatedDiscovery("dynamic-mig", NODE).discover().gpus
    assert (mig_gpu.mig_enabled, mig_gpu.mig_instances, mig_gpu.mig_memory_slices) == (True, (), 8)
    assert [(p.name, p.gi_profile_id, p.ci_profile_id, p.compute_slices, p.memory_slices, p.placement_starts)
            for p in mig_gpu.mig_profiles] == [
        ("7g.80gb", 0, 4, 7, 8, (0,)),
        ("4g.40gb", 5, 3, 4, 4, (0,)),
        ("3g.40gb", 9, 2, 3, 4, (0, 4)),
        ("2g.20gb", 14, 1, 2, 2, (0, 2, 4)),
        ("1g.20gb", 15, 0, 1, 2, (0, 2, 4, 6)),
        ("1g.10gb", 19, 0, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
        ("1g.10gb+me", 20, 0, 1, 1, (0, 1, 2, 3, 4, 5, 6)),
    ]
    one_g = next(p for p in mig_gpu.mig_profiles if p.name == "1g.10gb")
    # Engines as NVIDIA's MIG User Guide lists them for the H100 (driver/simulation/mig-engines.json).
    assert (one_g.memory_bytes, one_g.multiprocessors, one_g.copy_engines, one_g.decoders, one_g.jpeg_engines,
            one_g.ofa_engines) == (9984 * MIB, 16, 1, 1, 1, 0)
    assert (whole.mig_capable, whole.mig_enabled, whole.mig_profiles, whole.mig_memory_slices) == (True, False, (), 0)
    assert (l4.mig_capable, l4.mig_profiles) == (False, ())
    # A static MIG GPU reports them too: the publishing side decides what to do with them.
    assert len(SimulatedDiscovery("h200-mig", NODE).discover().gpus[0].mig_profiles) == 7


def test_a_second_me_instance_is_refused_as_the_gpus_only_ofa_engine_is_taken(
        engine: SimulatedMigPartitioner, state: Path) -> None:
    me = profiles_of(state)["1g.10gb+me"]
    engine.create(MIG_GPU, me, 0)
    with pytest.raises(MigCreateError) as refused:
        engine.create(MIG_GPU, me, 1)
    assert refused.value.reason == "insufficient-resources"
    assert "NVML error 23: Insufficient Resources" in str(refused.value)
