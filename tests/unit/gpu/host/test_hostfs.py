"""Reading /dev and /proc under a host root, against a simulated host tree and broken variants of it."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
import yaml

import cdi
from driver.gpu.discovery.inventory import NodeInventory
from driver.gpu.host.hostfs import (
    CapabilityNode,
    HostFsError,
    control_device_paths,
    mig_capability_nodes,
    missing_paths,
    nvidia_caps_major,
)
from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.hostroot import (
    MARKER_FILE,
    SIMULATED_CAPS_MAJOR,
    build_host_root,
    capability_minors,
)

SIMULATION_BIN = Path(__file__).resolve().parents[4] / "driver" / "simulation" / "bin"


def demo_inventory() -> NodeInventory:
    return SimulatedDiscovery("demo", "node-a").discover()


@pytest.fixture
def host(tmp_path: Path) -> Path:
    root = tmp_path / "host"
    build_host_root(root, demo_inventory())
    return root


def test_control_devices(host: Path) -> None:
    assert control_device_paths(host) == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    (host / "dev" / "nvidia-modeset").write_text("")
    (host / "dev" / "nvidia-uvm-tools").unlink()
    assert control_device_paths(host) == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-modeset"]


def test_control_devices_on_a_host_without_the_driver(tmp_path: Path) -> None:
    assert control_device_paths(tmp_path) == []


def test_missing_paths(host: Path) -> None:
    assert missing_paths(host, ["/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia2"]) == []
    assert missing_paths(host, ["/dev/nvidia0", "/dev/nvidia3", "/dev/nvidia-caps/nvidia-cap9999"]) == [
        "/dev/nvidia3",
        "/dev/nvidia-caps/nvidia-cap9999",
    ]


def test_nvidia_caps_major(host: Path) -> None:
    assert nvidia_caps_major(host) == SIMULATED_CAPS_MAJOR == 237


def test_mig_capability_nodes_of_every_simulated_instance(host: Path) -> None:
    [a100] = [g for g in demo_inventory().gpus if g.mig_enabled]
    for mig in a100.mig_instances:
        gi_minor, ci_minor = capability_minors(a100.minor, mig.gi_id, mig.ci_id)
        nodes = mig_capability_nodes(host, a100.minor, mig.gi_id, mig.ci_id)
        assert nodes == [
            CapabilityNode(path=f"/dev/nvidia-caps/nvidia-cap{gi_minor}", major=237, minor=gi_minor, file_mode=292),
            CapabilityNode(path=f"/dev/nvidia-caps/nvidia-cap{ci_minor}", major=237, minor=ci_minor, file_mode=292),
        ]
        assert missing_paths(host, [n.path for n in nodes]) == []


def test_capability_minor_pattern() -> None:
    # Values of /proc/driver/nvidia-caps/mig-minors on real drivers: gi access = 3 + 135*gpu + 9*gi.
    assert capability_minors(0, 0, 0) == (3, 4)
    assert capability_minors(3, 3, 3)[1] == 439
    assert capability_minors(6, 11, 5)[1] == 918


def test_values_are_read_from_proc_not_computed(host: Path) -> None:
    access = host / "proc/driver/nvidia/capabilities/gpu1/mig/gi1/ci0/access"
    access.write_text("DeviceFileMinor: 4242\nDeviceFileMode: 384\nDeviceFileModify: 1\n")
    ci_node = mig_capability_nodes(host, 1, 1, 0)[1]
    assert (ci_node.minor, ci_node.file_mode, ci_node.path) == (4242, 384, "/dev/nvidia-caps/nvidia-cap4242")


# --- errors ------------------------------------------------------------------------------------


def test_missing_proc_devices(tmp_path: Path) -> None:
    with pytest.raises(HostFsError, match=r"proc/devices does not exist.*is the host's /proc mounted"):
        nvidia_caps_major(tmp_path)


@pytest.mark.parametrize(
    "content",
    [
        "Character devices:\n195 nvidia-frontend\n508 nvidia-caps-imex-channels\n\nBlock devices:\n  7 loop\n",
        "Character devices:\n195 nvidia-frontend\n\nBlock devices:\n237 nvidia-caps\n",
        "",
    ],
)
def test_proc_devices_without_nvidia_caps(tmp_path: Path, content: str) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "devices").write_text(content)
    with pytest.raises(HostFsError, match=r"no 'nvidia-caps' entry.*MIG support"):
        nvidia_caps_major(tmp_path)


def test_missing_access_file(host: Path) -> None:
    with pytest.raises(HostFsError, match=r"gpu1/mig/gi9/access does not exist.*MIG enabled"):
        mig_capability_nodes(host, 1, 9, 0)
    with pytest.raises(HostFsError, match=r"gi1/ci5/access does not exist.*compute instance 5"):
        mig_capability_nodes(host, 1, 1, 5)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("DeviceFileMode: 292\n", r"no 'DeviceFileMinor:' line"),
        ("DeviceFileMinor: 12\n", r"no 'DeviceFileMode:' line"),
        ("DeviceFileMinor: twelve\nDeviceFileMode: 292\n", r"'DeviceFileMinor: twelve' is not a non-negative decimal"),
        ("DeviceFileMinor: 12\nDeviceFileMode: -1\n", r"'DeviceFileMode: -1' is not a non-negative decimal"),
    ],
)
def test_malformed_access_file(host: Path, content: str, message: str) -> None:
    (host / "proc/driver/nvidia/capabilities/gpu1/mig/gi1/access").write_text(content)
    with pytest.raises(HostFsError, match=message):
        mig_capability_nodes(host, 1, 1, 0)


# --- the simulated tree itself -----------------------------------------------------------------


def test_tree_is_labelled_simulated(host: Path) -> None:
    assert "simulated: true" in (host / MARKER_FILE).read_text()


def test_device_files(host: Path) -> None:
    assert sorted(p.name for p in (host / "dev").glob("nvidia[0-9]*")) == ["nvidia0", "nvidia1", "nvidia2"]
    assert len(list((host / "dev" / "nvidia-caps").iterdir())) == 6  # GI + CI for each of three MIG devices


def test_toolkit_spec(host: Path) -> None:
    path = host / "etc" / "cdi" / "nvidia.yaml"
    text = path.read_text()
    assert text.startswith("# SIMULATED")
    assert "&id" not in text  # no YAML anchors: every runtime's parser reads it the same way
    raw = yaml.safe_load(text)
    assert raw["kind"] == "nvidia.com/gpu"
    assert raw["cdiVersion"] == "0.5.0"
    assert [d["name"] for d in raw["devices"]] == ["all", "0", "1", "2"]
    assert raw["devices"][2]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia1"}]
    edits = raw["containerEdits"]
    assert "NVIDIA_VISIBLE_DEVICES=void" in edits["env"]
    assert {n["path"] for n in edits["deviceNodes"]} == {"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}
    mounts = {m["containerPath"]: m for m in edits["mounts"]}
    libcuda = mounts["/usr/lib/x86_64-linux-gnu/libcuda.so.580.95.05"]
    assert libcuda["options"] == ["ro", "nosuid", "nodev", "rbind", "rprivate"]
    assert "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.580.95.05" in mounts
    assert "/usr/bin/nvidia-smi" in mounts
    assert "/usr/bin/nvidia-cuda-mps-control" in mounts
    assert all((host / m["hostPath"].lstrip("/")).is_file() for m in mounts.values())
    hook_verbs = [h["args"][1] for h in edits["hooks"]]
    assert hook_verbs == ["create-symlinks", "update-ldcache"]
    assert all(h["hookName"] == "createContainer" and h["env"] == ["NVIDIA_CTK_DEBUG=false"] for h in edits["hooks"])
    # The project's own CDI loader (strict, like the Go one) accepts it.
    assert cdi.read_spec(path).kind == "nvidia.com/gpu"


def test_simulation_binaries_are_installed_executable(host: Path) -> None:
    expected = sorted(p.name for p in SIMULATION_BIN.iterdir() if p.is_file() and not p.name.startswith("."))
    installed = host / "usr" / "bin"
    assert sorted(p.name for p in installed.iterdir()) == expected
    for name in expected:
        mode = (installed / name).stat().st_mode
        assert stat.S_IMODE(mode) == 0o755
        shebang, _, body = (installed / name).read_text().partition("\n")
        assert shebang == f"#!{sys.executable}", "stand-ins run with the driver's own interpreter"
        assert body == (SIMULATION_BIN / name).read_text().partition("\n")[2]
        assert os.access(installed / name, os.X_OK)


def test_rebuild_follows_the_inventory(tmp_path: Path, host: Path) -> None:
    (host / "var" / "run" / "cdi").mkdir(parents=True)
    (host / "var" / "run" / "cdi" / "claim.json").write_text("{}")
    build_host_root(host, SimulatedDiscovery("l4", "node-a").discover())
    assert sorted(p.name for p in (host / "dev").glob("nvidia[0-9]*")) == ["nvidia0"]
    assert not (host / "dev" / "nvidia-caps").exists()
    assert not (host / "proc/driver/nvidia/capabilities/gpu1").exists()
    assert (host / "var" / "run" / "cdi" / "claim.json").exists()  # not ours: left alone


def test_refuses_to_build_over_a_real_tree(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    with pytest.raises(ValueError, match=r"no SIMULATED note"):
        build_host_root(tmp_path, demo_inventory())
    assert not (tmp_path / "dev").exists()
