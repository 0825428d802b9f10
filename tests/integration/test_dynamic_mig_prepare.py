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
def node() -> Iterator[SimulatedNode]:
    with mignode.dynamic_mig_node(PLANS) as n:
        yield n


def start(node: SimulatedNode, env: dict[str, str] | None = None) -> None:
    node.start(env={"TESSERA_SIM_EVENTS": str(node.events_file), **(env or {})})
    wait_until(lambda: THREE_G in node.device_names(), 30, "the dynamic MIG placements published")


def logged(node: SimulatedNode, msg: str) -> list[dict[str, Any]]:
    return [e for e in node.log() if e.get("msg") == msg]


def restart(node: SimulatedNode, env: dict[str, str] | None = None) -> None:
    """Restart the driver and wait until it serves: it registers first and recovers behind the open sockets."""
    runs = len(logged(node, "driver started"))
    node.restart(env={"TESSERA_SIM_EVENTS": str(node.events_file), **(env or {})})
    wait_until(lambda: len(logged(node, "driver started")) > runs, 30, "the restarted driver to serve")


def spec_nodes(node: SimulatedNode, uid: str) -> list[str]:
    spec = json.loads(node.cdi_spec(uid).read_text())
    return [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]


def test_prepare_creates_the_instance_and_unprepare_destroys_it(node: SimulatedNode) -> None:
    start(node)
    ref = node.claim("c", [("mig", THREE_G)])
    first = node.prepare_ok(ref)
    [gi] = mignode.instances(node)
    assert (gi["placement_start"], gi["placement_size"], gi["ci_id"]) == (4, 4, 0)
    assert mignode.proc_caps(node) == [f"gi{gi['gi_id']}/access", f"gi{gi['gi_id']}/ci0/access"]
    [record] = node.checkpoint()["claims"].values()
    [dev] = record["devices"]
    assert (dev["mig_gi_id"], dev["mig_ci_id"], dev["mig_uuid"]) == (gi["gi_id"], 0, gi["uuid"])
    assert dev["dynamic_mig"]["profile"] == "3g.40gb" and dev["dynamic_mig"]["placement_start"] == 4
    assert spec_nodes(node, ref.uid)[0] == "/dev/nvidia0" and len(spec_nodes(node, ref.uid)) == 3
    assert node.prepare_ok(ref).devices == first.devices, "a repeated prepare: the same answer, nothing created"
    assert len(mignode.instances(node)) == 1
    assert node.unprepare(ref) == {ref.uid: None}
    assert mignode.instances(node) == [] and mignode.proc_caps(node) == []
    assert node.cdi_files() == [] and node.checkpoint()["claims"] == {}


def test_an_nvml_refusal_is_the_claims_error_and_leaves_nothing(node: SimulatedNode) -> None:
    start(node)
    engine = mignode.engine(node)
    engine.inject_failure("create-ci", placement=4)
    ref = node.claim("c", [("mig", THREE_G)])
    error = node.prepare(ref)[ref.uid].error
    assert error is not None
    gpu = node.inventory.gpus[0]
    assert "3g.40gb at placement 4" in error and f"GPU 0 ({gpu.uuid})" in error and THREE_G in error
    assert mignode.instances(node) == [] and node.cdi_files() == [] and node.checkpoint()["claims"] == {}
    node.prepare_ok(ref)  # the kubelet's retry
    assert mignode.placements(node) == [(4, 4, 0)]


def test_someone_elses_instance_in_the_way_is_named_and_never_touched(node: SimulatedNode) -> None:
    start(node)
    one_g = next(p for p in node.inventory.gpus[0].mig_profiles if p.name == "1g.10gb")
    mignode.engine(node).create(node.inventory.gpus[0].uuid, one_g, 5)
    ref = node.claim("c", [("mig", THREE_G)])
    error = node.prepare(ref)[ref.uid].error
    assert error is not None and "1g.10gb at placement 5" in error and "Tessera did not create" in error
    assert mignode.placements(node) == [(5, 1, 0)]
    assert node.cdi_files() == [] and node.checkpoint()["claims"] == {}


@pytest.mark.parametrize(("profile", "start_slice", "size", "whole"), [
    ("3g.40gb", 4, 4, False),  # a placement
    ("7g.80gb", 0, 8, True),  # the whole device of a dynamic GPU: its full-size profile at 0
])
def test_a_claim_for_a_placement_is_never_given_an_instance_someone_else_made_there(
        node: SimulatedNode, profile: str, start_slice: int, size: int, whole: bool) -> None:
    """The attacker: a process on the node creates a MIG instance exactly at the placement of a claim that is
    allocated but not yet prepared, and the driver's rescan publishes the GPU as that static MIG device. The
    claim asked for an instance of its own: handing it the other instance (another workload's) would put two
    tenants in one MIG instance. It is refused, and the other instance is left alone."""
    start(node)
    attrs = {d["name"]: d.get("attributes", {}) for d in node.devices()}
    stale = "gpu-0" if whole else next(name for name, a in attrs.items()
                                       if a.get("placement") == {"int": start_slice}
                                       and a.get("profile") == {"string": profile})
    ref = node.claim("c", [("gpu" if whole else "mig", stale)])
    gpu = node.inventory.gpus[0]
    made = next(p for p in gpu.mig_profiles if p.name == profile)
    foreign = mignode.engine(node).create(gpu.uuid, made, start_slice)
    wait_until(lambda: any(d.get("attributes", {}).get("uuid") == {"string": foreign.uuid} for d in node.devices()),
               30, "the other instance published as a static MIG device")
    error = node.prepare(ref)[ref.uid].error
    assert error is not None and stale in error
    assert mignode.placements(node) == [(start_slice, size, 0)], "the other instance is never touched"
    assert node.cdi_files() == [] and node.checkpoint()["claims"] == {}


