"""Hostile tenants of a shared MPS daemon, as tests and scripts/benchmark.py play them on a simulated node.

A tenant's container gets the daemon's pipe directory bound read-only (its CDI spec), which still lets
it ``connect()`` to the 0666 ``control`` socket. Here each tenant process runs as UID 65534 in a mount
namespace of its own with the pipe dir bound read-only at ``<node work dir>/tenant-pipe``.
"""

from __future__ import annotations

import os
import signal
import subprocess

from tests.support.lookalikes import NOBODY
from tests.support.mpsdaemons import CONTROL, MpsDaemonKind
from tests.support.node import SimulatedNode

MOUNT_POINT = "tenant-pipe"


def allow_tenants(sim_node: SimulatedNode) -> None:
    """Before the driver starts: UID 65534 may reach the mount point and the driver root's control binary."""
    sim_node.work.chmod(0o711)
    (sim_node.work / MOUNT_POINT).mkdir(mode=0o755, exist_ok=True)


def control_argv(sim_node: SimulatedNode, kind: MpsDaemonKind) -> list[str]:
    """The driver root's ``nvidia-cuda-mps-control``. The stand-in's interpreter (this one) may be out of UID
    65534's reach; the system's runs it alike."""
    binary = str(sim_node.sim_host.driver_root / "usr" / "bin" / CONTROL)
    return [binary] if kind.is_real else ["/usr/bin/python3", binary]


def as_tenant(sim_node: SimulatedNode, pipe_dir: str, argv: list[str], uid: int = NOBODY) -> list[str]:
    """``argv`` run as ``uid`` with ``pipe_dir`` bound read-only at the mount point in a mount namespace of
    its own; ``CUDA_MPS_PIPE_DIRECTORY`` names the mount point."""
    mount = str(sim_node.work / MOUNT_POINT)
    script = ('mount --bind -o ro "$1" "$2" && export CUDA_MPS_PIPE_DIRECTORY="$2" && '
              'exec setpriv --reuid="$3" --regid="$3" --clear-groups "${@:4}"')
    return ["unshare", "--mount", "--propagation", "private", "bash", "-c", script, "tenant", pipe_dir, mount,
            str(uid), *argv]


def flooders(sim_node: SimulatedNode, kind: MpsDaemonKind, pipe_dir: str, command: str,
             count: int = 3) -> list[subprocess.Popen[bytes]]:
    """``count`` tenants, each looping ``echo <command> | nvidia-cuda-mps-control``."""
    loop = 'while :; do echo "$1" | "${@:2}" >/dev/null 2>&1; done'
    argv = as_tenant(sim_node, pipe_dir, ["bash", "-c", loop, "flood", command, *control_argv(sim_node, kind)])
    return [subprocess.Popen(argv, env={"PATH": "/usr/bin:/bin"}, start_new_session=True) for _ in range(count)]


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for p in processes:
        os.killpg(p.pid, signal.SIGKILL)  # the loop and its front-end of the moment
        p.wait(timeout=30)


def silent_holder(sim_node: SimulatedNode, kind: MpsDaemonKind, pipe_dir: str) -> subprocess.Popen[str]:
    """A tenant that connects to the control socket and sends nothing; it prints ``EOF`` if the daemon's end
    is shut down, and exits when its stdin closes (or is killed)."""
    sock_type = "SOCK_SEQPACKET" if kind.is_real else "SOCK_STREAM"  # NVIDIA's socket type; the stand-in's
    code = (f"import socket,sys\ns=socket.socket(socket.AF_UNIX, socket.{sock_type})\ns.connect(sys.argv[1])\n"
            "print('held', flush=True)\nwhile s.recv(64): pass\nprint('EOF', flush=True)\nsys.stdin.read()\n")
    argv = as_tenant(sim_node, pipe_dir, ["/usr/bin/python3", "-c", code, str(sim_node.work / MOUNT_POINT / "control")])
    holder = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    return holder
