"""What the real driver process costs the API server, counted by the API server double: at idle nothing but
long watches (never a GET of the whole Node), per prepare+unprepare cycle the claim, its pods where admission
reads them and one status write and its removal; and a plan label change still takes effect at once."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from driver.gpu.published.planuse import PLAN_USE_FILE
from tests.support.node import NO_ESCALATION, NODE, NON_ROOT, PLAN_LABEL, SimulatedNode, pod, wait_until

PLANS: dict[str, Any] = {"plans": {
    "whole": {},
    "mps": {"gpus": [{"match": {"product": "NVIDIA L4"}, "mps": {"shares": 2, "activeThreadPercentage": 50}}]},
}}
MIG = ["gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6"]
SHARES = ["gpu-2-mps-0", "gpu-2-mps-1"]
NODES = "/api/v1/nodes"
SLICES = "/apis/resource.k8s.io/v1/resourceslices"
# The budget per node at idle, and the shortest watch that keeps within it with both watches (Node, slices).
IDLE_REQUESTS_PER_MINUTE = 2


def watching_both(sim_node: SimulatedNode) -> bool:
    """Whether the newest request on each of the Node and the slices is a watch (the driver settled)."""
    last = {path: verb for verb, path in sim_node.api.requests if path in (NODES, SLICES)}
    return last == {NODES: "WATCH", SLICES: "WATCH"}


def rescans(path: Path, count: int) -> None:
    """Wait for ``count`` more rescans: each replaces the plan-use file (a new inode)."""
    seen: list[int] = []

    def another() -> bool:
        try:
            inode = os.stat(path).st_ino
        except FileNotFoundError:
            return False
        if not seen or seen[-1] != inode:
            seen.append(inode)
        return len(seen) > count

    wait_until(another, what=f"{count} rescans")


def settle(sim_node: SimulatedNode) -> None:
    """Wait until two rescans in a row sent nothing and the driver watches its Node and slices."""
    for _ in range(20):
        wait_until(lambda: watching_both(sim_node), what="the driver watching its Node and slices")
        before = len(sim_node.api.requests)
        rescans(sim_node.state_dir / PLAN_USE_FILE, 2)
        if len(sim_node.api.requests) == before:
            return
    raise AssertionError("the driver never went idle")


def test_idle_costs_only_long_watches_and_a_cycle_costs_the_claim_its_pod_and_two_status_writes() -> None:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="mps")
    try:
        sim_node.start()
        sim_node.wait_for_devices(["gpu-0", *MIG, *SHARES])
        settle(sim_node)  # the start's own work (the multi-user probe republishes once) is done
        before = len(sim_node.api.requests)
        rescans(sim_node.state_dir / PLAN_USE_FILE, 3)  # three full rescans of GPUs and the plan (0.5 s apart here)
        idle = sim_node.api.request_queries[before:]
        assert idle == [], f"an idle node sent {idle}"
        everything = sim_node.api.request_queries
        assert not [r for r in everything if r[1].startswith(NODES + "/")], "never a GET of the whole Node"
        watches = [q for verb, _, q in everything if verb == "WATCH"]
        assert all(q["allowWatchBookmarks"] == "true" and q["resourceVersion"] for q in watches)
        shortest = min(int(q["timeoutSeconds"]) for q in watches)
        assert 2 * 60 / shortest <= IDLE_REQUESTS_PER_MINUTE, f"two watches of {shortest}s each"
        node_reads = [q for verb, path, q in everything if path == NODES]
        assert all(q["fieldSelector"] == f"metadata.name={NODE}" for q in node_reads)

        user = pod("p", pod_security=NON_ROOT, containers=[("main", NO_ESCALATION)])
        ref = sim_node.claim("cycle", [("gpu", "gpu-2-mps-0")], pods=[user])
        before = len(sim_node.api.requests)
        sim_node.prepare_ok(ref)
        wait_until(lambda: (next(c for c in sim_node.api.claims() if c["metadata"]["uid"] == ref.uid)
                            .get("status", {}).get("devices")), what="the claim's status entry")
        assert sim_node.unprepare(ref) == {ref.uid: None}
        wait_until(lambda: not (next(c for c in sim_node.api.claims() if c["metadata"]["uid"] == ref.uid)
                                .get("status", {}).get("devices")), what="the entry removed")
        cycle = sorted(sim_node.api.requests[before:])
        claim_path = f"/apis/resource.k8s.io/v1/namespaces/default/resourceclaims/{ref.name}"
        assert cycle == sorted([("GET", claim_path), ("GET", "/api/v1/namespaces/default/pods/p"),
                                ("PATCH", claim_path + "/status"), ("PATCH", claim_path + "/status")])
    finally:
        sim_node.close()


def test_a_plan_label_change_takes_effect_at_once_through_the_node_watch() -> None:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="mps")
    try:
        # A rescan every 10 minutes: only the watch can make the change take effect within the test's wait.
        sim_node.start("--rescan-interval", "600")
        sim_node.wait_for_devices(["gpu-0", *MIG, *SHARES])
        wait_until(lambda: watching_both(sim_node), what="the driver watching its Node and slices")
        before = len(sim_node.api.requests)
        sim_node.api.set_node_labels(NODE, {PLAN_LABEL: "whole"})
        sim_node.wait_for_devices(["gpu-0", *MIG, "gpu-2"])
        assert not [r for r in sim_node.api.requests[before:] if r[1].startswith(NODES)], "the open watch told it"
    finally:
        sim_node.close()
