"""MPS and health on dynamic MIG devices, through the real driver process and the MPS stand-in: the claim's daemon
must follow an instance made again to its new MIG UUID, not go on serving the old one; an XID NVML scopes to an
instance made since the driver's last rescan reaches only that instance, not every device of its GPU.

The node is the simulated ``dynamic-mig`` layout (``test_dynamic_mig_prepare.py``); the test destroys the claim's
instance as ``nvidia-smi mig -dci``/``-dgi`` would, through the simulated NVML the driver uses.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import mignode
from tests.support.mignode import mig_mps_config
from tests.support.node import SimulatedNode, pid_alive, wait_until

PLANS = {"defaultPlan": "p", "plans": {"p": {"gpus": [{"match": {"minor": 0}, "dynamicMig": {}}]}}}
THREE_G = "gpu-0-dynmig-3g40gb-4"


@pytest.fixture
def sim_node() -> Iterator[SimulatedNode]:
    with mignode.dynamic_mig_node(PLANS) as n:
        yield n


def visible_devices(pid: int) -> str | None:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    found = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"CUDA_VISIBLE_DEVICES=")]
    return found[0] if found else None


def test_a_daemon_follows_its_instance_made_again_without_a_reboot(sim_node: SimulatedNode) -> None:
    sim_node.start()
    wait_until(lambda: THREE_G in sim_node.device_names(), 30, "the dynamic MIG placements published")
    ref = sim_node.claim("c", [("mig", THREE_G)], configs=[mig_mps_config(defaultActiveThreadPercentage=40,
                                                                       defaultPinnedDeviceMemoryLimit="8Gi")])
    answer = sim_node.prepare_ok(ref)
    before = sim_node.checkpoint()
    old_uuid = before["claims"][ref.uid]["devices"][0]["mig_uuid"]
    [old] = before["mps_daemons"].values()
    assert visible_devices(old["pid"]) == old_uuid
    # Someone destroys the claim's instance behind the driver's back (no client was connected to the daemon,
    # so NVML lets it go); the kubelet's next prepare of the claim makes it again, with a new MIG UUID.
    engine = mignode.engine(sim_node)
    [made] = engine.instances(sim_node.inventory.gpus[0].uuid)
    engine.destroy(sim_node.inventory.gpus[0].uuid, made.gi_id, made.ci_id)
    assert sim_node.prepare_ok(ref).devices == answer.devices
    after = sim_node.checkpoint()
    new_uuid = after["claims"][ref.uid]["devices"][0]["mig_uuid"]
    assert new_uuid != old_uuid
    [daemon] = after["mps_daemons"].values()
    assert daemon["spec"]["gpu_uuids"] == [new_uuid]
    assert pid_alive(daemon["pid"]) and visible_devices(daemon["pid"]) == new_uuid, \
        "the daemon recorded for the claim serves the re-created instance, not the destroyed one"
    assert daemon["pid"] != old["pid"] and not pid_alive(old["pid"]), "the daemon on the old UUID was stopped"
    commands = [json.loads(line) for line in (Path(daemon["log_dir"]) / "commands.jsonl").read_text().splitlines()]
    sent = [" ".join([c["cmd"], *c.get("args", [])]) for c in commands]
    assert sent.count("set_default_device_pinned_mem_limit 0 8192M") == 2, "limits set again on the new daemon"
    assert sim_node.unprepare(ref) == {ref.uid: None}
    assert mignode.placements(sim_node) == [] and not pid_alive(daemon["pid"])


def inject(sim_node: SimulatedNode, **event: Any) -> None:
    with sim_node.events_file.open("a") as handle:
        handle.write(json.dumps(event) + "\n")


def tainted(sim_node: SimulatedNode) -> dict[str, str]:
    return {d["name"]: d["taints"][0]["value"] for d in sim_node.devices() if d.get("taints")}


def test_an_xid_in_an_instance_made_since_the_last_rescan_reaches_only_that_instance(sim_node: SimulatedNode) -> None:
    sim_node.start("--rescan-interval", "3600", env={"TESSERA_SIM_EVENTS": str(sim_node.events_file)})
    wait_until(lambda: THREE_G in sim_node.device_names(), 30, "the dynamic MIG placements published")
    ref = sim_node.claim("c", [("mig", THREE_G)])
    sim_node.prepare_ok(ref)
    claimed = sim_node.checkpoint()["claims"][ref.uid]["devices"][0]
    gpu = sim_node.inventory.gpus[0]
    one_g = next(p for p in gpu.mig_profiles if p.name == "1g.10gb")
    other = mignode.engine(sim_node).create(gpu.uuid, one_g, 0)  # another tool; the driver rescans an hour later

    inject(sim_node, uuid=gpu.uuid, xid=94, gpu_instance=other.gi_id, compute_instance=other.ci_id)
    inject(sim_node, uuid=gpu.uuid, xid=95, gpu_instance=claimed["mig_gi_id"])  # the claim's instance, after it
    wait_until(lambda: THREE_G in tainted(sim_node), 10, f"the claim's instance tainted (have {tainted(sim_node)})")
    assert tainted(sim_node) == {THREE_G: "xid-95"}, "the other instance's XID 94 reached no device of the GPU"
    unhealthy = {e["uuid"]: e["reason"] for e in sim_node.log() if e.get("msg") == "device became unhealthy"}
    assert unhealthy == {other.uuid: "xid-94", claimed["mig_uuid"]: "xid-95"}
