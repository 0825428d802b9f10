"""Dynamic MIG through DeviceState: prepare creates the claim's instance (intent recorded first), unprepare
destroys it, refusals leave nothing, recovery destroys what an interrupted prepare made and re-creates what a
reboot took, and instances Tessera did not create are never touched.

The node is ``tests/support/dynamicmignode.py``: the ``dynamic-mig`` layout with the simulated MIG partitioner
(NVIDIA's placement rules, NVML's refusals) over a state file, keeping the host tree's /proc capability files.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from driver.gpu.claim.claimplan import plan_claim
from driver.gpu.claim.claimrecord import started_record
from driver.gpu.discovery.inventory import MigProfileInfo
from driver.gpu.errors import PrepareError
from driver.gpu.published.devices import make_view
from driver.gpu.record.checkpoint import Checkpoint, ClaimPhase, ClaimRecord
from driver.gpu.runtime.mig import CreatedMig, MigCreateError, MigError
from driver.gpu.runtime.migclaims import own_instances
from driver.gpu.state import DeviceState
from driver.kubeletplugin.claimmodel import ResourceClaim
from driver.kubeletplugin.types import Deadline
from driver.simulation.hostroot import SIMULATED_CAPS_MAJOR, capability_minors
from driver.simulation.migengine import SimulatedMigPartitioner
from tests.support.dynamicmignode import DynamicMigNode
from tests.support.statenode import claim, mps_shares, ref

THREE_G = "gpu-0-dynmig-3g40gb-4"
TWO_G_0, TWO_G_2 = "gpu-0-dynmig-2g20gb-0", "gpu-0-dynmig-2g20gb-2"


def mig_config(**mps: object) -> dict[str, object]:
    sharing: dict[str, object] = {"strategy": "MPS"}
    if mps:
        sharing["mpsConfig"] = mps
    return {"source": "FromClaim", "requests": [],
            "opaque": {"driver": "gpu.tessera.dev", "parameters": {
                "apiVersion": "gpu.tessera.dev/v1alpha1", "kind": "MigDeviceConfig", "sharing": sharing}}}


@pytest.fixture
def mig_node(tmp_path: Path) -> Iterator[DynamicMigNode]:
    yield DynamicMigNode(tmp_path)


@pytest.fixture
def state(mig_node: DynamicMigNode) -> DeviceState:
    return mig_node.state()


def test_prepare_creates_the_instance_and_writes_its_nodes(mig_node: DynamicMigNode, state: DeviceState) -> None:
    devices = state.prepare(claim("u1", THREE_G))
    assert [d.device_name for d in devices] == [THREE_G]
    assert mig_node.instances() == [(4, 4, 0)]
    [record] = state.prepared_claims()
    [dev] = record.devices
    assert record.phase == ClaimPhase.PREPARE_COMPLETED
    assert dev.dynamic_mig is not None and dev.dynamic_mig.profile == "3g.40gb"
    assert dev.dynamic_mig.placement_start == 4 and dev.dynamic_mig.create_started
    [made] = mig_node.engine.instances(mig_node.gpu().uuid)
    assert (dev.mig_gi_id, dev.mig_ci_id, dev.mig_uuid) == (made.gi_id, made.ci_id, made.uuid)
    assert own_instances(mig_node.checkpoint()) == {(mig_node.gpu().uuid, made.gi_id)}
    # The nodes the real driver's /proc names for the new instance, fully specified.
    gi_minor, ci_minor = capability_minors(0, made.gi_id, made.ci_id)
    nodes = mig_node.spec_json("u1")["devices"][0]["containerEdits"]["deviceNodes"]
    assert nodes == [{"path": "/dev/nvidia0"},
                     {"path": f"/dev/nvidia-caps/nvidia-cap{gi_minor}", "type": "c", "major": SIMULATED_CAPS_MAJOR,
                      "minor": gi_minor, "fileMode": 292},
                     {"path": f"/dev/nvidia-caps/nvidia-cap{ci_minor}", "type": "c", "major": SIMULATED_CAPS_MAJOR,
                      "minor": ci_minor, "fileMode": 292}]
    assert mig_node.proc_caps() == [f"gi{made.gi_id}/access", f"gi{made.gi_id}/ci0/access"]
    annotations = mig_node.spec_json("u1")["devices"][0]["annotations"]
    assert annotations["gpu.tessera.dev/mig-uuid"] == made.uuid


def test_a_repeated_prepare_returns_the_same_answer_and_creates_nothing(mig_node: DynamicMigNode,
                                                                       state: DeviceState) -> None:
    first = state.prepare(claim("u1", THREE_G))
    assert state.prepare(claim("u1", THREE_G)) == first
    assert mig_node.instances() == [(4, 4, 0)]


def test_unprepare_destroys_the_instance_then_forgets_the_claim(mig_node: DynamicMigNode, state: DeviceState) -> None:
    state.prepare(claim("u1", TWO_G_0))
    state.prepare(claim("u2", TWO_G_2))
    state.unprepare(ref("u1"))
    assert mig_node.instances() == [(2, 2, 0)]
    assert [r.uid for r in state.prepared_claims()] == ["u2"]
    assert mig_node.cdi_files() == ["k8s.gpu.tessera.dev-claim_u2.json"]
    state.unprepare(ref("u2"))
    assert mig_node.instances() == [] and mig_node.proc_caps() == [] and mig_node.cdi_files() == []
    state.unprepare(ref("u2"))  # again: nothing to do


@pytest.mark.parametrize("call", ["create-gi", "create-ci"])
def test_an_nvml_refusal_is_the_claims_error_and_leaves_nothing(mig_node: DynamicMigNode, state: DeviceState,
                                                                call: str) -> None:
    mig_node.engine.inject_failure(call, placement=4)  # type: ignore[arg-type]
    with pytest.raises(PrepareError) as err:
        state.prepare(claim("u1", THREE_G))
    message = str(err.value)
    assert "3g.40gb at placement 4" in message and "GPU 0" in message and mig_node.gpu().uuid in message
    assert mig_node.instances() == [] and state.prepared_claims() == [] and mig_node.cdi_files() == []
    state.prepare(claim("u1", THREE_G))  # the kubelet's retry
    assert mig_node.instances() == [(4, 4, 0)]


def test_an_instance_tessera_did_not_create_is_named_and_left_alone(mig_node: DynamicMigNode,
                                                                   state: DeviceState) -> None:
    profiles = {p.name: p for p in mig_node.gpu().mig_profiles}
    foreign = mig_node.engine.create(mig_node.gpu().uuid, profiles["1g.10gb"], 5)
    with pytest.raises(PrepareError) as err:
        state.prepare(claim("u1", THREE_G))
    message = str(err.value)
    assert f"GI {foreign.gi_id} (1g.10gb at placement 5" in message and "Tessera did not create" in message
    assert "3g.40gb at placement 4" in message and mig_node.gpu().uuid in message
    assert mig_node.instances() == [(5, 1, 0)], "someone else's instance is never touched"
    assert state.prepared_claims() == [] and mig_node.cdi_files() == []


def test_a_placement_another_claim_holds_is_refused_before_anything_is_done(mig_node: DynamicMigNode,
                                                                            state: DeviceState) -> None:
    state.prepare(claim("u1", THREE_G))
    with pytest.raises(PrepareError, match=r"overlaps 'gpu-0-dynmig-3g40gb-4'.*claim default/claim-u1"):
        state.prepare(claim("u2", "gpu-0-dynmig-1g10gb-5"))
    assert mig_node.instances() == [(4, 4, 0)]


def test_without_a_partitioner_the_claim_is_refused_cleanly(mig_node: DynamicMigNode) -> None:
    state = mig_node.state(with_partitioner=False)
    with pytest.raises(PrepareError, match="without a way to create MIG devices"):
        state.prepare(claim("u1", THREE_G))
    assert state.prepared_claims() == [] and mig_node.cdi_files() == []


def test_the_whole_device_of_a_dynamic_gpu_is_its_full_size_instance(mig_node: DynamicMigNode,
                                                                      state: DeviceState) -> None:
    state.prepare(claim("u1", "gpu-0"))
    assert mig_node.instances() == [(0, 8, 0)]
    [record] = state.prepared_claims()
    assert record.exclusive_gpus == [] and record.devices[0].kind == "gpu"
    assert len(mig_node.spec_json("u1")["devices"][0]["containerEdits"]["deviceNodes"]) == 3  # GPU, GI and CI caps
    state.unprepare(ref("u1"))
    assert mig_node.instances() == []


def test_mps_on_a_dynamic_mig_device_serves_the_created_instance(mig_node: DynamicMigNode, state: DeviceState) -> None:
    state.prepare(claim("u1", THREE_G, configs=[mig_config(defaultActiveThreadPercentage=50,
                                                           defaultPinnedDeviceMemoryLimit="10Gi")]))
    [made] = mig_node.engine.instances(mig_node.gpu().uuid)
    [daemon_id] = mig_node.mps.running
    spec = mig_node.mps.running[daemon_id].spec
    assert spec.gpu_uuids == [made.uuid], "the daemon serves the MIG device, addressed by its MIG UUID"
    assert spec.active_thread_percentage == 50 and spec.pinned_memory_limits == {made.uuid: 10 * 2**30}
    [record] = state.prepared_claims()
    assert record.exclusive_gpus == [] and mig_node.modes.sets == [], "a GPU in MIG mode stays in DEFAULT"
    env = mig_node.spec_json("u1")["devices"][0]["containerEdits"]["env"]
    assert "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=10240M" in env  # by ordinal: the container sees one device
    state.unprepare(ref("u1"))
    assert mig_node.mps.stopped_after_start(daemon_id) and mig_node.instances() == []


def test_a_failed_daemon_start_destroys_the_instance_it_was_for(mig_node: DynamicMigNode, state: DeviceState) -> None:
    mig_node.mps.fail_start = True
    with pytest.raises(PrepareError):
        state.prepare(claim("u1", THREE_G, configs=[mig_config()]))
    assert mig_node.instances() == [] and state.prepared_claims() == [] and mig_node.cdi_files() == []


# ----------------------------------------------------------------------------- crashes, restarts and reboots


def _put_claim(cp: Checkpoint, record: ClaimRecord) -> None:
    cp.claims[record.uid] = record


def _crash_mid_create(
        mig_node: DynamicMigNode, state: DeviceState, *, create_started: bool, bare: bool = False) -> None:
    """Leave what a kill -9 inside the create leaves: the PrepareStarted record (``create_started`` as given) and
    the GPU instance NVML had made (with ``bare``, without its compute instance: the engine is told to fail the
    CI and then the GI's destroy, as a process dying between the two NVML calls leaves it)."""
    claim_plan = plan_claim(claim("u1", THREE_G), driver_name="gpu.tessera.dev", pool_name="node-a", view=state.view)
    assert claim_plan is not None
    record = started_record(claim_plan, state.names, "node-a", None, "now")
    assert record.devices[0].dynamic_mig is not None
    record.devices[0].dynamic_mig.create_started = create_started
    state.ledger.commit(partial(_put_claim, record=record))
    three_g = {p.name: p for p in mig_node.gpu().mig_profiles}["3g.40gb"]
    if bare:
        mig_node.engine.inject_failure("create-ci", placement=4)
        mig_node.engine.inject_failure("destroy-gi", placement=4)
        with pytest.raises(MigCreateError):
            mig_node.engine.create(mig_node.gpu().uuid, three_g, 4)
    else:
        mig_node.engine.create(mig_node.gpu().uuid, three_g, 4)


def test_a_create_that_hangs_past_the_deadline_leaves_nothing(mig_node: DynamicMigNode, state: DeviceState) -> None:
    mig_node.engine.inject_failure("create-ci", placement=4, effect="hang-after", seconds=0.05)
    with pytest.raises(PrepareError, match="injected hang ended"):
        state.prepare(claim("u1", THREE_G), Deadline.after(30))
    assert mig_node.instances() == [] and state.prepared_claims() == [] and mig_node.cdi_files() == []


@pytest.mark.parametrize("bare", [False, True])
def test_restart_destroys_what_an_interrupted_create_made(mig_node: DynamicMigNode, state: DeviceState,
                                                          bare: bool) -> None:
    _crash_mid_create(mig_node, state, create_started=True, bare=bare)
    assert mig_node.instances() == [(4, 4, None if bare else 0)]
    restarted = mig_node.state()
    assert mig_node.instances() == [] and restarted.prepared_claims() == [] and mig_node.cdi_files() == []
    restarted.prepare(claim("u1", THREE_G))  # the kubelet's retry
    assert mig_node.instances() == [(4, 4, 0)]


def test_restart_leaves_an_instance_the_crashed_create_never_asked_for(mig_node: DynamicMigNode,
                                                                       state: DeviceState) -> None:
    # Killed after the intent, before the placement was found free: what is there is someone else's.
    _crash_mid_create(mig_node, state, create_started=False)
    mig_node.state()
    assert mig_node.instances() == [(4, 4, 0)], "not checked free before the crash: never Tessera's to destroy"


def test_restart_after_a_reboot_recreates_the_instances_of_prepared_claims(mig_node: DynamicMigNode,
                                                                           state: DeviceState) -> None:
    state.prepare(claim("u1", TWO_G_2, configs=[mig_config(defaultActiveThreadPercentage=40)]))
    state.prepare(claim("u2", "gpu-0-dynmig-1g10gb-6"))
    before = {r.uid: r.devices[0] for r in state.prepared_claims()}
    profiles = {p.name: p for p in mig_node.gpu().mig_profiles}
    mig_node.engine.reboot()
    mig_node.set_boot_id("boot-2")
    # After the reboot someone takes GI id 1 elsewhere before the driver starts: not the claim's, never touched.
    foreign = mig_node.engine.create(mig_node.gpu().uuid, profiles["1g.10gb"], 0)
    mig_node.mps.running.clear()  # daemons do not survive a reboot either
    restarted = mig_node.state()
    after = {r.uid: r.devices[0] for r in restarted.prepared_claims()}
    assert mig_node.instances() == [(0, 1, 0), (2, 2, 0), (6, 1, 0)]
    for uid in ("u1", "u2"):
        intent = after[uid].dynamic_mig
        assert intent is not None and intent == before[uid].dynamic_mig, "the same profile at the same placement"
        made = {m.gi_id: m for m in mig_node.engine.instances(mig_node.gpu().uuid)}[after[uid].mig_gi_id or -1]
        assert made.uuid == after[uid].mig_uuid and made.placement_start == intent.placement_start
        spec = mig_node.spec_json(uid)["devices"][0]["annotations"]
        assert spec["gpu.tessera.dev/mig-uuid"] == made.uuid, "CDI spec rewritten for the new instance"
    assert foreign.gi_id not in {after["u1"].mig_gi_id, after["u2"].mig_gi_id}
    [daemon] = mig_node.mps.running.values()
    assert daemon.spec.gpu_uuids == [after["u1"].mig_uuid], "the daemon restarted on the re-created instance"
    restarted.unprepare(ref("u1"))
    restarted.unprepare(ref("u2"))
    assert mig_node.instances() == [(0, 1, 0)], "the foreign instance stays"


def test_an_instance_destroyed_behind_the_drivers_back_is_recreated_at_restart(mig_node: DynamicMigNode,
                                                                                state: DeviceState) -> None:
    state.prepare(claim("u1", THREE_G))
    [made] = mig_node.engine.instances(mig_node.gpu().uuid)
    mig_node.engine.destroy(mig_node.gpu().uuid, made.gi_id, made.ci_id)
    mig_node.state()
    assert mig_node.instances() == [(4, 4, 0)]


def test_a_refused_destroy_fails_the_unprepare_and_keeps_the_record_for_the_retry(mig_node: DynamicMigNode,
                                                                                  state: DeviceState) -> None:
    state.prepare(claim("u1", THREE_G))
    mig_node.engine.inject_failure("destroy-ci", placement=4)
    with pytest.raises(MigError, match="destroying CI 0 failed"):
        state.unprepare(ref("u1"))
    assert [r.uid for r in state.prepared_claims()] == ["u1"] and mig_node.instances() == [(4, 4, 0)]
    state.unprepare(ref("u1"))  # the kubelet's retry
    assert state.prepared_claims() == [] and mig_node.instances() == [] and mig_node.cdi_files() == []


def test_admin_access_to_a_dynamic_device_gets_the_gpu_node_and_creates_nothing(mig_node: DynamicMigNode,
                                                                               state: DeviceState) -> None:
    state.prepare(claim("u1", THREE_G))
    admin = ResourceClaim.model_validate({
        "metadata": {"name": "monitor", "namespace": "default", "uid": "u2"},
        "status": {"allocation": {"devices": {"results": [
            {"request": "r0", "driver": "gpu.tessera.dev", "pool": "node-a", "device": THREE_G,
             "adminAccess": True}], "config": []}}}})
    state.prepare(admin)
    assert mig_node.instances() == [(4, 4, 0)], "no second instance"
    nodes = mig_node.spec_json("u2")["devices"][0]["containerEdits"]["deviceNodes"]
    # The GPU's node, and mig/monitor so that nvidia-smi in the monitoring pod can list the GPU's MIG devices.
    assert [n["path"] for n in nodes] == ["/dev/nvidia0", "/dev/nvidia-caps/nvidia-cap2"]
    state.unprepare(ref("u2"))
    assert mig_node.instances() == [(4, 4, 0)], "the holder's instance stays"


# ----------------------------------------------------------------------------- review: someone else's instances


def another_tool_creates_first(mig_node: DynamicMigNode, monkeypatch: pytest.MonkeyPatch) -> list[CreatedMig]:
    """Another tool creates a 3g.40gb at 4 just before the driver's next create; the list gets that instance."""
    three_g = {p.name: p for p in mig_node.gpu().mig_profiles}["3g.40gb"]
    real_create = SimulatedMigPartitioner.create
    foreign: list[CreatedMig] = []

    def raced(self: SimulatedMigPartitioner, gpu_uuid: str, profile: MigProfileInfo, start: int,
              deadline: Deadline | None = None) -> CreatedMig:
        if not foreign:
            foreign.append(real_create(mig_node.engine, gpu_uuid, three_g, 4))
        return real_create(self, gpu_uuid, profile, start, deadline)

    monkeypatch.setattr(SimulatedMigPartitioner, "create", raced)
    return foreign


def test_a_create_refused_because_another_tool_took_the_placement_leaves_its_instance_alone(
        mig_node: DynamicMigNode, state: DeviceState, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another tool creates the very instance between the driver's check of the placement and its create: NVML
    # refuses the driver's (occupied), nothing of the claim's was made, and the rollback must not take theirs.
    foreign = another_tool_creates_first(mig_node, monkeypatch)
    with pytest.raises(PrepareError, match=r"3g.40gb at placement 4.*\(occupied\)"):
        state.prepare(claim("u1", THREE_G))
    assert [m.uuid for m in mig_node.engine.instances(mig_node.gpu().uuid)] == [foreign[0].uuid], \
        "someone else's instance is never touched"
    assert state.prepared_claims() == [] and mig_node.cdi_files() == []


def test_a_re_create_refused_after_a_reboot_leaves_the_other_tools_instance_alone_at_unprepare(
        mig_node: DynamicMigNode, state: DeviceState, monkeypatch: pytest.MonkeyPatch) -> None:
    state.prepare(claim("u1", THREE_G))
    mig_node.engine.reboot()
    mig_node.set_boot_id("boot-2")
    foreign = another_tool_creates_first(mig_node, monkeypatch)
    restarted = mig_node.state()  # recovery's re-create is refused: logged, the claim cannot get its instance back
    monkeypatch.undo()
    restarted.unprepare(ref("u1"))
    assert [m.uuid for m in mig_node.engine.instances(mig_node.gpu().uuid)] == [foreign[0].uuid], \
        "someone else's instance is never touched"
    assert restarted.prepared_claims() == []


def test_unprepare_leaves_an_instance_another_tool_made_where_the_claims_was(mig_node: DynamicMigNode,
                                                                            state: DeviceState) -> None:
    # The claim's instance is destroyed outside Tessera and another tool creates one of the same profile at the
    # same placement: NVML hands the same GI id out again, but it is another instance (another MIG UUID).
    state.prepare(claim("u1", THREE_G))
    uuid = mig_node.gpu().uuid
    [made] = mig_node.engine.instances(uuid)
    mig_node.engine.destroy(uuid, made.gi_id, made.ci_id)
    foreign = mig_node.engine.create(uuid, {p.name: p for p in mig_node.gpu().mig_profiles}["3g.40gb"], 4)
    assert (foreign.gi_id, foreign.ci_id) == (made.gi_id, made.ci_id) and foreign.uuid != made.uuid
    state.unprepare(ref("u1"))
    assert [m.uuid for m in mig_node.engine.instances(uuid)] == [foreign.uuid], "someone else's instance stays"
    assert state.prepared_claims() == [] and mig_node.cdi_files() == []


def test_an_unprepare_cut_short_between_its_two_destroys_leaves_nothing_after_a_restart(
        mig_node: DynamicMigNode, state: DeviceState) -> None:
    # What a kill -9 between destroying the compute instance and the GPU instance leaves: the record (ids
    # recorded) and the claim's GPU instance, bare. The restart makes the claim whole, the retry removes it.
    state.prepare(claim("u1", THREE_G))
    mig_node.engine.inject_failure("destroy-gi", placement=4)
    with pytest.raises(MigError):
        state.unprepare(ref("u1"))
    assert mig_node.instances() == [(4, 4, None)]
    restarted = mig_node.state()
    assert mig_node.instances() == [(4, 4, 0)], "recovery makes the claim whole again"
    restarted.unprepare(ref("u1"))  # the kubelet's retry
    assert mig_node.instances() == [] and restarted.prepared_claims() == [] and mig_node.cdi_files() == []


def test_a_claim_whose_instance_cannot_be_made_again_loses_its_cdi_spec(mig_node: DynamicMigNode,
                                                                         state: DeviceState) -> None:
    # After a reboot another tool takes the claim's placement first, and NVML gives its instance the ids the
    # claim's had: the claim's old spec names those ids' capability nodes, so a container started from the
    # kubelet's cached CDI ids would open the other tool's instance. The spec goes, and the claim's next prepare
    # is refused (its placement is no longer published).
    state.prepare(claim("u1", THREE_G))
    before = mig_node.spec_json("u1")["devices"][0]["containerEdits"]["deviceNodes"]
    mig_node.engine.reboot()
    mig_node.set_boot_id("boot-2")
    foreign = mig_node.engine.create(mig_node.gpu().uuid, {p.name: p for p in mig_node.gpu().mig_profiles}["3g.40gb"],
                                     4)
    assert (foreign.gi_id, foreign.ci_id) == (1, 0) and len(before) == 3, "the other instance got the claim's ids"
    restarted = mig_node.state()
    assert not mig_node.spec_path("u1").exists()
    with pytest.raises(PrepareError, match="not published by this node"):
        restarted.prepare(claim("u1", THREE_G))
    assert [m.uuid for m in mig_node.engine.instances(mig_node.gpu().uuid)] == [foreign.uuid]


def test_a_busy_dynamic_gpu_whose_mig_mode_went_off_does_not_stop_the_node_publishing(
        mig_node: DynamicMigNode, state: DeviceState, caplog: pytest.LogCaptureFixture) -> None:
    # An operator turns MIG mode off (a GPU reset; the instances go) while a claim is prepared on the dynamic GPU.
    # Its form cannot be kept (a GPU out of MIG mode cannot be dynamic MIG); before, every rescan raised, and no
    # GPU of the node could change its publication until the claim was gone.
    state.prepare(claim("u1", THREE_G))
    gpu0 = mig_node.gpu()
    inventory = mig_node.inventory()
    off = inventory.model_copy(update={"gpus": [g.model_copy(update={"mig_enabled": False, "mig_instances": []})
                                                if g.uuid == gpu0.uuid else g for g in inventory.gpus]})
    other = mig_node.gpu(2).uuid
    view, deferred = state.apply_layout(make_view(off, {}), {other: mps_shares(2)})
    assert "gpu-2-mps-0" in view.targets, "the node's other GPUs still follow the plan"
    assert "gpu-0" in view.targets and view.targets["gpu-0"].placement is None, "gpu-0 is published as it now is"
    assert deferred == set()
    assert any("cannot keep" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records)


def test_a_claim_whose_instances_cannot_be_listed_at_a_restart_keeps_its_cdi_spec(
        mig_node: DynamicMigNode, state: DeviceState, monkeypatch: pytest.MonkeyPatch) -> None:
    # NVML failing to list the GPU's instances says nothing about the claim's: its recorded ids still name it, so
    # its spec stays and its containers can restart (only a claim whose instance is gone loses its spec).
    state.prepare(claim("u1", THREE_G))

    def unanswered(self: SimulatedMigPartitioner, gpu_uuid: str, deadline: Deadline | None = None) -> list[CreatedMig]:
        raise MigError(f"listing the MIG devices of {gpu_uuid}: NVML did not answer")

    monkeypatch.setattr(SimulatedMigPartitioner, "instances", unanswered)
    mig_node.state()
    assert mig_node.spec_path("u1").exists()


def test_a_claim_whose_unprepare_stopped_its_daemon_then_failed_is_refused_cleanly_until_the_retry(
        mig_node: DynamicMigNode, state: DeviceState) -> None:
    # Unprepare stops the claim's MPS daemon (and forgets it), destroys the compute instance, then NVML refuses
    # the GPU instance: the claim stays recorded without its daemon. A prepare or a restart in between must not
    # fail on the missing daemon record with a KeyError; the kubelet's retried unprepare removes everything.
    state.prepare(claim("u1", THREE_G, configs=[mig_config()]))
    mig_node.engine.inject_failure("destroy-gi", placement=4)
    with pytest.raises(MigError):
        state.unprepare(ref("u1"))
    with pytest.raises(PrepareError, match="unprepare had begun"):
        state.prepare(claim("u1", THREE_G, configs=[mig_config()]))
    restarted = mig_node.state()  # recovery logs the claim it could not restore, and goes on
    restarted.unprepare(ref("u1"))
    assert mig_node.instances() == [] and restarted.prepared_claims() == [] and mig_node.cdi_files() == []
