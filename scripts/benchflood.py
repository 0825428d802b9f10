"""Other tenants' plan MPS share prepares while a tenant floods or holds the shared daemon's control socket.

Part of scripts/benchmark.py (its "flooded control socket" rows). On a simulated L4 node with 8 plan
shares, one tenant's claim starts the GPU's daemon; then three UID-65534 tenants each loop
``echo get_default_active_thread_percentage | nvidia-cuda-mps-control`` through a read-only bind mount
of the pipe dir (tests/support/mpstenants.py), and other tenants' shares are prepared one at a time
(each one NodePrepareResources call, no retry) and unprepared in batches of seven. Then one tenant
keeps a control session open while other tenants' shares are prepared (over several watcher rounds),
and one connects to the control socket and sends nothing, and a prepare and the last unprepare (the
daemon's stop) are timed during that hold. The goal: each prepare under 3 s.
"""

from __future__ import annotations

import math
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from driver.kubeletplugin.types import ClaimRef
from tests.support.mpsdaemons import MpsDaemonKind, daemon_params
from tests.support.mpstenants import allow_tenants, as_tenant, control_argv, flooders, silent_holder, stop
from tests.support.node import SimulatedNode, wait_until

_PLANS: dict[str, Any] = {"plans": {"mps": {"gpus": [{"match": {"all": True}, "mps": {
    "shares": 8, "activeThreadPercentage": 12}}]}}}
_SHARES = [f"gpu-0-mps-{k}" for k in range(8)]


@dataclass
class FloodResult:
    prepares: list[float] = field(default_factory=list)  # seconds, each succeeded at the first call
    failed: int = 0
    held_prepare: float = 0.0  # a prepare while a tenant holds the socket silent
    held_last_unprepare: float = 0.0  # the last unprepare (daemon stop) during such a hold
    session_prepares: list[float] = field(default_factory=list)  # while a tenant holds a control session open


def flooded_prepares(kind: MpsDaemonKind, python: str, prepares: int, extra: tuple[str, ...]) -> FloodResult:
    result = FloodResult()
    node = SimulatedNode("l4", plans=_PLANS, plan="mps", python=python)
    try:
        kind.install(node.sim_host.driver_root / "usr" / "bin")
        allow_tenants(node)
        node.start(*extra)
        node.wait_for_devices(_SHARES)
        hostile = node.claim("hostile", [("share", _SHARES[0])], namespace="tenant-a")
        node.prepare_ok(hostile)
        [daemon] = node.checkpoint()["mps_daemons"].values()
        flood = flooders(node, kind, daemon["pipe_dir"], "get_default_active_thread_percentage")
        try:
            done = 0
            while done < prepares:
                batch = [node.claim(f"other-{done + k}", [("share", _SHARES[1 + k])], namespace=f"tenant-{done + k}")
                         for k in range(min(7, prepares - done))]
                for ref in batch:
                    began = time.perf_counter()
                    answer = node.prepare(ref)[ref.uid]
                    result.prepares.append(time.perf_counter() - began)
                    result.failed += answer.error is not None
                node.unprepare(*batch)
                done += len(batch)
        finally:
            stop(flood)
        result.session_prepares, failed = _prepares_during_a_held_session(node, kind, daemon["pipe_dir"], prepares)
        result.failed += failed
        holder = silent_holder(node, kind, daemon["pipe_dir"])
        try:
            joining = node.claim("joining", [("share", _SHARES[1])], namespace="tenant-z")
            began = time.perf_counter()
            result.failed += node.prepare(joining)[joining.uid].error is not None
            result.held_prepare = time.perf_counter() - began
            holder.kill()
            holder.wait(timeout=30)
            holder = silent_holder(node, kind, daemon["pipe_dir"])
            began = time.perf_counter()
            node.unprepare(hostile, joining)
            result.held_last_unprepare = time.perf_counter() - began
            wait_until(lambda: node.checkpoint()["mps_daemons"] == {}, what="the daemon to be stopped")
        finally:
            holder.kill()
            holder.wait(timeout=30)
    finally:
        node.close()
    return result


def _prepares_during_a_held_session(node: SimulatedNode, kind: MpsDaemonKind, pipe_dir: str,
                                    prepares: int) -> tuple[list[float], int]:
    """Other tenants' prepares, one at a time, while a UID-65534 tenant keeps a control session open (the
    watcher's read-backs fail meanwhile; each of its rounds holds the GPU's locks up to 2 s)."""
    holder = subprocess.Popen(as_tenant(node, pipe_dir, control_argv(node, kind)), stdin=subprocess.PIPE,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True)
    took: list[float] = []
    failed = 0
    try:
        assert holder.stdin is not None
        holder.stdin.write("get_default_active_thread_percentage\n")
        holder.stdin.flush()
        for k in range(prepares):
            ref = node.claim(f"session-{k}", [("share", _SHARES[1 + k % 7])], namespace=f"tenant-s{k}")
            began = time.perf_counter()
            failed += node.prepare(ref)[ref.uid].error is not None
            took.append(time.perf_counter() - began)
            if k % 7 == 6 or k == prepares - 1:
                node.unprepare(*[r for r in node_claims(node) if r.name.startswith("session-")])
            time.sleep(0.5)  # spread over several watcher rounds (5 s apart)
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(timeout=30)
    return took, failed


def node_claims(node: SimulatedNode) -> list[ClaimRef]:
    prepared = node.checkpoint()["claims"]
    return [ClaimRef(namespace=c["namespace"], name=c["name"], uid=uid) for uid, c in prepared.items()]


def flood_rows(prepares: int, python: str, extra: tuple[str, ...]) -> list[tuple[str, str, str, str, str]]:
    """benchmark.py's rows: per daemon (the stand-in, NVIDIA's where fetched) the flooded prepares' p50/p99,
    and the prepare and last unprepare during a silent hold."""
    params = [p.values[0] for p in daemon_params() if hasattr(p, "values")]
    kinds = [k for k in params if isinstance(k, MpsDaemonKind) and (k.binary is not None or not k.is_real)]
    rows: list[tuple[str, str, str, str, str]] = []
    for kind in kinds if prepares else []:
        r = flooded_prepares(kind, python, prepares, extra)
        p50, p99 = _percentile(r.prepares, 50), _percentile(r.prepares, 99)
        ok = max(r.prepares) < 3 and not r.failed
        rows += [
            (f"prepare, socket flooded, {kind.name} (p50/p99 of {len(r.prepares)})",
             f"{p50 * 1000:.0f}/{p99 * 1000:.0f} ms", "", "",
             f"each < 3 s: {'ok' if ok else 'MISSED'} ({r.failed} failed; 3 uid-65534 loops)"),
            (f"prepare, control session held, {kind.name} (p50/p99 of {len(r.session_prepares)})",
             f"{_percentile(r.session_prepares, 50) * 1000:.0f}/{_percentile(r.session_prepares, 99) * 1000:.0f} ms",
             "", "", f"each < 3 s: {'ok' if max(r.session_prepares) < 3 else 'MISSED'} (a prepare may wait for "
                     "the watcher's first failing round: 2 s, 1 s after)"),
            (f"prepare / last unprepare, socket held silent, {kind.name}",
             f"{r.held_prepare * 1000:.0f}/{r.held_last_unprepare * 1000:.0f} ms", "", "",
             f"prepare < 3 s: {'ok' if r.held_prepare < 3 else 'MISSED'}"),
        ]
    return rows


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]
