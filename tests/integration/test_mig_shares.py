"""Shares of MIG instances from the sharing plan, on the simulated ``demo`` node (an H100 in MIG mode with a
3g.40gb, a 2g.20gb and a 1g.10gb instance) through the real driver process and sockets: the plan time-slices the
1g.10gb instance and splits the 3g.40gb one into MPS shares; the 2g.20gb instance and the whole GPUs stay as they
are."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from driver.simulation.hostroot import CAPABILITIES_DIR
from tests.support.node import NODE, PLAN_LABEL, SimulatedNode, pid_alive, wait_until

PLANS: dict[str, Any] = {"plans": {"whole": {}, "mig": {"gpus": [
    {"match": {"migProfile": "1g.10gb"}, "timeSlicing": {"shares": 2}},
    {"match": {"product": "NVIDIA H100*", "migProfile": "3g.40gb"}, "mps": {"shares": 4, "activeThreadPercentage": 25}},
]}}}
MPS_SHARES = [f"gpu-1-mig-3g40gb-0-mps-{k}" for k in range(4)]
TS_SHARES = ["gpu-1-mig-1g10gb-6-ts-0", "gpu-1-mig-1g10gb-6-ts-1"]
PUBLISHED = ["gpu-0", *MPS_SHARES, "gpu-1-mig-2g20gb-4", *TS_SHARES, "gpu-2"]


@pytest.fixture
def mig_node() -> Iterator[SimulatedNode]:
    n = SimulatedNode("demo", plans=PLANS, plan="mig")
    try:
        yield n
    finally:
        n.close()


def visible_devices(pid: int) -> str | None:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    found = [e.split(b"=", 1)[1].decode() for e in environ if e.startswith(b"CUDA_VISIBLE_DEVICES=")]
    return found[0] if found else None


def instance(sim_node: SimulatedNode, profile: str) -> Any:
    return next(m for m in sim_node.inventory.gpus[1].mig_instances if m.profile == profile)


def cap_nodes(sim_node: SimulatedNode, gi: int, ci: int) -> list[dict[str, Any]]:
    """The GI and CI access capability nodes of an instance, as /proc on the (simulated) host gives them."""
    found = []
    for path in (f"gpu1/mig/gi{gi}/access", f"gpu1/mig/gi{gi}/ci{ci}/access"):
        text = (sim_node.host / CAPABILITIES_DIR / path).read_text()
        minor = int(next(line for line in text.splitlines() if line.startswith("DeviceFileMinor")).split(":")[1])
        found.append(minor)
    return [{"minor": m} for m in found]


def test_the_plan_publishes_each_matched_instance_as_its_shares_and_leaves_the_rest(mig_node: SimulatedNode) -> None:
    mig_node.start()
    mig_node.wait_for_devices(PUBLISHED)
    assert sorted(mig_node.device_names()) == sorted(PUBLISHED), "each shared instance's own MIG device is gone"
    by_name = {d["name"]: d for d in mig_node.devices()}
    share = by_name["gpu-1-mig-3g40gb-0-mps-1"]["attributes"]
    three_g = instance(mig_node, "3g.40gb")
    assert share["type"] == {"string": "mps"} and share["profile"] == {"string": "3g.40gb"}
    assert share["migUUID"] == {"string": three_g.uuid}
    assert share["parentUUID"] == {"string": mig_node.inventory.gpus[1].uuid}
    assert share["memoryLimitEnforcement"] == {"string": "mps-advisory"}
    assert by_name["gpu-1-mig-1g10gb-6-ts-0"]["attributes"]["type"] == {"string": "timeslice"}
    assert by_name["gpu-1-mig-2g20gb-4"]["attributes"]["type"] == {"string": "mig"}
    # An allocation naming the shared instance itself (stale, or forged into the claim's status) would hand the
    # whole instance out next to its shares: it is refused and leaves nothing behind.
    grab = mig_node.claim("grab", [("mig", "gpu-1-mig-1g10gb-6")])
    error = mig_node.prepare(grab)[grab.uid].error or ""
    assert "'gpu-1-mig-1g10gb-6' is not published by this node" in error
    assert mig_node.cdi_files() == [] and mig_node.checkpoint()["claims"] == {}


def test_shares_of_mig_instances_are_prepared_with_the_instance_and_unprepared(mig_node: SimulatedNode) -> None:
    mig_node.start()
    mig_node.wait_for_devices(PUBLISHED)
    ts = mig_node.claim("ts", [("slice", "gpu-1-mig-1g10gb-6-ts-1")])
    mps = mig_node.claim("mps", [("share", "gpu-1-mig-3g40gb-0-mps-2")])
    mig_node.prepare_ok(ts)
    mig_node.prepare_ok(mps)

    one_g, three_g = instance(mig_node, "1g.10gb"), instance(mig_node, "3g.40gb")
    ts_device = json.loads(mig_node.cdi_spec(ts.uid).read_text())["devices"][0]
    nodes = ts_device["containerEdits"]["deviceNodes"]
    assert nodes[0] == {"path": "/dev/nvidia1"}
    assert [{"minor": n["minor"]} for n in nodes[1:]] == cap_nodes(mig_node, one_g.gi_id, one_g.ci_id)
    assert [n["type"] for n in nodes[1:]] == ["c", "c"], "the instance's GI and CI capability nodes"
    assert ts_device["annotations"]["gpu.tessera.dev/mig-uuid"] == one_g.uuid
    assert not any(e.startswith("CUDA_MPS") for e in ts_device["containerEdits"].get("env", []))

    mps_device = json.loads(mig_node.cdi_spec(mps.uid).read_text())["devices"][0]
    edits = mps_device["containerEdits"]
    assert [{"minor": n["minor"]} for n in edits["deviceNodes"][1:]] == cap_nodes(mig_node, three_g.gi_id,
                                                                                     three_g.ci_id)
    per_share_mib = three_g.memory_bytes // 4 // (1 << 20)
    assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={per_share_mib}M" in edits["env"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25" in edits["env"]

    cp = mig_node.checkpoint()
    [daemon] = cp["mps_daemons"].values()
    assert daemon["spec"]["gpu_uuids"] == [three_g.uuid]
    assert visible_devices(daemon["pid"]) == three_g.uuid, "the daemon sees the MIG instance only"
    sent = [" ".join([e["cmd"], *e["args"]]) for e in mig_node.journal() if "cmd" in e and e["pid"] == daemon["pid"]]
    assert "set_default_active_thread_percentage 25" in sent
    assert f"set_default_device_pinned_mem_limit 0 {per_share_mib}M" in sent, "limits relative to the instance"
    assert cp["compute_modes"] == {} and all(c["exclusive_gpus"] == [] for c in cp["claims"].values()), \
        "a GPU in MIG mode stays in compute mode DEFAULT"
    assert not any("compute-policy" in " ".join(call) for call in mig_node.nvidia_smi_calls()), "no time slice set"

    assert mig_node.unprepare(ts, mps) == {ts.uid: None, mps.uid: None}
    wait_until(lambda: not pid_alive(daemon["pid"]), what="the instance's daemon to stop after its last share")
    assert mig_node.cdi_files() == [] and mig_node.checkpoint()["claims"] == {}
    assert mig_node.checkpoint()["mps_daemons"] == {}


def test_a_held_instance_keeps_its_shares_through_a_plan_change_and_a_lost_checkpoint(mig_node: SimulatedNode) -> None:
    mig_node.start()
    mig_node.wait_for_devices(PUBLISHED)
    ref = mig_node.claim("mps", [("share", "gpu-1-mig-3g40gb-0-mps-0")])
    mig_node.prepare_ok(ref)
    [(daemon_id, daemon)] = mig_node.checkpoint()["mps_daemons"].items()
    mig_node.stop()
    # A lost checkpoint is rebuilt from the CDI specs: the instance's form comes back under its MIG UUID.
    (mig_node.state_dir / "checkpoint.json").write_text('{"version": 1, "checksum": "sha256:00", "data": {"cla')
    mig_node.start()
    cp = mig_node.checkpoint()
    three_g = instance(mig_node, "3g.40gb")
    assert cp["mps_daemons"][daemon_id]["pid"] == daemon["pid"], "the live daemon adopted"
    assert cp["layout"][three_g.uuid]["mig_profile"] == "3g.40gb"
    assert cp["claims"][ref.uid]["exclusive_gpus"] == [] and cp["compute_modes"] == {}
    mig_node.wait_for_devices(PUBLISHED)

    mig_node.api.set_node_labels(NODE, {PLAN_LABEL: "whole"})
    # The 1g.10gb instance, which no claim holds, goes back to its MIG device; the held 3g.40gb keeps its shares.
    mig_node.wait_for_devices(["gpu-0", *MPS_SHARES, "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6", "gpu-2"])
    assert any("deferred" in str(e.get("msg")) for e in mig_node.log())
    assert mig_node.unprepare(ref) == {ref.uid: None}
    wait_until(lambda: not pid_alive(daemon["pid"]), what="the daemon to stop")
    mig_node.wait_for_devices(["gpu-0", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6", "gpu-2"])
