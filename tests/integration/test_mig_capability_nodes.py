"""MIG capability nodes where a process opens an instance, through the real driver process and the real MPS host.

The simulated node models the kernel (it makes no ``/dev/nvidia-caps`` node for an instance it creates: nvidia-modprobe
would, on demand) and the MPS host's ``/dev`` as a privileged container has it, a copy of the node's taken when the
host started. An instance created after that has no capability node in the copy, and the stand-in MPS server, like
libcuda, cannot open the MIG device without one. The driver has the MPS host make them (numbers from /proc) before
the daemon starts. Making device nodes needs CAP_MKNOD: these tests run as root.
"""

from __future__ import annotations

import os
import stat
import subprocess
from collections.abc import Iterator

import pytest

from tests.support import mignode
from tests.support.mignode import mig_mps_config
from tests.support.node import SimulatedNode, wait_until

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="making device nodes needs CAP_MKNOD (run as root)")

PLANS = {"defaultPlan": "p", "plans": {"p": {"gpus": [{"match": {"minor": 0}, "dynamicMig": {}}]}}}
TWO_G = "gpu-0-dynmig-2g20gb-2"
CAPS = "proc/driver/nvidia/capabilities"


@pytest.fixture
def sim_node() -> Iterator[SimulatedNode]:
    with mignode.dynamic_mig_node(PLANS) as n:
        n.start_mps_host(own_dev=True)  # its /dev: the node's as it is now, before any instance exists
        n.start("--mps-host-socket", str(n.mps_host_socket))
        wait_until(lambda: TWO_G in n.device_names(), 30, "the dynamic MIG placements published")
        yield n


def minor_of(sim_node: SimulatedNode, access: str) -> int:
    text = (sim_node.host / CAPS / access).read_text()
    return int(text.split("DeviceFileMinor:")[1].split()[0])


def first_line(sim_node: SimulatedNode, pipe_dir: str, devices: str) -> str:
    """What a SIMULATION MPS client of the daemon says first: its server, or why there is none."""
    control = sim_node.sim_host.driver_root / "usr" / "bin" / "nvidia-cuda-mps-control"
    client = subprocess.Popen([str(control), "--simulation-client"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, env={"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": pipe_dir,
                                              "CUDA_VISIBLE_DEVICES": devices})
    assert client.stdout is not None and client.stdin is not None
    try:
        return client.stdout.readline().strip()
    finally:
        client.stdin.close()
        client.wait(timeout=30)


def test_an_mps_daemon_on_an_instance_created_after_the_mps_host_started_can_open_it(sim_node: SimulatedNode) -> None:
    ref = sim_node.claim("c", [("mig", TWO_G)], configs=[mig_mps_config()])
    sim_node.prepare_ok(ref)
    [dev] = sim_node.checkpoint()["claims"][ref.uid]["devices"]
    gi, ci = dev["mig_gi_id"], dev["mig_ci_id"]
    [daemon] = sim_node.checkpoint()["mps_daemons"].values()
    assert daemon["spec"]["gpu_uuids"] == [dev["mig_uuid"]]
    line = first_line(sim_node, daemon["pipe_dir"], dev["mig_uuid"])
    assert line.startswith("SERVER "), line
    # Like the kernel, the simulated node made no node on the host; the MPS host made them in its own /dev copy.
    host_caps = sim_node.host / "dev" / "nvidia-caps"
    for access in (f"gpu0/mig/gi{gi}/access", f"gpu0/mig/gi{gi}/ci{ci}/access"):
        minor = minor_of(sim_node, access)
        assert not (host_caps / f"nvidia-cap{minor}").exists()
        made = os.lstat(sim_node.mps_host_dev_root / "dev" / "nvidia-caps" / f"nvidia-cap{minor}")
        assert stat.S_ISCHR(made.st_mode) and os.minor(made.st_rdev) == minor and os.major(made.st_rdev) == 237
        assert stat.S_IMODE(made.st_mode) == 0o444  # DeviceFileMode 292 of the access file
    # The plugin's own NVML create opened mig/config through its own /dev (the host tree, on the simulated node).
    config = os.lstat(host_caps / "nvidia-cap1")
    assert stat.S_ISCHR(config.st_mode) and stat.S_IMODE(config.st_mode) == 0o400
    assert sim_node.unprepare(ref) == {ref.uid: None}


def test_a_request_naming_a_capability_outside_the_kernels_mig_tree_is_refused(sim_node: SimulatedNode) -> None:
    from driver.gpu.mps.hostclient import MpsHostLauncher
    from driver.gpu.mps.launch import DaemonLaunch, MpsLaunchError

    with pytest.raises(ValueError, match=r"capabilities entry '\.\./\.\./devices/access'"):
        DaemonLaunch.model_validate({"daemon_id": "x", "pipe_dir": "/tmp/p", "log_dir": "/tmp/l",
                                     "visible_devices": ["GPU-1"], "capabilities": ["../../devices/access"]})
    # The host checks what it receives the same way: a forged line never makes a node.
    launcher = MpsHostLauncher(sim_node.mps_host_socket)
    forged = DaemonLaunch.model_construct(daemon_id="forged", pipe_dir=sim_node.state_dir, log_dir=sim_node.state_dir,
                                          visible_devices=["GPU-1"], capabilities=["../../../../etc/access"])
    with pytest.raises(MpsLaunchError):
        launcher.launch(forged)
    assert not any((sim_node.mps_host_dev_root / "dev").rglob("nvidia-cap*"))
