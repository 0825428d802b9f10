"""MPS daemons outlive the plugin: they run under the MPS host, and a restarted plugin adopts them.

Issue 6, point 8. As root the host also gives each daemon its own /dev/shm (``--private-shm``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
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


def test_sixteen_connections_sending_a_byte_now_and_then_do_not_keep_a_prepare_from_its_daemon(
        node: SimulatedNode) -> None:
    # Root on the node (the host's socket is root's, 0600) opens all 16 of the host's connection slots and
    # keeps each alive with a byte every second, never finishing a request: once each recv was bounded
    # and not the request, the slots were held for good and the plugin's prepare failed at once with
    # "Broken pipe". Now each request has 5 s in all, and the plugin asks again within its deadline.
    node.start_mps_host()
    node.start("--mps-host-socket", str(node.mps_host_socket))
    stop, cut = threading.Event(), []

    def trickle(conn: socket.socket) -> None:
        with conn:
            while not stop.wait(1.0):
                try:
                    conn.sendall(b"{")
                except OSError:
                    cut.append(conn)
                    return

    held = []
    for _ in range(16):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(str(node.mps_host_socket))
        conn.sendall(b"{")
        held.append(threading.Thread(target=trickle, args=(conn,), daemon=True))
        held[-1].start()

    def busy() -> bool:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            probe.settimeout(5)
            probe.connect(str(node.mps_host_socket))
            return b"busy" in probe.recv(4096)

    ref = node.claim("c", [("share", "gpu-2-mps-0")])  # before the wait: the prepare follows the probe at once
    try:
        wait_until(busy, what="every slot of the host to be held")
        answer = node.prepare(ref)[ref.uid]
        assert answer.error is None, answer.error
        wait_until(lambda: len(cut) == 16, timeout=30, what="the host to drop every connection that sent no request")
    finally:
        stop.set()
        for thread in held:
            thread.join(5)
    assert any(e.get("msg") == "the MPS host was busy or cut the connection; asking again" for e in node.log())
    assert node.unprepare(ref) == {ref.uid: None}