@pytest.mark.parametrize(("call", "effect", "left"), [
    ("create-gi", "hang", []),  # between the intent and the creation: nothing made yet
    ("create-ci", "hang", [(4, 4, None)]),  # the GPU instance made, not its compute instance
    ("create-ci", "hang-after", [(4, 4, 0)]),  # the MIG device made, its ids not yet recorded
])
def test_kill_9_during_the_create_leaves_nothing_after_restart(node: SimulatedNode, call: FaultCall,
                                                              effect: FaultEffect,
                                                              left: list[tuple[int, int, int | None]]) -> None:
    start(node)
    mignode.engine(node).inject_failure(call, placement=4, effect=effect)
    ref = node.claim("c", [("mig", THREE_G)])

    def prepare_until_killed() -> None:
        with contextlib.suppress(grpc.RpcError):  # the driver dies under this call
            node.prepare(ref)

    thread = threading.Thread(target=prepare_until_killed, daemon=True)
    thread.start()
    wait_until(lambda: bool(logged(node, "SIMULATION: MIG create hangs (injected)")), 30, "the create to hang")
    intent = node.checkpoint()["claims"][ref.uid]
    assert intent["phase"] == "PrepareStarted" and intent["devices"][0]["dynamic_mig"]["create_started"]
    assert intent["devices"][0]["mig_gi_id"] is None
    node.kill9()
    thread.join(timeout=30)
    assert mignode.placements(node) == left

    restart(node)
    assert mignode.instances(node) == [] and mignode.proc_caps(node) == []
    assert ref.uid not in node.checkpoint()["claims"] and node.cdi_files() == []
    node.prepare_ok(ref)  # the kubelet's retry now succeeds
    assert mignode.placements(node) == [(4, 4, 0)]
    assert node.unprepare(ref) == {ref.uid: None}
    assert mignode.instances(node) == []


def test_kill_9_after_the_create_before_completion_is_rolled_back_at_restart(node: SimulatedNode) -> None:
    # The MPS daemon stand-in hangs at its start: the instance exists and is recorded, the claim is not complete.
    start(node, env={"TESSERA_SIM_MPS_FAIL": "hang"})
    ref = node.claim("c", [("mig", THREE_G)], configs=[mig_mps_config()])
    daemon_pid = kill_9_while_daemon_starts(node, ref)
    assert node.checkpoint()["claims"][ref.uid]["devices"][0]["mig_gi_id"] is not None
    assert mignode.placements(node) == [(4, 4, 0)]
    restart(node, env={"TESSERA_SIM_MPS_FAIL": ""})
    wait_until(lambda: not pid_alive(daemon_pid), what="the leaked daemon to be stopped")
    assert mignode.instances(node) == [] and ref.uid not in node.checkpoint()["claims"]
    node.prepare_ok(ref)
    assert mignode.placements(node) == [(4, 4, 0)]


