"""Tenants that keep the shared plan daemon's control socket busy or silent, through the real driver process.

NVIDIA's control daemon serves one control session at a time, and waits for a connected client's first
message without a timeout (measured with 550.163 and 535.261, scripts/measure-mps-control.py). A tenant
reaches its ``control`` socket (0666) through its read-only mount of the pipe directory; here the path is
bound read-only into a mount namespace of the tenant's own, as the CDI spec binds it into a container. Each
test runs against the stand-in and NVIDIA's 550
and 535 daemons where fetched.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.test_health import metrics
from tests.support.mpsdaemons import MpsDaemonKind, daemon_params
from tests.support.mpstenants import allow_tenants, as_tenant, control_argv, flooders, silent_holder, stop
from tests.support.node import SimulatedNode, pid_alive, wait_until

# gpu-2 (an L4) in four MPS shares: 25 % of the threads, 4 GiB pinned each.
PLANS: dict[str, Any] = {"plans": {"mps": {"gpus": [{"match": {"product": "NVIDIA L4"}, "mps": {
    "shares": 4, "activeThreadPercentage": 25, "pinnedMemoryLimit": "4Gi"}}]}}}
SHARES = [f"gpu-2-mps-{k}" for k in range(4)]
INTERVAL = "1"  # --mps-limit-check-interval: the watcher's rounds, so the tests wait seconds, not tens
GET = "get_default_active_thread_percentage"


@pytest.fixture(params=daemon_params())
def sim_node(request: pytest.FixtureRequest) -> Iterator[SimulatedNode]:
    kind: MpsDaemonKind = request.param
    n = SimulatedNode("demo", plans=PLANS, plan="mps")
    try:
        kind.install(n.sim_host.driver_root / "usr" / "bin")
        allow_tenants(n)
        n.start("--mps-limit-check-interval", INTERVAL)
        wait_until(lambda: set(SHARES) <= set(n.device_names()), timeout=30, what="the MPS shares")
        yield n
    finally:
        n.close()


@pytest.fixture
def kind(request: pytest.FixtureRequest) -> MpsDaemonKind:
    param: MpsDaemonKind = request.node.callspec.params["sim_node"]
    return param






def tenant(sim_node: SimulatedNode, kind: MpsDaemonKind, pipe_dir: str, command: str) -> str:
    """One control command as a root tenant sends it through its mount of the pipe dir."""
    done = subprocess.run(control_argv(sim_node, kind), input=command + "\n", capture_output=True, text=True,
                          timeout=30,
                          env={"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": pipe_dir})
    return done.stdout.strip()


def shared_daemon(sim_node: SimulatedNode) -> dict[str, Any]:
    [daemon] = sim_node.checkpoint()["mps_daemons"].values()
    return dict(daemon)


def counter(sim_node: SimulatedNode, name: str, **labels: str) -> float:
    wanted = tuple(sorted(labels.items()))
    return sum(v for (n, ls), v in metrics(sim_node).items() if n == name and set(wanted) <= set(ls))


def control_log(daemon: dict[str, Any]) -> str:
    path = Path(daemon["log_dir"]) / "control.log"
    return path.read_text(errors="replace") if path.exists() else ""


def statements(sim_node: SimulatedNode) -> set[str]:
    """The published memoryLimitEnforcement and computeLimitEnforcement of the GPU's shares."""
    return {d["attributes"][key]["string"] for d in sim_node.devices() if d["name"] in SHARES
            for key in ("memoryLimitEnforcement", "computeLimitEnforcement")}


def events(sim_node: SimulatedNode, reason: str) -> dict[str, dict[str, Any]]:
    return {e["regarding"]["uid"]: e for e in sim_node.api.events() if e["reason"] == reason}






