"""The real driver process on the simulated node with NVIDIA's own ``nvidia-cuda-mps-control``.

NVIDIA's daemon starts and answers control commands without a GPU as long as no CUDA client
connects (docs/sharing.md, "NVIDIA's daemon, as measured"), so the whole MPS path of a plan share
(start, limits set and read back as NVIDIA displays them, CDI spec, stop) runs against it here.
scripts/fetch-nvidia-mps.sh puts the build into .cache/nvidia-mps/; without it the test skips.
"""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest

from tests.support.mpsdaemons import CONTROL, daemon_params
from tests.support.node import SimulatedNode, pid_alive, wait_until
from tests.support.processes import processes_mentioning

_NVIDIA_550 = next(p for p in daemon_params() if getattr(p, "id", "") == "nvidia-550")
# Plan defaults on an H100 (81559 MiB): 4 shares of 20389 MiB each, 25 % of the threads.
PLANS: dict[str, Any] = {"plans": {"mps": {"gpus": [{"match": {"minor": 0}, "mps": {"shares": 4}}]}}}
SHARE_MIB = 81559 // 4


@pytest.mark.parametrize("kind", [_NVIDIA_550])
def test_a_plan_share_on_nvidias_daemon_prepares_reads_back_and_leaves_nothing(kind: Any) -> None:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="mps")
    try:
        kind.install(sim_node.sim_host.driver_root / "usr" / "bin")
        sim_node.start()
        sim_node.wait_for_devices(["gpu-0-mps-0", "gpu-0-mps-1", "gpu-0-mps-2", "gpu-0-mps-3",
                                   "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6", "gpu-2"])
        ref = sim_node.claim("share", [("share", "gpu-0-mps-2")])
        sim_node.prepare_ok(ref)

        [daemon] = sim_node.checkpoint()["mps_daemons"].values()
        assert daemon["spec"]["multi_user"] is False
        # 550.x has no multi-user mode: the probe against it says so, visibly, naming the GPU.
        gpu0 = sim_node.inventory.gpus[0].uuid
        wait_until(lambda: any(gpu0 in e.get("gpu_uuids", []) and "one Linux UID at a time" in e.get("msg", "")
                               for e in sim_node.log()), what="the single-user warning naming GPU 0")
        shares = [d for d in sim_node.devices() if d["name"].startswith("gpu-0-mps-")]
        assert [d["attributes"]["mpsMultiUser"] for d in shares] == [{"bool": False}] * 4
        pid = daemon["pid"]
        assert pid_alive(pid)
        assert os.readlink(f"/proc/{pid}/exe") == str(sim_node.sim_host.driver_root / "usr" / "bin" / CONTROL)
        # NVIDIA's daemon shows the 20389M it took as whole GiB, rounded down (measured).
        assert _ask(sim_node, daemon["pipe_dir"], "get_default_device_pinned_mem_limit 0") == f"{SHARE_MIB // 1024}G"
        assert _ask(sim_node, daemon["pipe_dir"], "get_default_active_thread_percentage") == "25.0"
        assert f"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0={SHARE_MIB}M" in sim_node.cdi_spec(ref.uid).read_text()

        assert sim_node.unprepare(ref) == {ref.uid: None}
        assert not pid_alive(pid)
        assert sim_node.checkpoint()["mps_daemons"] == {} and sim_node.cdi_files() == []
        assert not (sim_node.state_dir / "mps" / daemon["spec"]["daemon_id"]).exists()
        driver_pid = sim_node.proc.pid if sim_node.proc else -1
        left = [p for p in processes_mentioning(str(sim_node.work), in_environment=True) if p != driver_pid]
        assert left == [], f"processes left running: {left}"
    finally:
        sim_node.close()


def _ask(sim_node: SimulatedNode, pipe_dir: str, command: str) -> str:
    done = subprocess.run([str(sim_node.sim_host.driver_root / "usr" / "bin" / CONTROL)], input=command + "\n",
                          capture_output=True, text=True, timeout=10,
                          env={"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": pipe_dir})
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()
