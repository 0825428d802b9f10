"""MPS daemons outlive the plugin: they run under the MPS host, and a restarted plugin adopts them.

Issue 6, point 8. As root the host also gives each daemon its own /dev/shm (``--private-shm``).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from driver.gpu.mps.proc import read_proc_stat
from tests.support.node import SimulatedNode, pid_alive, wait_until

PLANS: dict[str, Any] = {"plans": {"mps": {"gpus": [{"match": {"product": "NVIDIA L4"},
                                                   "mps": {"shares": 2, "activeThreadPercentage": 50}}]}}}


@pytest.fixture
def node() -> Iterator[SimulatedNode]:
    n = SimulatedNode("demo", plans=PLANS, plan="mps")
    try:
        yield n
    finally:
        n.close()


def parent_of(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[1])


def inspect_daemons(node: SimulatedNode) -> list[dict[str, Any]]:
    done = subprocess.run(node.inspect_args("--json"), capture_output=True, text=True, timeout=30, check=True)
    daemons: list[dict[str, Any]] = json.loads(done.stdout)["mps_daemons"]
    return daemons


def test_daemon_survives_a_kill_9_of_the_plugin_and_the_restarted_plugin_adopts_it(node: SimulatedNode) -> None:
    host_pid = node.start_mps_host(*(["--private-shm"] if os.geteuid() == 0 else []))
    use_host = ("--mps-host-socket", str(node.mps_host_socket))
    node.start(*use_host)
    ref = node.claim("c", [("share", "gpu-2-mps-0")])
    node.prepare_ok(ref)
    [(daemon_id, daemon)] = node.checkpoint()["mps_daemons"].items()
    pid = daemon["pid"]
    assert parent_of(pid) == host_pid, "the daemon is the MPS host's child, not the plugin's"
    start_time = read_proc_stat(pid).start_time  # type: ignore[union-attr]
    if os.geteuid() == 0:
        edits = json.loads(node.cdi_spec(ref.uid).read_text())["devices"][0]["containerEdits"]
        shm = next(m["hostPath"] for m in edits["mounts"] if m["containerPath"] == "/dev/shm")
        assert shm == str(node.state_dir / "mps" / daemon_id / "shm")
        assert os.path.samestat(os.stat(f"/proc/{pid}/root/dev/shm"), os.stat(shm)), "clients and daemon share it"

    node.kill9()  # an OOM kill or a crash of the plugin container
    assert pid_alive(pid) and read_proc_stat(pid).start_time == start_time  # type: ignore[union-attr]

    node.restart(*use_host)
    assert [(d["id"], d["pid"], d["pid_alive"]) for d in inspect_daemons(node)] == [(daemon_id, pid, True)]
    assert [e["pid"] for e in node.journal() if e.get("event") == "start"] == [pid], "adopted, not restarted"
    assert read_proc_stat(pid).start_time == start_time  # type: ignore[union-attr]
    # The claim still works: preparing it again (as the kubelet does after a plugin restart) is answered
    # from the checkpoint with the same daemon, and a second share joins that daemon.
    assert node.prepare_ok(ref).devices[0].device_name == "gpu-2-mps-0"
    second = node.claim("d", [("share", "gpu-2-mps-1")])
    node.prepare_ok(second)
    assert [d["pid"] for d in node.checkpoint()["mps_daemons"].values()] == [pid]

    assert node.unprepare(ref, second) == {ref.uid: None, second.uid: None}
    wait_until(lambda: not pid_alive(pid), what="the daemon to stop after its last share")
    wait_until(lambda: read_proc_stat(pid) is None, what="the MPS host to reap the daemon (no zombie)")
    assert node.mps_host is not None and node.mps_host.poll() is None, "the host keeps running"