@pytest.mark.parametrize("command", [GET, "set_default_active_thread_percentage 100"], ids=["get-loops", "set-loops"])
def test_three_unprivileged_clients_flooding_the_control_socket_fail_no_other_tenants_prepare(
        sim_node: SimulatedNode, kind: MpsDaemonKind, command: str) -> None:
    hostile = sim_node.claim("hostile", [("share", SHARES[0])], namespace="tenant-a")
    sim_node.prepare_ok(hostile)
    daemon = shared_daemon(sim_node)
    reach = subprocess.run(as_tenant(sim_node, daemon["pipe_dir"], control_argv(sim_node, kind)), input=GET + "\n",
                           capture_output=True, text=True, timeout=30)
    assert reach.stdout.strip() == "25.0", f"UID 65534 reaches the daemon through its mount: {reach.stderr}"
    before = control_log(daemon).count("Accepting connection")
    flood = flooders(sim_node, kind, daemon["pipe_dir"], command)
    took: list[float] = []
    try:
        # The flood reaches the daemon: a few dozen more connections than the driver's own.
        wait_until(lambda: control_log(daemon).count("Accepting connection") > before + 60, timeout=60,
                   what="the tenants' flood of control connections")
        others = [sim_node.claim(f"other-{k}", [("share", SHARES[1 + k % 3])], namespace=f"tenant-{k}")
                  for k in range(8)]
        for batch in (others[0:3], others[3:6], others[6:8]):
            for ref in batch:
                began = time.monotonic()
                answer = sim_node.prepare(ref)[ref.uid]  # one NodePrepareResources call: no retry by the kubelet
                took.append(time.monotonic() - began)
                assert answer.error is None, f"prepare {len(took)} failed after {took[-1]:.2f}s: {answer.error}"
            assert sim_node.unprepare(*batch) == {ref.uid: None for ref in batch}
        assert shared_daemon(sim_node)["pid"] == daemon["pid"], "the daemon kept running under the flood"
    finally:
        stop(flood)
    print(f"other tenants' prepares under the flood: {', '.join(f'{t:.2f}s' for t in took)}")
    assert len(took) == 8
    if command == GET:
        # A busy front-end that exits 0 printing nothing is no answer, not a limit found unset.
        assert counter(sim_node, "tessera_mps_limit_drift_total", limit="active_thread_percentage") == 0
    wait_until(lambda: tenant(sim_node, kind, daemon["pipe_dir"], GET) == "25.0", timeout=30,
               what="the daemon to read back its limits after the flood")


def test_a_silent_holder_of_the_control_socket_is_let_go_and_a_limit_it_hid_is_restored(
        sim_node: SimulatedNode, kind: MpsDaemonKind) -> None:
    hostile = sim_node.claim("hostile", [("share", SHARES[0])], namespace="tenant-a")
    victim = sim_node.claim("victim", [("share", SHARES[1])], namespace="tenant-b")
    sim_node.prepare_ok(hostile)
    sim_node.prepare_ok(victim)
    daemon = shared_daemon(sim_node)
    assert tenant(sim_node, kind, daemon["pipe_dir"], "set_default_active_thread_percentage 100") == "100.0"
    holder = silent_holder(sim_node, kind, daemon["pipe_dir"])
    try:
        # The watcher finds the hold, lets it go and restores the limit while the holder still runs. The
        # driver posts one Event per claim the daemon serves, in turn from its queue: wait for each claim's.
        wait_until(lambda: {hostile.uid, victim.uid} <= set(events(sim_node, "MpsLimitsReverted")), timeout=60,
                   what="the limit the silent holder hid to be found and restored, told to each claim")
        assert holder.poll() is None and holder.stdout is not None
        assert holder.stdout.readline().strip() == "EOF", "the daemon's end of the silent connection was shut down"
        wait_until(lambda: any(e.get("msg", "").startswith("ended a silent hold") for e in sim_node.log()), timeout=30,
                   what="the driver's log line for the hold it ended")
        assert "active_thread_percentage was '100.0', restored to 25" in events(sim_node, "MpsLimitsReverted")[
            victim.uid]["note"]
        assert counter(sim_node, "tessera_mps_limit_drift_total", limit="active_thread_percentage") == 1
        assert tenant(sim_node, kind, daemon["pipe_dir"], GET) == "25.0"
        assert shared_daemon(sim_node)["pid"] == daemon["pid"], "let go in place, not restarted"
    finally:
        holder.kill()
        holder.wait(timeout=30)
    # The last unprepare stops the daemon while another silent client holds it: no five-second quit wait.
    holder = silent_holder(sim_node, kind, daemon["pipe_dir"])
    try:
        began = time.monotonic()
        assert sim_node.unprepare(hostile, victim) == {hostile.uid: None, victim.uid: None}
        print(f"last unprepare (daemon stop) during a silent hold: {time.monotonic() - began:.2f}s")
        assert not pid_alive(daemon["pid"])
    finally:
        holder.kill()
        holder.wait(timeout=30)