def test_a_reboot_recreates_prepared_claims_instances_before_the_driver_serves(node: SimulatedNode) -> None:
    start(node)
    refs = [node.claim("a", [("mig", TWO_G)]), node.claim("b", [("mig", ONE_G)])]
    answers = {r.uid: node.prepare_ok(r) for r in refs}
    before = {r.uid: node.checkpoint()["claims"][r.uid]["devices"][0] for r in refs}
    node.stop()
    # The reboot: instances gone, /var/run/cdi (a tmpfs) empty, a new boot ID; then, before the driver is back,
    # someone creates a 1g.10gb at 0, which takes GPU instance id 1 (a claim's before the reboot).
    engine = mignode.engine(node)
    engine.reboot()
    mignode.set_boot_id(node, "boot-2")
    for spec in node.cdi_dir.glob("k8s.*.json"):
        spec.unlink()
    one_g = next(p for p in node.inventory.gpus[0].mig_profiles if p.name == "1g.10gb")
    foreign = engine.create(node.inventory.gpus[0].uuid, one_g, 0)
    assert foreign.gi_id in {before[r.uid]["mig_gi_id"] for r in refs}
    restart(node)
    log = node.log()
    created = [i for i, e in enumerate(log) if e.get("msg") == "MIG device created for a claim"]
    started = max(i for i, e in enumerate(log) if e.get("msg") == "driver started")
    assert len(created) == 4 and created[-1] < started, "re-created during recovery, before the driver serves"
    assert mignode.placements(node) == [(0, 1, 0), (2, 2, 0), (6, 1, 0)]
    after = {r.uid: node.checkpoint()["claims"][r.uid]["devices"][0] for r in refs}
    assert foreign.gi_id not in {a["mig_gi_id"] for a in after.values()}
    assert any(after[r.uid]["mig_uuid"] != before[r.uid]["mig_uuid"] for r in refs), "new ids, new MIG UUIDs"
    for ref in refs:
        assert after[ref.uid]["dynamic_mig"] == before[ref.uid]["dynamic_mig"], "the same profile and placement"
        spec = json.loads(node.cdi_spec(ref.uid).read_text())
        assert spec["devices"][0]["annotations"][f"{DRIVER}/mig-uuid"] == after[ref.uid]["mig_uuid"], "rewritten"
        assert node.prepare_ok(ref).devices == answers[ref.uid].devices
        assert node.unprepare(ref) == {ref.uid: None}
    assert mignode.placements(node) == [(0, 1, 0)], "the instance Tessera did not create stays"


def test_mps_serves_a_dynamic_mig_device_with_the_claims_limits(node: SimulatedNode) -> None:
    start(node)
    ref = node.claim("c", [("mig", THREE_G)], configs=[mig_mps_config(defaultActiveThreadPercentage=40,
                                                                       defaultPinnedDeviceMemoryLimit="8Gi")])
    node.prepare_ok(ref)
    mig_uuid = node.checkpoint()["claims"][ref.uid]["devices"][0]["mig_uuid"]
    [daemon] = node.checkpoint()["mps_daemons"].values()
    assert daemon["spec"]["gpu_uuids"] == [mig_uuid], "one daemon serving the created MIG device, by its UUID"
    commands = [json.loads(line) for line in (node.state_dir / "mps" / daemon["spec"]["daemon_id"] / "log"
                                              / "commands.jsonl").read_text().splitlines()]
    sent = [" ".join([c["cmd"], *c.get("args", [])]) for c in commands]
    assert "set_default_active_thread_percentage 40" in sent
    assert "set_default_device_pinned_mem_limit 0 8192M" in sent
    env = json.loads(node.cdi_spec(ref.uid).read_text())["devices"][0]["containerEdits"]["env"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=40" in env
    assert node.compute_mode(node.inventory.gpus[0].uuid) == "DEFAULT", "a GPU in MIG mode stays in DEFAULT"
    log = node.log()
    order = [e.get("msg") for e in log if e.get("msg") in ("MIG device created for a claim",
                                                           "MPS control daemon started")]
    assert order == ["MIG device created for a claim", "MPS control daemon started"]
    assert node.unprepare(ref) == {ref.uid: None}
    order = [e.get("msg") for e in node.log() if e.get("msg") in ("MPS control daemon stopped", "MIG device destroyed")]
    assert order == ["MPS control daemon stopped", "MIG device destroyed"], "the daemon stops before its instance"
    assert mignode.instances(node) == []


def _xid_in_a_new_instance_taints_its_device_only(node: SimulatedNode) -> None:
    """Prepare a 3g.40gb, report XID 94 inside its instance, and wait until that device alone is tainted."""
    ref = node.claim("c", [("mig", THREE_G)])
    node.prepare_ok(ref)
    mig_uuid = node.checkpoint()["claims"][ref.uid]["devices"][0]["mig_uuid"]
    with node.events_file.open("a") as handle:
        handle.write(json.dumps({"uuid": mig_uuid, "xid": 94}) + "\n")

    def tainted() -> dict[str, str]:
        return {d["name"]: d["taints"][0]["value"] for d in node.devices() if d.get("taints")}

    wait_until(lambda: tainted() == {THREE_G: "xid-94"}, 30, f"only {THREE_G} tainted (have {tainted()})")


def test_a_health_event_on_a_dynamic_instance_taints_its_device_only(node: SimulatedNode) -> None:
    start(node)
    _xid_in_a_new_instance_taints_its_device_only(node)
    other = node.claim("d", [("mig", "gpu-0-dynmig-1g10gb-0")])
    node.prepare_ok(other)  # the GPU's other placements stay usable


def test_a_created_instance_is_known_to_health_before_the_next_periodic_rescan(node: SimulatedNode) -> None:
    """With a rescan due only in 10 minutes, the driver still rediscovers right after creating the instance,
    so an event in it taints its device alone (not, by its GPU, every placement of the GPU)."""
    node.start("--rescan-interval", "600", env={"TESSERA_SIM_EVENTS": str(node.events_file)})
    wait_until(lambda: THREE_G in node.device_names(), 30, "the dynamic MIG placements published")
    _xid_in_a_new_instance_taints_its_device_only(node)
