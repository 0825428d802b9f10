"""What the driver costs the API server, and what writing claim status costs a prepare; used by benchmark.py.

Counted by the API server double (SIMULATION) around the real driver process:
  * requests per node at idle, over a window, and the steady rate the watches' own timeouts give (each watch
    lasts 5 to 10 minutes and is opened again at its end), scaled to 5,000 nodes;
  * requests per prepare+unprepare cycle: a whole GPU, and a plan MPS share reserved for a pod (whose pod is read
    to check it cannot control the shared daemon);
  * sequential prepare latency with status writes, and with a server that refuses them (the writer stops after
    the first refusal, so no status write happens): the writes are asynchronous and should not show.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from driver.kubeletplugin.types import ClaimRef
from tests.support.node import NO_ESCALATION, NON_ROOT, SimulatedNode, pod, wait_until

NODES_AT_SCALE = 5000
PLANS: dict[str, Any] = {"plans": {"mps": {"gpus": [{"match": {"minor": 7}, "mps": {"shares": 2}}]}}}


@dataclass
class ApiLoad:
    idle_window_s: float
    idle_requests: int
    watch_timeouts_s: list[int]
    per_cycle: dict[str, Counter[str]]

    @property
    def steady_per_minute(self) -> float:
        """Watches re-opened per minute: each of the open watches once per its mean timeout."""
        if not self.watch_timeouts_s:
            return 0.0
        return 2 * 60.0 / statistics.mean(self.watch_timeouts_s)


def _entries(node: SimulatedNode, ref: ClaimRef) -> list[Any]:
    claim = next(c for c in node.api.claims() if c["metadata"]["uid"] == ref.uid)
    return list((claim.get("status") or {}).get("devices") or [])


def _cycle(node: SimulatedNode, ref: ClaimRef) -> Counter[str]:
    before = len(node.api.requests)
    node.prepare_ok(ref)
    wait_until(lambda: bool(_entries(node, ref)), what="the claim's status entry")
    assert node.unprepare(ref) == {ref.uid: None}
    wait_until(lambda: not _entries(node, ref), what="the claim's status entry removed")
    return Counter(f"{verb} {_resource(path)}" for verb, path in node.api.requests[before:])


def _resource(path: str) -> str:
    """``resourceclaims``, ``resourceclaims/status`` or ``pods`` of a request's path."""
    parts = path.split("/")
    return f"{parts[-3]}/status" if parts[-1] == "status" else parts[-2]


def api_load(python: str, idle_seconds: float, rescan: tuple[str, ...]) -> ApiLoad:
    node = SimulatedNode("dgx-h100", plans=PLANS, plan="mps", python=python)
    try:
        node.start(*rescan)
        node.wait_for_devices([f"gpu-{i}" for i in range(7)] + ["gpu-7-mps-0", "gpu-7-mps-1"])
        time.sleep(5)  # the start's own work (the multi-user probe, its republish) settles
        before = len(node.api.requests)
        time.sleep(idle_seconds)
        idle = len(node.api.requests) - before
        watches = [int(q["timeoutSeconds"]) for verb, _, q in node.api.request_queries if verb == "WATCH"]
        whole = node.claim("whole", [("gpu", "gpu-0")])
        user = pod("p", pod_security=NON_ROOT, containers=[("main", NO_ESCALATION)])
        share = node.claim("share", [("gpu", "gpu-7-mps-0")], pods=[user])
        cycles = {"whole GPU": _cycle(node, whole), "plan MPS share": _cycle(node, share)}
    finally:
        node.close()
    return ApiLoad(idle_seconds, idle, watches, cycles)


def prepare_latency(python: str, claims: int, rescan: tuple[str, ...], *, status_writes: bool) -> list[float]:
    """Sequential prepare times of whole-GPU claims (their unprepare between them, not timed)."""
    node = SimulatedNode("dgx-h100", python=python)
    if not status_writes:
        node.api.refuse_claim_status(403)
    try:
        node.start(*rescan)
        node.wait_for_devices([f"gpu-{i}" for i in range(8)])
        refs = [node.claim(f"c{i}", [("gpu", "gpu-0")]) for i in range(claims + 10)]
        times = []
        for i, ref in enumerate(refs):
            start = time.perf_counter()
            node.prepare_ok(ref)
            if i >= 10:  # warm-up: connections, the driver's first calls
                times.append(time.perf_counter() - start)
            assert node.unprepare(ref) == {ref.uid: None}
    finally:
        node.close()
    return times


def rows(load: ApiLoad, with_writes: list[float], without: list[float]) -> list[tuple[str, str, str, str, str]]:
    """benchmark.py's table rows."""
    ms = 1000.0

    def p(values: list[float], q: int) -> float:
        return statistics.quantiles(values, n=100)[q - 1] if len(values) > 1 else values[0]

    steady = load.steady_per_minute
    out = [
        (f"API requests at idle, {load.idle_window_s:.0f} s window", str(load.idle_requests), "", "",
         "none expected: the Node and the slices are watched, nothing is polled"),
        ("API requests per minute per node, steady", f"{steady:.2f}", "", "",
         f"<= 2: {'met' if steady <= 2 else 'NOT met'} (2 watches, each {min(load.watch_timeouts_s, default=0)}-"
         f"{max(load.watch_timeouts_s, default=0)} s)"),
        (f"... on {NODES_AT_SCALE} nodes", f"{steady * NODES_AT_SCALE / 60:.0f}/s", "", "",
         "watch re-opens, no list, no Node object"),
    ]
    for name, counted in load.per_cycle.items():
        detail = ", ".join(f"{k} x{n}" for k, n in sorted(counted.items()))
        out.append((f"API requests per prepare+unprepare, {name}", str(sum(counted.values())), "", "", detail))
    if with_writes and without:
        out += [
            ("sequential prepare p50, status writes on", f"{p(with_writes, 50) * ms:.2f} ms",
             f"{p(without, 50) * ms:.2f} ms", f"{p(with_writes, 50) / p(without, 50):.2f}x",
             "floor column: no status writes (server refuses them)"),
            ("sequential prepare p99, status writes on", f"{p(with_writes, 99) * ms:.2f} ms",
             f"{p(without, 99) * ms:.2f} ms", f"{p(with_writes, 99) / p(without, 99):.2f}x", ""),
        ]
    return out
