"""A hostile tenant forging MPS daemons, through the real driver process.

An unprivileged process (UID 65534: no GPU, no mounts) keeps 20 processes alive that look like the
plan daemon of GPU 0 to anyone reading /proc: command line ``nvidia-cuda-mps-control ... -f``,
``CUDA_MPS_PIPE_DIRECTORY=<the plan daemon's pipe dir>`` (predictable from the GPU UUID), SIGTERM
ignored. They were taken for the daemon: each cost a prepare 2 s of ignored SIGTERM, so another
tenant's share prepare ran into the kubelet's deadline and stayed PrepareStarted. Now another
tenant's prepares succeed at once before the daemon first starts, while it runs and when it is
restarted; nothing is left half-prepared; the look-alikes are never signalled (same PIDs
throughout: the keeper would replace a killed one under a new PID); ``inspect`` lists them as
foreign. Against the stand-in and NVIDIA's daemons, with the plugin's own launcher, and with the
MPS host (whose PID the plugin learns from the host socket's peer credentials).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from typing import Any

import pytest

from driver.gpu.claim.claimplan import shared_daemon_id
from driver.kubeletplugin.types import ClaimRef
from tests.support.lookalikes import NOBODY, look_alikes
from tests.support.mpsdaemons import STANDIN, MpsDaemonKind, daemon_params
from tests.support.node import SimulatedNode, pid_alive, wait_until

PLANS: dict[str, Any] = {"plans": {"mps": {"gpus": [{"match": {"minor": 0}, "mps": {"shares": 4}}]}}}
SHARES = [f"gpu-0-mps-{k}" for k in range(4)]
FORGED = 20
PREPARE_LIMIT_S = 5.0


def _as_param(param: object) -> Any:
    return param  # a pytest ParameterSet: values, id, marks

# Each daemon with the plugin's own launcher; the stand-in through the MPS host too.
_CASES = [pytest.param(p.values[0], False, id=p.id, marks=p.marks) for p in map(_as_param, daemon_params())]
_CASES.append(pytest.param(STANDIN, True, id="standin-mps-host"))


def _prepare_in_time(sim_node: SimulatedNode, ref: ClaimRef) -> None:
    began = time.monotonic()
    answer = sim_node.prepare(ref)[ref.uid]
    took = time.monotonic() - began
    assert answer.error is None, f"prepare of {ref.name} failed: {answer.error}"
    assert took < PREPARE_LIMIT_S, f"prepare of {ref.name} took {took:.1f}s"


@pytest.mark.parametrize(("kind", "mps_host"), _CASES)
def test_forged_daemons_of_an_unprivileged_tenant_stall_no_prepare_and_are_never_signalled(
        kind: MpsDaemonKind, mps_host: bool) -> None:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="mps")
    try:
        kind.install(sim_node.sim_host.driver_root / "usr" / "bin")
        if mps_host:
            sim_node.start_mps_host()
        sim_node.start(*(["--mps-host-socket", str(sim_node.mps_host_socket)] if mps_host else []))
        wait_until(lambda: set(SHARES) <= set(sim_node.device_names()), what="the plan's MPS shares")
        daemon_id = shared_daemon_id(sim_node.inventory.gpus[0].uuid)
        pipe_dir = sim_node.state_dir / "mps" / daemon_id / "pipe"
        with look_alikes(pipe_dir, FORGED, uid=NOBODY) as forged:
            before = forged.current()
            refs = [sim_node.claim(f"tenant-{k}", [("share", share)], namespace=f"team-{k}")
                    for k, share in enumerate(SHARES[:3])]

            _prepare_in_time(sim_node, refs[0])  # the plan daemon's first start, beside the look-alikes
            [first] = sim_node.checkpoint()["mps_daemons"].values()
            _prepare_in_time(sim_node, refs[1])  # while it runs
            os.kill(first["pid"], signal.SIGKILL)  # gone: the next prepare, or a rescan, restarts it
            wait_until(lambda: not pid_alive(first["pid"]), what="the killed plan daemon to be gone")
            _prepare_in_time(sim_node, refs[2])
            [daemon] = sim_node.checkpoint()["mps_daemons"].values()
            assert daemon["pid"] != first["pid"] and pid_alive(daemon["pid"])

            claims = sim_node.checkpoint()["claims"]
            assert {uid: c["phase"] for uid, c in claims.items()} == {r.uid: "PrepareCompleted" for r in refs}
            assert sim_node.cdi_files() == sorted(sim_node.cdi_spec(r.uid).name for r in refs)
            assert forged.current() == before, "a look-alike was signalled"

            done = subprocess.run(sim_node.inspect_args("--json"), capture_output=True, text=True, timeout=60)
            report = json.loads(done.stdout)
            shown = report["foreign_mps_processes"]
            assert sorted((f["pid"], f["uid"], f["daemon_id"]) for f in shown) == sorted(
                (pid, NOBODY, daemon_id) for pid, _ in before)
            assert done.returncode == 1 and any("foreign process(es)" in p for p in report["problems"])
            [shown_daemon] = report["mps_daemons"]
            assert (shown_daemon["id"], shown_daemon["pid"], shown_daemon["pid_alive"]) == (
                daemon_id, daemon["pid"], True)

            assert sim_node.unprepare(*refs) == {r.uid: None for r in refs}
            assert not pid_alive(daemon["pid"])
            assert sim_node.checkpoint()["claims"] == {} and sim_node.cdi_files() == []
            assert forged.current() == before, "a look-alike was signalled"
    finally:
        sim_node.close()
