"""MPS daemons outlive the plugin: they run under the MPS host, and a restarted plugin adopts them.

As root the host also gives each daemon its own /dev/shm (``--private-shm``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
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
def sim_node() -> Iterator[SimulatedNode]:
    n = SimulatedNode("demo", plans=PLANS, plan="mps")
    try:
        yield n
    finally:
        n.close()


def parent_of(pid: int) -> int:
    return int(open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[1])


def inspect_daemons(sim_node: SimulatedNode) -> list[dict[str, Any]]:
    done = subprocess.run(sim_node.inspect_args("--json"), capture_output=True, text=True, timeout=30, check=True)
    daemons: list[dict[str, Any]] = json.loads(done.stdout)["mps_daemons"]
    return daemons


def test_daemon_survives_a_kill_9_of_the_plugin_and_the_restarted_plugin_adopts_it(sim_node: SimulatedNode) -> None:
    host_pid = sim_node.start_mps_host(*(["--private-shm"] if os.geteuid() == 0 else []))
    use_host = ("--mps-host-socket", str(sim_node.mps_host_socket))
    sim_node.start(*use_host)
    ref = sim_node.claim("c", [("share", "gpu-2-mps-0")])
    sim_node.prepare_ok(ref)
    [(daemon_id, daemon)] = sim_node.checkpoint()["mps_daemons"].items()
    pid = daemon["pid"]
    assert parent_of(pid) == host_pid, "the daemon is the MPS host's child, not the plugin's"
    start_time = read_proc_stat(pid).start_time  # type: ignore[union-attr]
    if os.geteuid() == 0:
        edits = json.loads(sim_node.cdi_spec(ref.uid).read_text())["devices"][0]["containerEdits"]
        shm = next(m["hostPath"] for m in edits["mounts"] if m["containerPath"] == "/dev/shm")
        assert shm == str(sim_node.state_dir / "mps" / daemon_id / "shm")
        assert os.path.samestat(os.stat(f"/proc/{pid}/root/dev/shm"), os.stat(shm)), "clients and daemon share it"

    sim_node.kill9()  # an OOM kill or a crash of the plugin container
    assert pid_alive(pid) and read_proc_stat(pid).start_time == start_time  # type: ignore[union-attr]

    sim_node.restart(*use_host)
    assert [(d["id"], d["pid"], d["pid_alive"]) for d in inspect_daemons(sim_node)] == [(daemon_id, pid, True)]
    assert [e["pid"] for e in sim_node.journal() if e.get("event") == "start"] == [pid], "adopted, not restarted"
    assert read_proc_stat(pid).start_time == start_time  # type: ignore[union-attr]
    # The claim still works: preparing it again (as the kubelet does after a plugin restart) is answered
    # from the checkpoint with the same daemon, and a second share joins that daemon.
    assert sim_node.prepare_ok(ref).devices[0].device_name == "gpu-2-mps-0"
    second = sim_node.claim("d", [("share", "gpu-2-mps-1")])
    sim_node.prepare_ok(second)
    assert [d["pid"] for d in sim_node.checkpoint()["mps_daemons"].values()] == [pid]

    assert sim_node.unprepare(ref, second) == {ref.uid: None, second.uid: None}
    wait_until(lambda: not pid_alive(pid), what="the daemon to stop after its last share")
    wait_until(lambda: read_proc_stat(pid) is None, what="the MPS host to reap the daemon (no zombie)")
    assert sim_node.mps_host is not None and sim_node.mps_host.poll() is None, "the host keeps running"


RETRY_LOGGED = "the MPS host was busy or cut the connection; asking again"


class SlotHolder:
    """Root on the node (the host's socket is root's, 0600) holding every connection slot of the MPS host.

    Each connection sends a byte now and then and never a whole request. While ``keep`` is set, a
    connection the host refuses (busy) or drops is replaced at once, so the slots stay taken however long
    the plugin takes to ask, bar the moment between a drop and its replacement; once ``keep`` is cleared,
    each connection runs until the host drops it.
    """

    def __init__(self, path: str, slots: int) -> None:
        self.path = path
        self.keep, self.stop = threading.Event(), threading.Event()
        self._lock = threading.Lock()
        self._conns: list[socket.socket | None] = [None] * slots
        self.dropped = 0  # connections the host held, then cut (its request budget ran out)
        self._threads = [threading.Thread(target=self._hold, args=(i,), daemon=True) for i in range(slots)]
        self.keep.set()
        for thread in self._threads:
            thread.start()

    def _hold(self, slot: int) -> None:
        while not self.stop.is_set():
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(self.path)
            with self._lock:
                self._conns[slot] = conn
            answer = self._trickle(conn)
            with self._lock:
                self._conns[slot] = None
                if answer is not None and b"busy" not in answer:
                    self.dropped += 1
            conn.close()
            if not self.keep.is_set():
                return

    def _trickle(self, conn: socket.socket) -> bytes | None:
        """What the host sent before it closed the connection (b"" for nothing); None if told to stop."""
        while not self.stop.is_set():
            try:
                conn.sendall(b"{")
                if select.select([conn], [], [], 1.0)[0]:  # a byte a second, or the host's answer or close
                    return conn.recv(4096)
            except OSError:  # the host closed it with our last byte unread
                return b""
        return None

    def all_held(self) -> bool:
        """Whether every slot is ours: a connection made after ours was answered busy, and none of ours was.

        The host accepts connections in the order they came and answers a busy one before it accepts the
        next, so each of ours, made before the probe, had its slot or its answer before the probe's."""
        with self._lock:
            conns = [c for c in self._conns if c is not None]
        if len(conns) < len(self._conns) or not host_busy(self.path):
            return False
        with self._lock:
            return self._conns == list(conns) and not select.select(conns, [], [], 0)[0]

    def finished(self, timeout: float) -> bool:
        for thread in self._threads:
            thread.join(timeout)
        return not any(thread.is_alive() for thread in self._threads)


