"""What the driver costs the API server, and what writing claim status costs a prepare; used by benchmark.py.

Counted by the API server double (SIMULATION) around the real driver process:
  * requests per node at idle, over a window, and the steady rate the watches' own timeouts give (each watch
    lasts 5 to 10 minutes and is opened again at its end), scaled to 5,000 nodes;
  * requests per prepare+unprepare cycle: a whole GPU, and a plan MPS share reserved for a pod (whose pod is read
    to check it cannot control the shared daemon);
  * sequential prepare latency with status writes, and with a server that refuses them (the writer stops after
    the first refusal, so no status write happens), in alternating runs: the writes are asynchronous and should
    not show, though here the API server double shares the benchmark's process (and its GIL) with the kubelet
    stand-in that times the prepares, so its handling of the writes counts against them.
"""

from __future__ import annotations

import os
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
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


@dataclass
class Latency:
    prepare_s: list[float]
    driver_cpu_per_cycle_s: float


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def prepare_latency(python: str, claims: int, rescan: tuple[str, ...], *, status_writes: bool) -> Latency:
    """Sequential prepare times of whole-GPU claims (their unprepare between them, not timed), and the driver's
    CPU per prepare+unprepare cycle (status writes included, once they are done)."""
    node = SimulatedNode("dgx-h100", python=python)
    if not status_writes:
        node.api.refuse_claim_status(403)
    try:
        node.start(*rescan)
        node.wait_for_devices([f"gpu-{i}" for i in range(8)])
        refs = [node.claim(f"c{i}", [("gpu", "gpu-0")]) for i in range(claims + 10)]
        times = []
        assert node.proc is not None
        cpu = 0.0
        for i, ref in enumerate(refs):
            if i == 10:  # after the warm-up: connections, the driver's first calls
                cpu = _cpu_seconds(node.proc.pid)
            start = time.perf_counter()
            answer = node.kubelet.prepare([ref])[ref.uid]  # straight to the stand-in, as benchmark.py times
            assert answer.error is None, answer.error
            if i >= 10:
                times.append(time.perf_counter() - start)
            assert node.unprepare(ref) == {ref.uid: None}
        if status_writes:
            wait_until(lambda: not _entries(node, refs[-1]), what="the last status write")
        cpu = _cpu_seconds(node.proc.pid) - cpu
    finally:
        node.close()
    return Latency(times, cpu / claims)


def alternating(python: str, claims: int, rescan: tuple[str, ...], runs: int = 4) -> tuple[Latency, Latency]:
    """Prepare latency with and without status writes, in alternating runs of ``claims / runs`` prepares each, so
    that a change of load on the machine during the measurement touches both alike."""
    on, off = Latency([], 0.0), Latency([], 0.0)
    per_run = max(1, claims // runs)
    for _ in range(runs):
        for total, writes in ((on, True), (off, False)):
            run = prepare_latency(python, per_run, rescan, status_writes=writes)
            total.prepare_s += run.prepare_s
            total.driver_cpu_per_cycle_s += run.driver_cpu_per_cycle_s / runs
    return on, off


def rows(load: ApiLoad, on: Latency | None, off: Latency | None) -> list[tuple[str, str, str, str, str]]:
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
    if on is not None and off is not None:
        with_writes, without = on.prepare_s, off.prepare_s
        out += [
            ("sequential prepare p50, status writes on", f"{p(with_writes, 50) * ms:.2f} ms",
             f"{p(without, 50) * ms:.2f} ms", f"{p(with_writes, 50) / p(without, 50):.2f}x",
             "floor column: no status writes (server refuses them)"),
            ("sequential prepare p99, status writes on", f"{p(with_writes, 99) * ms:.2f} ms",
             f"{p(without, 99) * ms:.2f} ms", f"{p(with_writes, 99) / p(without, 99):.2f}x", ""),
            ("driver CPU per cycle, status writes on", f"{on.driver_cpu_per_cycle_s * ms:.2f} ms",
             f"{off.driver_cpu_per_cycle_s * ms:.2f} ms",
             f"{on.driver_cpu_per_cycle_s / max(off.driver_cpu_per_cycle_s, 1e-9):.2f}x",
             "the two writes (status, removal) of each cycle, on the writer's thread"),
        ]
    return out
