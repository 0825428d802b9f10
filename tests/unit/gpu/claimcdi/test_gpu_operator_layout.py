"""The GPU Operator's node layout (SIMULATION tree): device root, hostPath device nodes, the operator's toolkit spec.

Claims are turned into CDI specs by the driver's own ``claim_spec_file`` against the simulated
``gpu-operator`` tree (driver root ``/run/nvidia/driver`` with the device nodes in its ``dev/``,
toolkit spec ``/var/run/cdi/management.nvidia.com-gpu.yaml``), and against the host layout to show
a host-installed driver is written as before.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path, PurePosixPath
from typing import Any

import pytest

import cdi
from driver.commands.inspect import inspect
from driver.config import Settings
from driver.gpu.claimcdi.assemble import ClaimSpecFile
from driver.gpu.claimcdi.edits import CdiNames, CdiSources, claim_spec_file
from driver.gpu.claimcdi.toolkit import ToolkitEdits, load_toolkit_edits, toolkit_spec_candidates, toolkit_spec_changed
from driver.gpu.discovery.inventory import ComputeMode, NodeInventory
from driver.gpu.errors import PrepareError
from driver.gpu.host.binaries import find_binary
from driver.gpu.host.hostfs import driver_root_host_path, find_device_root
from driver.gpu.published.devices import make_view
from driver.gpu.record.checkpoint import ClaimPhase, ClaimRecord, PreparedDeviceRecord
from driver.kubeletplugin.types import PreparedDevice
from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.gpus import SimulationError
from driver.simulation.hostroot import OPERATOR_DRIVER_ROOT, SimulatedHost, build_host_root
from tests.support.statenode import StateNode, claim, mps_shares

NODE = "node-a"
UID = "0f9a3c4e-1111-4222-8333-944455556666"
NAMES = CdiNames("gpu.tessera.dev")


def _discovery(layout: str) -> SimulatedDiscovery:
    return SimulatedDiscovery(layout, NODE)


@pytest.fixture
def operator_node(tmp_path: Path) -> tuple[SimulatedHost, NodeInventory]:
    discovery = _discovery("gpu-operator")
    inventory = discovery.discover()
    return build_host_root(tmp_path / "host", inventory, discovery.driver_layout), inventory


def _sources(host: SimulatedHost, toolkit: ToolkitEdits, *, on_host: PurePosixPath | None = None) -> CdiSources:
    derived = driver_root_host_path(host.root, host.driver_root, on_host)
    # No MPS devices here: the manager is never asked for client edits.
    return CdiSources(NAMES, host.root, toolkit, None, host.driver_root, derived)


def _toolkit(host: SimulatedHost, required: bool = True) -> ToolkitEdits:
    return load_toolkit_edits(None, toolkit_spec_candidates(host.toolkit_spec.parent, host.root / "etc" / "cdi"),
                              required)


def _record(inventory: NodeInventory) -> ClaimRecord:
    """A claim with the whole first GPU and the first MIG device of the second."""
    whole = inventory.gpus[0]
    parent = next(g for g in inventory.gpus if g.mig_instances)
    mig = parent.mig_instances[0]
    devices = [
        PreparedDeviceRecord(device=PreparedDevice(request_names=["gpu"], pool_name=NODE, device_name="gpu-0",
                                                   cdi_device_ids=[NAMES.device_id(UID, "gpu-0")]),
                             kind="gpu", gpu_uuid=whole.uuid, gpu_minor=whole.minor),
        PreparedDeviceRecord(device=PreparedDevice(request_names=["mig"], pool_name=NODE, device_name="gpu-1-mig",
                                                   cdi_device_ids=[NAMES.device_id(UID, "gpu-1-mig")]),
                             kind="mig", gpu_uuid=parent.uuid, gpu_minor=parent.minor, mig_uuid=mig.uuid,
                             mig_gi_id=mig.gi_id, mig_ci_id=mig.ci_id),
    ]
    return ClaimRecord(uid=UID, namespace="default", name="c", phase=ClaimPhase.PREPARE_COMPLETED, devices=devices,
                       cdi_spec_file=NAMES.spec_file_name(UID))


def _wire(file: ClaimSpecFile) -> dict[str, Any]:
    wire: dict[str, Any] = file.spec.to_wire()
    return wire


def _all_nodes(wire: dict[str, Any]) -> list[dict[str, Any]]:
    nodes = list(wire["containerEdits"].get("deviceNodes", []))
    for device in wire["devices"]:
        nodes.extend(device["containerEdits"].get("deviceNodes", []))
    return nodes


# --- the simulated tree ------------------------------------------------------------------------


def test_the_operator_tree_keeps_the_nodes_under_the_driver_root_only(
        operator_node: tuple[SimulatedHost, NodeInventory]) -> None:
    host, inventory = operator_node
    assert host.driver_root == host.root / "run" / "nvidia" / "driver"
    assert host.toolkit_spec == host.root / "var" / "run" / "cdi" / "management.nvidia.com-gpu.yaml"
    assert (host.driver_root / "dev" / "nvidiactl").is_file()
    assert all((host.driver_root / "dev" / f"nvidia{g.minor}").is_file() for g in inventory.gpus)
    assert not list((host.root / "dev").glob("nvidia*"))
    assert (host.root / "proc" / "devices").is_file()  # the kernel's /proc, not the container's
    assert not (host.root / "etc" / "cdi" / "nvidia.yaml").exists()
    # nvidia-smi and the MPS control daemon come from the driver root.
    assert find_binary(host.driver_root, "nvidia-smi").is_relative_to(host.driver_root)
    assert find_binary(host.driver_root, "nvidia-cuda-mps-control").is_relative_to(host.driver_root)
    spec = cdi.read_spec(host.toolkit_spec)
    assert spec.kind == "management.nvidia.com/gpu"
    assert [d.name for d in spec.devices] == ["all"]


def test_device_root_is_the_driver_roots_dev_as_nvidia_chooses_it(
        operator_node: tuple[SimulatedHost, NodeInventory]) -> None:
    host, _ = operator_node
    on_host = driver_root_host_path(host.root, host.driver_root, None)
    assert on_host == OPERATOR_DRIVER_ROOT
    root = find_device_root(host.root, host.driver_root, on_host)
    assert root.seen_at == host.driver_root and root.on_host == OPERATOR_DRIVER_ROOT
    assert root.node("/dev/nvidia0") == {"path": "/dev/nvidia0", "hostPath": "/run/nvidia/driver/dev/nvidia0"}
    # An explicit host path wins (the chart mounts the driver root at /driver-root, outside the host root).
    explicit = PurePosixPath("/run/nvidia/driver")
    assert driver_root_host_path(Path("/host"), Path("/driver-root"), explicit) == explicit
    # A driver root outside the host root, not named: the process runs on the host and sees it there.
    assert driver_root_host_path(Path("/host"), Path("/opt/nvidia"), None) == PurePosixPath("/opt/nvidia")


def test_a_driver_root_whose_dev_lacks_the_nodes_falls_back_to_the_hosts_dev(tmp_path: Path) -> None:
    host_root, driver_root = tmp_path / "host", tmp_path / "driver"
    (driver_root / "dev").mkdir(parents=True)  # a dev/ directory, but no NVIDIA nodes in it
    (host_root / "dev").mkdir(parents=True)
    (host_root / "dev" / "nvidiactl").write_text("")
    root = find_device_root(host_root, driver_root, PurePosixPath("/opt/driver"))
    assert root.seen_at == host_root and root.on_host == PurePosixPath("/")
    assert root.node("/dev/nvidiactl") == {"path": "/dev/nvidiactl"}
    # A driver root that is the host's / is the host's /dev, whatever it holds.
    (driver_root / "dev" / "nvidiactl").write_text("")
    assert find_device_root(host_root, driver_root, PurePosixPath("/")).seen_at == host_root


# --- claims on the operator layout --------------------------------------------------------------


def test_claim_device_nodes_carry_the_real_host_path(operator_node: tuple[SimulatedHost, NodeInventory]) -> None:
    host, inventory = operator_node
    toolkit = _toolkit(host)
    assert toolkit.source == host.toolkit_spec and toolkit.problem is None
    wire = _wire(claim_spec_file(_sources(host, toolkit), _record(inventory), {}, {}))

    gpu0, mig = wire["devices"]
    assert gpu0["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia0", "hostPath": "/run/nvidia/driver/dev/nvidia0"}]
    mig_nodes = mig["containerEdits"]["deviceNodes"]
    assert mig_nodes[0] == {"path": "/dev/nvidia1", "hostPath": "/run/nvidia/driver/dev/nvidia1"}
    for cap in mig_nodes[1:]:
        assert cap["path"].startswith("/dev/nvidia-caps/nvidia-cap") and cap["type"] == "c"
        assert cap["hostPath"] == "/run/nvidia/driver" + cap["path"]
    control = {n["path"]: n.get("hostPath") for n in wire["containerEdits"]["deviceNodes"]}
    assert control["/dev/nvidiactl"] == "/run/nvidia/driver/dev/nvidiactl"
    # Every hostPath names a node that exists on the (simulated) host: what the runtime will stat.
    for node in _all_nodes(wire):
        assert (host.root / node["hostPath"].lstrip("/")).is_file(), node


def test_claim_gets_the_operator_toolkits_libraries(operator_node: tuple[SimulatedHost, NodeInventory]) -> None:
    host, inventory = operator_node
    wire = _wire(claim_spec_file(_sources(host, _toolkit(host)), _record(inventory), {}, {}))
    mounts = wire["containerEdits"]["mounts"]
    libcuda = [m for m in mounts if Path(m["containerPath"]).name.startswith("libcuda.so")]
    assert libcuda and libcuda[0]["hostPath"] == "/run/nvidia/driver" + libcuda[0]["containerPath"]
    assert all(h["path"] == "/usr/local/nvidia/toolkit/nvidia-cdi-hook" for h in wire["containerEdits"]["hooks"])
    assert wire["annotations"]["gpu.tessera.dev/driver-libraries"] == f"from {host.toolkit_spec}"


def test_a_missing_node_names_the_driver_roots_dev(operator_node: tuple[SimulatedHost, NodeInventory]) -> None:
    host, inventory = operator_node
    (host.driver_root / "dev" / "nvidia0").unlink()
    with pytest.raises(PrepareError, match=r"/dev/nvidia0 .* does not exist in /run/nvidia/driver/dev"):
        claim_spec_file(_sources(host, _toolkit(host)), _record(inventory), {}, {})


def test_the_driver_container_not_running_yet_is_named(operator_node: tuple[SimulatedHost, NodeInventory]) -> None:
    host, inventory = operator_node
    for node in (host.driver_root / "dev").glob("nvidia*"):
        if node.is_file():
            node.unlink()
    with pytest.raises(PrepareError, match=r"nvidiactl does not exist in /dev .*GPU Operator's driver container"):
        claim_spec_file(_sources(host, _toolkit(host)), _record(inventory), {}, {})


# --- driver libraries ---------------------------------------------------------------------------


def test_no_toolkit_spec_fails_the_claim_unless_the_operator_accepts_it(
        operator_node: tuple[SimulatedHost, NodeInventory], caplog: pytest.LogCaptureFixture) -> None:
    host, inventory = operator_node
    host.toolkit_spec.unlink()
    with caplog.at_level(logging.ERROR, logger="driver.gpu.claimcdi.toolkit"):
        required = _toolkit(host)
    assert required.readiness_problem is not None and "management.nvidia.com-gpu.yaml" in required.readiness_problem
    assert any("not ready" in r.getMessage() for r in caplog.records)
    with pytest.raises(PrepareError, match="no usable driver libraries"):
        claim_spec_file(_sources(host, required), _record(inventory), {}, {})
    accepted = _toolkit(host, required=False)
    wire = _wire(claim_spec_file(_sources(host, accepted), _record(inventory), {}, {}))
    assert wire["annotations"]["gpu.tessera.dev/driver-libraries"].startswith("not injected: ")
    assert "mounts" not in wire["containerEdits"]


def test_the_operators_spec_is_followed_when_it_appears_or_is_regenerated(
        operator_node: tuple[SimulatedHost, NodeInventory]) -> None:
    host, _ = operator_node
    content = host.toolkit_spec.read_text()
    host.toolkit_spec.unlink()
    candidates = toolkit_spec_candidates(host.toolkit_spec.parent, host.root / "etc" / "cdi")
    before = load_toolkit_edits(None, candidates)
    assert before.source is None
    host.toolkit_spec.write_text(content)  # the operator's toolkit comes up after the plugin
    assert toolkit_spec_changed(before, None, candidates)
    now = load_toolkit_edits(None, candidates)
    assert now.source == host.toolkit_spec and not toolkit_spec_changed(now, None, candidates)
    regenerated = host.toolkit_spec.with_suffix(".new")
    regenerated.write_text(content.replace("580.95.05", "580.105.08"))
    regenerated.replace(host.toolkit_spec)  # a driver upgrade: new library versions, new inode
    assert toolkit_spec_changed(now, None, candidates)
    assert "580.105.08" in str(load_toolkit_edits(None, candidates).edits)


# --- a host-installed driver is written as before -----------------------------------------------


def test_host_installed_driver_has_no_host_paths(tmp_path: Path) -> None:
    discovery = _discovery("demo")
    inventory = discovery.discover()
    host = build_host_root(tmp_path / "host", inventory, discovery.driver_layout)
    assert host.driver_root == host.root and host.layout == "host"
    toolkit = load_toolkit_edits(host.toolkit_spec)
    # Both ways of saying "the driver is on the host": no driver root, or the host root as driver root.
    for sources in (_sources(host, toolkit),
                    CdiSources(NAMES, host.root, toolkit, None)):
        wire = _wire(claim_spec_file(sources, _record(inventory), {}, {}))
        assert all("hostPath" not in node for node in _all_nodes(wire))
        assert wire["devices"][0]["containerEdits"]["deviceNodes"] == [{"path": "/dev/nvidia0"}]


# --- what inspect shows -------------------------------------------------------------------------


def test_inspect_shows_device_root_and_the_missing_libraries(
        operator_node: tuple[SimulatedHost, NodeInventory], tmp_path: Path) -> None:
    host, _ = operator_node
    settings = Settings(node_name=NODE, simulate="gpu-operator", plugins_dir=tmp_path / "plugins",
                        cdi_root=host.toolkit_spec.parent, host_root=host.root, driver_root=host.driver_root)
    text = inspect(settings, as_json=False)
    assert "device nodes from /run/nvidia/driver/dev (the driver root's /dev)" in text
    assert f"driver libraries from {host.toolkit_spec}" in text
    assert "node not ready" not in text
    host.toolkit_spec.unlink()
    text = inspect(settings, as_json=False)
    assert "PROBLEM: node not ready: no usable driver libraries for containers" in text
    report = json.loads(inspect(settings.model_copy(update={"driver_libraries_required": False}), as_json=True))
    assert report["node_driver"]["driver_libraries"].startswith("not injected: ")
    assert not [p for p in report["problems"] if "not ready" in p]


def test_a_layout_file_names_its_driver_layout(tmp_path: Path) -> None:
    good = tmp_path / "node.yaml"
    good.write_text("driverLayout: gpu-operator\ngpus:\n  - model: L4\n")
    assert SimulatedDiscovery(str(good), NODE).driver_layout == "gpu-operator"
    bad = tmp_path / "bad.yaml"
    bad.write_text("driverLayout: docker\ngpus:\n  - model: L4\n")
    with pytest.raises(SimulationError, match="driverLayout"):
        SimulatedDiscovery(str(bad), NODE)
    assert _discovery("demo").driver_layout == "host"


@pytest.mark.parametrize("required", [True, False])
def test_a_prepare_through_device_state_follows_the_driver_libraries_rule(
        state_node: StateNode, required: bool) -> None:
    # The whole prepare path, MPS share included (it starts a daemon and sets EXCLUSIVE_PROCESS before
    # the CDI spec is written): without libraries it fails with the reason and leaves nothing behind,
    # unless the operator said claims here need none (driverLibraries.required=false).
    state_node.toolkit = load_toolkit_edits(None, (state_node.root / "absent" / "nvidia.yaml",), required=required)
    state = state_node.state()
    gpu = state_node.uuid(0)
    state.apply_layout(make_view(state_node.inventory, {}), {gpu: mps_shares(2)})
    claims = [claim("5d1c0c49-0b6e-4f7e-9a53-0a0f1a6f8b10", "gpu-0-mps-0"),
              claim("5d1c0c49-0b6e-4f7e-9a53-0a0f1a6f8b11", "gpu-2")]
    if not required:
        for c in claims:
            assert state.prepare(c)
        assert len(state_node.cdi_files()) == 2
        return
    for c in claims:
        with pytest.raises(PrepareError, match="no usable driver libraries"):
            state.prepare(c)
    cp = state_node.store.load()
    assert cp.claims == {} and cp.mps_daemons == {} and cp.compute_modes == {} and state_node.cdi_files() == []
    assert state_node.mps.daemon_ids_on_disk() == []
    assert state_node.modes.modes.get(gpu, ComputeMode.DEFAULT) == ComputeMode.DEFAULT
    assert state_node.mps.started() == [], "refused before any daemon was started, not rolled back afterwards"
