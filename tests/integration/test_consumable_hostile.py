"""Consumable GPUs against hostile input through the real driver process, the API server double and the
kubelet stand-in: an allocation no integer grid allows, and a tenant raising its own daemon's pinned
memory by less than the daemon's whole-G display shows."""

from __future__ import annotations

import subprocess
import uuid
from typing import Any

from driver.kubeletplugin.types import ClaimRef
from tests.integration.test_consumable import PLANS, allocated_claim
from tests.support.node import DRIVER, NODE, SimulatedNode, wait_until

DEVICES = ["gpu-0-shared", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6", "gpu-2"]


def test_a_fractional_consumption_is_refused_and_leaves_nothing() -> None:
    # 65.5 SMs were prepared as 65 (49 %): limits and the prepared total other than anything the scheduler counts.
    sim_node = SimulatedNode("demo", plans=PLANS, plan="c")
    try:
        sim_node.start()
        sim_node.wait_for_devices(DEVICES)
        ref = ClaimRef(namespace="default", name="odd", uid=str(uuid.uuid4()))
        sim_node.api.put_claim({"metadata": {"name": ref.name, "namespace": ref.namespace, "uid": ref.uid},
                                "spec": {"devices": {"requests": []}},
                                "status": {"allocation": {"devices": {"config": [], "results": [{
                                "request": "share", "driver": DRIVER, "pool": NODE, "device": "gpu-0-shared",
                                "shareID": "00000000-0000-0000-0000-0000000000dd",
                                "consumedCapacity": {"memory": "10Gi", "multiprocessors": "65.5"}}]}}}})
        error = sim_node.prepare(ref)[ref.uid].error
        assert error is not None and 'consumedCapacity.multiprocessors: "65.5" is not a whole number' in error
        assert [e for e in sim_node.journal() if e.get("event") == "start"] == []
        assert sim_node.cdi_files() == [] and sim_node.checkpoint()["claims"] == {}
        assert list((sim_node.state_dir / "mps").glob("share-*")) == []
    finally:
        sim_node.close()


def test_a_pinned_limit_raised_within_its_displayed_gib_is_set_back_by_the_watcher() -> None:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="c")
    try:
        sim_node.start()
        sim_node.wait_for_devices(DEVICES)
        ref, _ = allocated_claim(sim_node, "share", "10Gi", "33", {}, str(uuid.uuid4()))
        sim_node.prepare_ok(ref)
        [daemon] = sim_node.checkpoint()["mps_daemons"].values()
        pipe_dir = daemon["pipe_dir"]
        # Root in its container, the tenant reaches its daemon's control socket through its read-only mount.
        control = str(sim_node.sim_host.driver_root / "usr" / "bin" / "nvidia-cuda-mps-control")
        raised = subprocess.run([control], input="set_default_device_pinned_mem_limit 0 11263M\n",
                                capture_output=True, text=True, timeout=30,
                                env={"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": pipe_dir})
        assert raised.returncode == 0, raised.stderr

        def sets() -> list[str]:
            return [" ".join(e["args"]) for e in sim_node.journal() if e.get("pipe_dir") == pipe_dir
                    and e.get("cmd") == "set_default_device_pinned_mem_limit"]

        def set_back() -> bool:
            entries: list[Any] = sets()
            return "0 11263M" in entries and entries[-1] == "0 10240M" and \
                entries.index("0 11263M") < len(entries) - 1

        # It reads back "10G" either way; the watcher (every 5 s) must not leave the raised value in place.
        wait_until(set_back, timeout=20, what="the watcher to set the share's pinned limit back to 10240M")
        assert sim_node.unprepare(ref) == {ref.uid: None}
    finally:
        sim_node.close()
