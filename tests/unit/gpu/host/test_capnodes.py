"""MIG capability nodes made from the kernel's numbers in a process's own /dev (driver/gpu/host/capnodes.py)."""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from driver.gpu.host.capnodes import MIG_CONFIG, CapabilityNodeError, ensure_nodes, instance_capabilities
from driver.gpu.record.checkpoint import Checkpoint
from driver.gpu.runtime.mig import capabilities_of
from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.hostroot import build_host_root, capability_minors

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="making device nodes needs CAP_MKNOD (run as root)")


@pytest.fixture
def host(tmp_path: Path) -> Path:
    build_host_root(tmp_path / "host", SimulatedDiscovery("demo", "node-a").discover())
    return tmp_path / "host"


@root_only
def test_nodes_are_made_with_the_kernels_numbers_and_mode_and_kept_when_there(host: Path, tmp_path: Path) -> None:
    a100 = SimulatedDiscovery("demo", "node-a").discover().gpus[1]
    mig = a100.mig_instances[0]
    wanted = [*instance_capabilities(a100.minor, mig.gi_id, mig.ci_id), MIG_CONFIG]
    own = tmp_path / "own"
    made = ensure_nodes(host, own, wanted)
    gi_minor, ci_minor = capability_minors(a100.minor, mig.gi_id, mig.ci_id)
    assert made == [str(own / "dev/nvidia-caps" / f"nvidia-cap{m}") for m in (gi_minor, ci_minor, 1)]
    for path, minor, mode in zip(made, (gi_minor, ci_minor, 1), (0o444, 0o444, 0o400), strict=True):
        info = os.lstat(path)
        assert stat.S_ISCHR(info.st_mode) and (os.major(info.st_rdev), os.minor(info.st_rdev)) == (237, minor)
        assert stat.S_IMODE(info.st_mode) == mode
    assert ensure_nodes(host, own, wanted) == [], "nodes already there are kept"


def test_something_else_at_a_nodes_path_is_left_alone_and_reported(host: Path, tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:
    trap = tmp_path / "own/dev/nvidia-caps/nvidia-cap1"
    trap.parent.mkdir(parents=True)
    trap.write_text("not a device")
    with caplog.at_level(logging.WARNING):
        assert ensure_nodes(host, tmp_path / "own", [MIG_CONFIG]) == []
    assert trap.read_text() == "not a device"
    assert "something other than the MIG capability node is at its path" in caplog.text


@pytest.mark.parametrize("name", ["../../../etc/access", "gpu0/mig/gi1/../../access", "mig/config/access",
                                  "gpu0/access"])
def test_only_the_kernels_capability_files_are_read(host: Path, tmp_path: Path, name: str) -> None:
    with pytest.raises(CapabilityNodeError, match="is not a MIG capability path"):
        ensure_nodes(host, tmp_path / "own", [name])


def test_a_capability_the_kernel_does_not_list_is_an_error_naming_its_file(host: Path, tmp_path: Path) -> None:
    with pytest.raises(CapabilityNodeError, match=r"gpu1/mig/gi9/access does not exist"):
        ensure_nodes(host, tmp_path / "own", ["gpu1/mig/gi9/access"])


def test_the_capabilities_of_a_daemons_devices_come_from_the_claims_records() -> None:
    cp = Checkpoint.model_validate({"claims": {"u": {
        "uid": "u", "namespace": "n", "name": "c", "phase": "PrepareCompleted", "cdi_spec_file": "x.json",
        "devices": [{"device": {"request_names": ["r"], "pool_name": "p", "device_name": "gpu-1-mig-1g10gb-6",
                                "cdi_device_ids": ["k/claim=u"]},
                     "kind": "mig", "gpu_uuid": "GPU-1", "gpu_minor": 1, "mig_uuid": "MIG-a", "mig_gi_id": 13,
                     "mig_ci_id": 0}]}}})
    assert capabilities_of(cp, ["MIG-a", "GPU-2"]) == ["gpu1/mig/gi13/access", "gpu1/mig/gi13/ci0/access"]
    assert capabilities_of(cp, ["GPU-1", "MIG-other"]) == []