def host_busy(path: str) -> bool:
    """Whether the host answers busy; a request line at once, so a host with a free slot answers at once too."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(30)  # a guard against a host that answers neither way, not a pace
        probe.connect(path)
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # a busy host answers and closes at once
            probe.sendall(b"\n")
        return b"busy" in probe.recv(4096)


def test_sixteen_connections_sending_a_byte_now_and_then_do_not_keep_a_prepare_from_its_daemon(
        sim_node: SimulatedNode) -> None:
    # Root on the node opens all 16 of the host's connection slots and keeps each alive with a byte every
    # second, never finishing a request: once each recv was bounded and not the request, the slots were
    # held for good and the plugin's prepare failed at once with "Broken pipe". Now each request has 5 s
    # in all, and the plugin asks again within its deadline.
    sim_node.start_mps_host()
    sim_node.start("--mps-host-socket", str(sim_node.mps_host_socket))
    # The multi-user probe starts a daemon through the host right after the plugin started: until that is
    # over it may hold a slot, which the prepare would then get without ever seeing the host busy.
    wait_until(lambda: any(e.get("msg") == "MPS multi-user mode is not available" or (
        e.get("msg") == "MPS control daemon stopped" and e.get("daemon_id") == "probe-multi-user")
        for e in sim_node.log()),
        what="the multi-user probe's daemon to come and go")
    ref = sim_node.claim("c", [("share", "gpu-2-mps-0")])
    holder = SlotHolder(str(sim_node.mps_host_socket), 16)
    answers: dict[str, Any] = {}
    preparing = threading.Thread(target=lambda: answers.update(sim_node.prepare(ref)), daemon=True)
    try:
        wait_until(holder.all_held, what="every slot of the host to be held")
        preparing.start()
        wait_until(lambda: not preparing.is_alive() or any(e.get("msg") == RETRY_LOGGED for e in sim_node.log()),
                   timeout=60, what="the plugin to find the host busy, or the prepare to end")
        holder.keep.clear()  # from now on the host's request budget frees the slots, one by one
        preparing.join(60)
        assert not preparing.is_alive(), "the prepare did not end"
        assert answers[ref.uid].error is None, answers[ref.uid].error
        assert any(e.get("msg") == RETRY_LOGGED for e in sim_node.log()), "the plugin never found the host busy"
        assert holder.finished(30), "the host kept a connection that sent no request"
        assert holder.dropped >= 16, "a connection that held a slot ended, but not by the host cutting it"
    finally:
        holder.stop.set()
        holder.finished(5)
    assert sim_node.unprepare(ref) == {ref.uid: None}
