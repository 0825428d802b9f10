"""One tenant filling its /dev/shm changes nothing for another tenant or for the driver.

The real driver process with ``--mps-shm-tmpfs`` (each MPS daemon gets a tmpfs of its own as
/dev/shm), or with the MPS host and its ``--shm-tmpfs``; the kubelet stand-in over the real sockets,
two consumable claims (two daemons on one GPU). Tenant 1 writes into the host directory its CDI
spec bind-mounts at /dev/shm until the file system is full, as a process in its container would.
"""

from __future__ import annotations

import json
import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest

from driver.kubeletplugin.types import ClaimRef
from driver.units import MIB
from tests.integration.test_consumable import allocated_claim
from tests.support.node import SimulatedNode, gpu_config, pid_alive, wait_until
from tests.support.shm import (
    fill_until_full,
    mounts_under,
    size_option,
    tmpfs_mount_problem,
    unmount_everything_under,
    write_ok,
)

PROBLEM = tmpfs_mount_problem()
pytestmark = pytest.mark.skipif(PROBLEM is not None, reason=PROBLEM or "")

SHARE_SHM = 64 * MIB  # the plan's, for each consumable claim's daemon: small, so filling it is quick
CLAIM_SHM = 96 * MIB  # a per-claim MPS config's
PLANS: dict[str, Any] = {"plans": {"c": {"gpus": [
    {"match": {"minor": 0}, "consumable": {"shmSize": "64Mi", "fallback": {"mps": {"shares": 2}}}}]}}}