def test_a_held_control_session_counts_as_drift_until_the_limits_read_back_again(
        sim_node: SimulatedNode, kind: MpsDaemonKind) -> None:
    hostile = sim_node.claim("hostile", [("share", SHARES[0])], namespace="tenant-a")
    victim = sim_node.claim("victim", [("share", SHARES[1])], namespace="tenant-b")
    sim_node.prepare_ok(hostile)
    sim_node.prepare_ok(victim)
    daemon = shared_daemon(sim_node)
    daemon_id = daemon["spec"]["daemon_id"]
    [published] = statements(sim_node)
    sessions = control_log(daemon).count("NEW UI")
    # One session (root: 550 takes settings from root only) that raises the limit and stays open.
    holder = subprocess.Popen(control_argv(sim_node, kind), stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                              env={"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": daemon["pipe_dir"]})
    try:
        assert holder.stdin is not None
        holder.stdin.write("set_default_active_thread_percentage 100\n")
        holder.stdin.flush()
        wait_until(lambda: control_log(daemon).count("NEW UI") > sessions, timeout=30, what="the tenant's session")
        wait_until(lambda: {hostile.uid, victim.uid} <= set(events(sim_node, "MpsLimitsUnconfirmed")), timeout=60,
                   what="MpsLimitsUnconfirmed on each claim the daemon serves")
        assert counter(sim_node, "tessera_mps_limits_unconfirmed", daemon=daemon_id) == 1
        wait_until(lambda: statements(sim_node) == {"mps-unconfirmed"}, timeout=30,
                   what="the GPU's shares published as mps-unconfirmed")
        assert counter(sim_node, "tessera_mps_limit_drift_total", daemon=daemon_id, limit="unconfirmed") == 1
        # A claim that joins meanwhile is prepared at once, without the socket, and told too.
        joining = sim_node.claim("joining", [("share", SHARES[2])], namespace="tenant-c")
        sim_node.prepare_ok(joining)
        wait_until(lambda: joining.uid in events(sim_node, "MpsLimitsUnconfirmed"), timeout=30,
                   what="MpsLimitsUnconfirmed on the joining claim")
        report = json.loads(subprocess.run(sim_node.inspect_args("--json"), capture_output=True, text=True,
                                           timeout=60).stdout)
        [shown] = report["mps_daemons"]
        assert shown["limits_unconfirmed"] and "another client held the daemon's control socket" in shown[
            "limits_unconfirmed"]
        claims = {c["uid"]: c for c in report["claims"]}
        assert claims[joining.uid]["mps_limits_unconfirmed"] == [daemon_id]
        assert any(f"MPS daemon {daemon_id}: its limits cannot be confirmed" in p for p in report["problems"])
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    wait_until(lambda: victim.uid in events(sim_node, "MpsLimitsConfirmed") and victim.uid in events(
        sim_node, "MpsLimitsReverted"), timeout=60, what="the limits read back, restored and confirmed again")
    assert "active_thread_percentage was '100.0', restored to 25" in events(sim_node, "MpsLimitsReverted")[
        victim.uid]["note"]
    assert tenant(sim_node, kind, daemon["pipe_dir"], GET) == "25.0"
    assert counter(sim_node, "tessera_mps_limits_unconfirmed", daemon=daemon_id) == 0
    assert sim_node.checkpoint()["mps_limits_unconfirmed"] == {}
    wait_until(lambda: statements(sim_node) == {published}, timeout=30, what="the shares' statement back")
    assert sim_node.unprepare(hostile, victim, joining) == {r.uid: None for r in (hostile, victim, joining)}
