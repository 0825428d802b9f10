"""Dynamic MIG through the real driver process: prepare creates the claim's MIG instance and unprepare destroys it
(checked in the simulated NVML's state file and the host tree's /proc), NVML's refusals are per-claim errors
that leave nothing, kill -9 at each step of a create leaves nothing after the restart, a reboot's lost instances
are re-created before the driver serves, MPS serves a created instance, and health events on one taint its device.

The node is the simulated ``dynamic-mig`` layout (gpu-0 an H100 80GB in MIG mode without instances, published
dynamically by the plan; gpu-1 a whole H100; gpu-2 an L4). Crash points come from the simulated NVML's failure
injection: a create told to hang (before its GPU instance, before its compute instance, or once it is made)
logs ``SIMULATION: MIG create hangs`` and blocks until the driver is killed.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from driver.simulation.migstate import FaultCall, FaultEffect
from tests.support import mignode
from tests.support.mignode import mig_mps_config
from tests.support.node import DRIVER, SimulatedNode, kill_9_while_daemon_starts, pid_alive, wait_until

PLANS = {"defaultPlan": "p", "plans": {"p": {"gpus": [{"match": {"minor": 0}, "dynamicMig": {}}]}}}
THREE_G = "gpu-0-dynmig-3g40gb-4"
TWO_G = "gpu-0-dynmig-2g20gb-2"
ONE_G = "gpu-0-dynmig-1g10gb-6"


@pytest.fixture
def sim_node() -> Iterator[SimulatedNode]:
    with mignode.dynamic_mig_node(PLANS) as n:
        yield n


def start(sim_node: SimulatedNode, env: dict[str, str] | None = None) -> None:
    sim_node.start(env={"TESSERA_SIM_EVENTS": str(sim_node.events_file), **(env or {})})
    wait_until(lambda: THREE_G in sim_node.device_names(), 30, "the dynamic MIG placements published")


def logged(sim_node: SimulatedNode, msg: str) -> list[dict[str, Any]]:
    return [e for e in sim_node.log() if e.get("msg") == msg]


def restart(sim_node: SimulatedNode, env: dict[str, str] | None = None) -> None:
    """Restart the driver and wait until it serves: it registers first and recovers behind the open sockets."""
    runs = len(logged(sim_node, "driver started"))
    sim_node.restart(env={"TESSERA_SIM_EVENTS": str(sim_node.events_file), **(env or {})})
    wait_until(lambda: len(logged(sim_node, "driver started")) > runs, 30, "the restarted driver to serve")


def spec_nodes(sim_node: SimulatedNode, uid: str) -> list[str]:
    spec = json.loads(sim_node.cdi_spec(uid).read_text())
    return [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]


def test_prepare_creates_the_instance_and_unprepare_destroys_it(sim_node: SimulatedNode) -> None:
    start(sim_node)
    ref = sim_node.claim("c", [("mig", THREE_G)])
    first = sim_node.prepare_ok(ref)
    [gi] = mignode.instances(sim_node)
    assert (gi["placement_start"], gi["placement_size"], gi["ci_id"]) == (4, 4, 0)
    assert mignode.proc_caps(sim_node) == [f"gi{gi['gi_id']}/access", f"gi{gi['gi_id']}/ci0/access"]
    [record] = sim_node.checkpoint()["claims"].values()
    [dev] = record["devices"]
    assert (dev["mig_gi_id"], dev["mig_ci_id"], dev["mig_uuid"]) == (gi["gi_id"], 0, gi["uuid"])
    assert dev["dynamic_mig"]["profile"] == "3g.40gb" and dev["dynamic_mig"]["placement_start"] == 4
    assert spec_nodes(sim_node, ref.uid)[0] == "/dev/nvidia0" and len(spec_nodes(sim_node, ref.uid)) == 3
    assert sim_node.prepare_ok(ref).devices == first.devices, "a repeated prepare: the same answer, nothing created"
    assert len(mignode.instances(sim_node)) == 1
    assert sim_node.unprepare(ref) == {ref.uid: None}
    assert mignode.instances(sim_node) == [] and mignode.proc_caps(sim_node) == []
    assert sim_node.cdi_files() == [] and sim_node.checkpoint()["claims"] == {}


def test_an_nvml_refusal_is_the_claims_error_and_leaves_nothing(sim_node: SimulatedNode) -> None:
    start(sim_node)
    engine = mignode.engine(sim_node)
    engine.inject_failure("create-ci", placement=4)
    ref = sim_node.claim("c", [("mig", THREE_G)])
    error = sim_node.prepare(ref)[ref.uid].error
    assert error is not None
    gpu = sim_node.inventory.gpus[0]
    assert "3g.40gb at placement 4" in error and f"GPU 0 ({gpu.uuid})" in error and THREE_G in error
    assert mignode.instances(sim_node) == [] and sim_node.cdi_files() == [] and sim_node.checkpoint()["claims"] == {}
    sim_node.prepare_ok(ref)  # the kubelet's retry
    assert mignode.placements(sim_node) == [(4, 4, 0)]


def test_someone_elses_instance_in_the_way_is_named_and_never_touched(sim_node: SimulatedNode) -> None:
    start(sim_node)
    one_g = next(p for p in sim_node.inventory.gpus[0].mig_profiles if p.name == "1g.10gb")
    mignode.engine(sim_node).create(sim_node.inventory.gpus[0].uuid, one_g, 5)
    ref = sim_node.claim("c", [("mig", THREE_G)])
    error = sim_node.prepare(ref)[ref.uid].error
    assert error is not None and "1g.10gb at placement 5" in error and "Tessera did not create" in error
    assert mignode.placements(sim_node) == [(5, 1, 0)]
    assert sim_node.cdi_files() == [] and sim_node.checkpoint()["claims"] == {}


@pytest.mark.parametrize(("profile", "start_slice", "size", "whole"), [
    ("3g.40gb", 4, 4, False),  # a placement
    ("7g.80gb", 0, 8, True),  # the whole device of a dynamic GPU: its full-size profile at 0
])
def test_a_claim_for_a_placement_is_never_given_an_instance_someone_else_made_there(
        sim_node: SimulatedNode, profile: str, start_slice: int, size: int, whole: bool) -> None:
    """The attacker: a process on the node creates a MIG instance exactly at the placement of a claim that is
    allocated but not yet prepared, and the driver's rescan publishes the GPU as that static MIG device. The
    claim asked for an instance of its own: handing it the other instance (another workload's) would put two
    tenants in one MIG instance. It is refused, and the other instance is left alone."""
    start(sim_node)
    attrs = {d["name"]: d.get("attributes", {}) for d in sim_node.devices()}
    stale = "gpu-0" if whole else next(name for name, a in attrs.items()
                                       if a.get("placement") == {"int": start_slice}
                                       and a.get("profile") == {"string": profile})
    ref = sim_node.claim("c", [("gpu" if whole else "mig", stale)])
    gpu = sim_node.inventory.gpus[0]
    made = next(p for p in gpu.mig_profiles if p.name == profile)
    foreign = mignode.engine(sim_node).create(gpu.uuid, made, start_slice)
    wait_until(lambda: any(d.get("attributes", {}).get("uuid") == {"string": foreign.uuid} for d in sim_node.devices()),
               30, "the other instance published as a static MIG device")
    error = sim_node.prepare(ref)[ref.uid].error
    assert error is not None and stale in error
    assert mignode.placements(sim_node) == [(start_slice, size, 0)], "the other instance is never touched"
    assert sim_node.cdi_files() == [] and sim_node.checkpoint()["claims"] == {}


@pytest.mark.parametrize(("call", "effect", "left"), [
    ("create-gi", "hang", []),  # between the intent and the creation: nothing made yet
    ("create-ci", "hang", [(4, 4, None)]),  # the GPU instance made, not its compute instance
    ("create-ci", "hang-after", [(4, 4, 0)]),  # the MIG device made, its ids not yet recorded
])
def test_kill_9_during_the_create_leaves_nothing_after_restart(sim_node: SimulatedNode, call: FaultCall,
                                                              effect: FaultEffect,
                                                              left: list[tuple[int, int, int | None]]) -> None:
    start(sim_node)
    mignode.engine(sim_node).inject_failure(call, placement=4, effect=effect)
    ref = sim_node.claim("c", [("mig", THREE_G)])

    def prepare_until_killed() -> None:
        with contextlib.suppress(grpc.RpcError):  # the driver dies under this call
            sim_node.prepare(ref)

    thread = threading.Thread(target=prepare_until_killed, daemon=True)
    thread.start()
    wait_until(lambda: bool(logged(sim_node, "SIMULATION: MIG create hangs (injected)")), 30, "the create to hang")
    intent = sim_node.checkpoint()["claims"][ref.uid]
    assert intent["phase"] == "PrepareStarted" and intent["devices"][0]["dynamic_mig"]["create_started"]
    assert intent["devices"][0]["mig_gi_id"] is None
    sim_node.kill9()
    thread.join(timeout=30)
    assert mignode.placements(sim_node) == left

    restart(sim_node)
    assert mignode.instances(sim_node) == [] and mignode.proc_caps(sim_node) == []
    assert ref.uid not in sim_node.checkpoint()["claims"] and sim_node.cdi_files() == []
    sim_node.prepare_ok(ref)  # the kubelet's retry now succeeds
    assert mignode.placements(sim_node) == [(4, 4, 0)]
    assert sim_node.unprepare(ref) == {ref.uid: None}
    assert mignode.instances(sim_node) == []


def test_kill_9_after_the_create_before_completion_is_rolled_back_at_restart(sim_node: SimulatedNode) -> None:
    # The MPS daemon stand-in hangs at its start: the instance exists and is recorded, the claim is not complete.
    start(sim_node, env={"TESSERA_SIM_MPS_FAIL": "hang"})
    ref = sim_node.claim("c", [("mig", THREE_G)], configs=[mig_mps_config()])
    daemon_pid = kill_9_while_daemon_starts(sim_node, ref)
    assert sim_node.checkpoint()["claims"][ref.uid]["devices"][0]["mig_gi_id"] is not None
    assert mignode.placements(sim_node) == [(4, 4, 0)]
    restart(sim_node, env={"TESSERA_SIM_MPS_FAIL": ""})
    wait_until(lambda: not pid_alive(daemon_pid), what="the leaked daemon to be stopped")
    assert mignode.instances(sim_node) == [] and ref.uid not in sim_node.checkpoint()["claims"]
    sim_node.prepare_ok(ref)
    assert mignode.placements(sim_node) == [(4, 4, 0)]


def test_a_reboot_recreates_prepared_claims_instances_before_the_driver_serves(sim_node: SimulatedNode) -> None:
    start(sim_node)
    refs = [sim_node.claim("a", [("mig", TWO_G)]), sim_node.claim("b", [("mig", ONE_G)])]
    answers = {r.uid: sim_node.prepare_ok(r) for r in refs}
    before = {r.uid: sim_node.checkpoint()["claims"][r.uid]["devices"][0] for r in refs}
    sim_node.stop()
    # The reboot: instances gone, /var/run/cdi (a tmpfs) empty, a new boot ID; then, before the driver is back,
    # someone creates a 1g.10gb at 0, which takes GPU instance id 1 (a claim's before the reboot).
    engine = mignode.engine(sim_node)
    engine.reboot()
    mignode.set_boot_id(sim_node, "boot-2")
    for spec in sim_node.cdi_dir.glob("k8s.*.json"):
        spec.unlink()
    one_g = next(p for p in sim_node.inventory.gpus[0].mig_profiles if p.name == "1g.10gb")
    foreign = engine.create(sim_node.inventory.gpus[0].uuid, one_g, 0)
    assert foreign.gi_id in {before[r.uid]["mig_gi_id"] for r in refs}
    restart(sim_node)
    log = sim_node.log()
    created = [i for i, e in enumerate(log) if e.get("msg") == "MIG device created for a claim"]
    started = max(i for i, e in enumerate(log) if e.get("msg") == "driver started")
    assert len(created) == 4 and created[-1] < started, "re-created during recovery, before the driver serves"
    assert mignode.placements(sim_node) == [(0, 1, 0), (2, 2, 0), (6, 1, 0)]
    after = {r.uid: sim_node.checkpoint()["claims"][r.uid]["devices"][0] for r in refs}
    assert foreign.gi_id not in {a["mig_gi_id"] for a in after.values()}
    assert any(after[r.uid]["mig_uuid"] != before[r.uid]["mig_uuid"] for r in refs), "new ids, new MIG UUIDs"
    for ref in refs:
        assert after[ref.uid]["dynamic_mig"] == before[ref.uid]["dynamic_mig"], "the same profile and placement"
        spec = json.loads(sim_node.cdi_spec(ref.uid).read_text())
        assert spec["devices"][0]["annotations"][f"{DRIVER}/mig-uuid"] == after[ref.uid]["mig_uuid"], "rewritten"
        assert sim_node.prepare_ok(ref).devices == answers[ref.uid].devices
        assert sim_node.unprepare(ref) == {ref.uid: None}
    assert mignode.placements(sim_node) == [(0, 1, 0)], "the instance Tessera did not create stays"


def test_mps_serves_a_dynamic_mig_device_with_the_claims_limits(sim_node: SimulatedNode) -> None:
    start(sim_node)
    ref = sim_node.claim("c", [("mig", THREE_G)], configs=[mig_mps_config(defaultActiveThreadPercentage=40,
                                                                       defaultPinnedDeviceMemoryLimit="8Gi")])
    sim_node.prepare_ok(ref)
    mig_uuid = sim_node.checkpoint()["claims"][ref.uid]["devices"][0]["mig_uuid"]
    [daemon] = sim_node.checkpoint()["mps_daemons"].values()
    assert daemon["spec"]["gpu_uuids"] == [mig_uuid], "one daemon serving the created MIG device, by its UUID"
    commands = [json.loads(line) for line in (sim_node.state_dir / "mps" / daemon["spec"]["daemon_id"] / "log"
                                              / "commands.jsonl").read_text().splitlines()]
    sent = [" ".join([c["cmd"], *c.get("args", [])]) for c in commands]
    assert "set_default_active_thread_percentage 40" in sent
    assert "set_default_device_pinned_mem_limit 0 8192M" in sent
    env = json.loads(sim_node.cdi_spec(ref.uid).read_text())["devices"][0]["containerEdits"]["env"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40" in env
    assert sim_node.compute_mode(sim_node.inventory.gpus[0].uuid) == "DEFAULT", "a GPU in MIG mode stays in DEFAULT"
    log = sim_node.log()
    order = [e.get("msg") for e in log if e.get("msg") in ("MIG device created for a claim",
                                                           "MPS control daemon started")]
    assert order == ["MIG device created for a claim", "MPS control daemon started"]
    assert sim_node.unprepare(ref) == {ref.uid: None}
    order = [e.get("msg") for e in sim_node.log() if e.get("msg") in ("MPS control daemon stopped",
                                                                      "MIG device destroyed")]
    assert order == ["MPS control daemon stopped", "MIG device destroyed"], "the daemon stops before its instance"
    assert mignode.instances(sim_node) == []


def _xid_in_a_new_instance_taints_its_device_only(sim_node: SimulatedNode) -> None:
    """Prepare a 3g.40gb, report XID 94 inside its instance, and wait until that device alone is tainted."""
    ref = sim_node.claim("c", [("mig", THREE_G)])
    sim_node.prepare_ok(ref)
    mig_uuid = sim_node.checkpoint()["claims"][ref.uid]["devices"][0]["mig_uuid"]
    with sim_node.events_file.open("a") as handle:
        handle.write(json.dumps({"uuid": mig_uuid, "xid": 94}) + "\n")

    def tainted() -> dict[str, str]:
        return {d["name"]: d["taints"][0]["value"] for d in sim_node.devices() if d.get("taints")}

    wait_until(lambda: tainted() == {THREE_G: "xid-94"}, 30, f"only {THREE_G} tainted (have {tainted()})")


def test_a_health_event_on_a_dynamic_instance_taints_its_device_only(sim_node: SimulatedNode) -> None:
    start(sim_node)
    _xid_in_a_new_instance_taints_its_device_only(sim_node)
    other = sim_node.claim("d", [("mig", "gpu-0-dynmig-1g10gb-0")])
    sim_node.prepare_ok(other)  # the GPU's other placements stay usable


def test_a_created_instance_is_known_to_health_before_the_next_periodic_rescan(sim_node: SimulatedNode) -> None:
    """With a rescan due only in 10 minutes, the driver still rediscovers right after creating the instance,
    so an event in it taints its device alone (not, by its GPU, every placement of the GPU)."""
    sim_node.start("--rescan-interval", "600", env={"TESSERA_SIM_EVENTS": str(sim_node.events_file)})
    wait_until(lambda: THREE_G in sim_node.device_names(), 30, "the dynamic MIG placements published")
    _xid_in_a_new_instance_taints_its_device_only(sim_node)