SHARE_DEVICES = ["gpu-0-shared", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6", "gpu-2"]


def dev_shm_of(sim_node: SimulatedNode, ref: ClaimRef) -> Path:
    """The host directory the claim's CDI spec bind-mounts at /dev/shm."""
    spec = json.loads(sim_node.cdi_spec(ref.uid).read_text())
    mounts = [m for d in spec["devices"] for m in d["containerEdits"].get("mounts", [])]
    [host_path] = [m["hostPath"] for m in mounts if m["containerPath"] == "/dev/shm"]
    return Path(host_path)


def assert_own_tmpfs(sim_node: SimulatedNode, directory: Path, size: int) -> None:
    # Checked before anything is filled: on a driver without per-daemon tmpfs this directory is on the
    # machine's disk, which the test must never fill.
    [mount] = [m for m in mounts_under(sim_node.work) if m.point == directory]
    assert mount.fstype == "tmpfs" and size_option(size) in mount.super_options, mount


@pytest.mark.parametrize("launcher", ["plugin", "mps-host"])
def test_one_tenant_filling_its_dev_shm_changes_nothing_for_the_others_or_the_driver(launcher: str) -> None:
    sim_node = SimulatedNode("demo", plans=PLANS, plan="c")
    try:
        if launcher == "plugin":  # the LocalLauncher: daemons are the plugin's children
            sim_node.start("--mps-shm-tmpfs", "true", "--mps-shm-size", "128Mi")
        else:  # the MPS host mounts each tmpfs and unmounts it when the plugin releases the daemon
            sim_node.start_mps_host("--shm-tmpfs")
            sim_node.start("--mps-host-socket", str(sim_node.mps_host_socket), "--mps-shm-size", "128Mi")
        sim_node.wait_for_devices(SHARE_DEVICES)
        consumed: dict[str, dict[str, int]] = {}
        tenant1, _ = allocated_claim(sim_node, "tenant-1", "10Gi", "33", consumed, str(uuid.uuid4()))
        tenant2, _ = allocated_claim(sim_node, "tenant-2", "10Gi", "33", consumed, str(uuid.uuid4()))
        answers = sim_node.prepare(tenant1, tenant2)
        assert [answers[r.uid].error for r in (tenant1, tenant2)] == [None, None]
        shm1, shm2 = dev_shm_of(sim_node, tenant1), dev_shm_of(sim_node, tenant2)
        assert shm1 != shm2, "two daemons never share a /dev/shm"
        for directory in (shm1, shm2):
            assert_own_tmpfs(sim_node, directory, SHARE_SHM)

        written = fill_until_full(shm1)
        assert written <= SHARE_SHM, "tenant 1 got no more than its plan's size"
        write_ok(shm2, 4 * MIB)  # tenant 2's shm writes still succeed

        # The driver's own records are not on any tenant's tmpfs: tenant 1's daemon, killed, is restarted
        # (its restart recorded in its directory) with tenant 1's /dev/shm still full.
        daemon_dir = shm1.parent
        assert os.stat(daemon_dir).st_dev != os.stat(shm1).st_dev
        write_ok(daemon_dir)
        [daemon1] = [d for d in sim_node.checkpoint()["mps_daemons"].values() if Path(d["shm_dir"]) == shm1]
        os.kill(daemon1["pid"], signal.SIGKILL)
        wait_until(lambda: sim_node.checkpoint()["mps_daemons"][daemon1["spec"]["daemon_id"]]["pid"] != daemon1["pid"],
                   timeout=30, what="the driver to restart tenant 1's daemon")
        restarted = sim_node.checkpoint()["mps_daemons"][daemon1["spec"]["daemon_id"]]
        assert pid_alive(restarted["pid"]) and Path(restarted["shm_dir"]) == shm1

        # A new prepare succeeds, its daemon sized from the claim's own MPS config.
        whole = sim_node.claim("tenant-3", [("gpu", "gpu-2")], configs=[gpu_config(
            strategy="MPS", mpsConfig={"defaultActiveThreadPercentage": 50, "shmSize": "96Mi"})])
        sim_node.prepare_ok(whole)
        shm3 = dev_shm_of(sim_node, whole)
        assert_own_tmpfs(sim_node, shm3, CLAIM_SHM)
        write_ok(shm3)

        assert sim_node.unprepare(tenant1, tenant2, whole) == {tenant1.uid: None, tenant2.uid: None, whole.uid: None}
        assert mounts_under(sim_node.work) == [], "every tmpfs unmounted"
        for directory in (shm1, shm2, shm3):
            assert not directory.parent.exists(), f"{directory.parent} removed"
    finally:
        sim_node.stop()
        sim_node.stop_mps_host()
        unmount_everything_under(sim_node.work)
        sim_node.close()


MPS_PLANS: dict[str, Any] = {"plans": {"mps": {"gpus": [{"match": {"product": "NVIDIA L4"}, "mps": {
    "shares": 2, "activeThreadPercentage": 50}}]}}}


@pytest.mark.parametrize("launcher", ["plugin", "mps-host"])
def test_a_link_planted_at_a_daemon_directory_makes_the_driver_touch_nothing_behind_it(launcher: str) -> None:
    # Someone with write access to the MPS directory plants <mps dir>/<daemon id> -> a directory whose shm/ is
    # a mount holding files, before the daemon's first prepare. The driver used to follow the link: it
    # unmounted and emptied that shm/ and the prepare and unprepare then failed for good.
    from driver.gpu.claim.claimplan import shared_daemon_id
    from driver.gpu.mps.shmmount import mount_tmpfs

    sim_node = SimulatedNode("demo", plans=MPS_PLANS, plan="mps")
    outside = sim_node.work / "outside"
    try:
        if launcher == "mps-host":
            sim_node.start_mps_host("--private-shm", "--shm-tmpfs")
            sim_node.start("--mps-host-socket", str(sim_node.mps_host_socket))
        else:
            sim_node.start("--mps-shm-tmpfs", "true")
        wait_until(lambda: "gpu-2-mps-0" in sim_node.device_names(), timeout=30, what="the MPS shares")
        (outside / "shm").mkdir(parents=True)
        mount_tmpfs(outside / "shm", 64 * MIB)
        (outside / "shm" / "precious").write_text("keep me")
        (sim_node.state_dir / "mps").mkdir(exist_ok=True)
        link = sim_node.state_dir / "mps" / shared_daemon_id(sim_node.inventory.gpus[2].uuid)
        link.symlink_to(outside)
        ref = sim_node.claim("c", [("share", "gpu-2-mps-0")])
        answer = sim_node.prepare(ref)[ref.uid]
        assert answer.error is None, answer.error
        assert link.is_dir() and not link.is_symlink(), "the link was removed and the daemon got a real directory"
        assert (outside / "shm" / "precious").read_text() == "keep me"
        assert outside / "shm" in [m.point for m in mounts_under(sim_node.work)], "the mount behind the link stays"
        assert sim_node.unprepare(ref) == {ref.uid: None}
        assert (outside / "shm" / "precious").read_text() == "keep me"
    finally:
        sim_node.close()
        unmount_everything_under(sim_node.work)
