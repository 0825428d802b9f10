"""The driver process publishes no GPU that another allocator on the node may hand out: NVIDIA's device plugin
socket in the kubelet's device plugin directory keeps every GPU back, unless the operator lists the GPUs
Tessera owns."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.node import DRIVER, NODE, SimulatedNode, wait_until

DEMO_DEVICES = ["gpu-0", "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6", "gpu-2"]


@pytest.fixture
def device_plugin(sim_node: SimulatedNode) -> Iterator[Path]:
    """NVIDIA's device plugin serving nvidia.com/gpu on the node: its socket, bound, in the device plugin dir."""
    sim_node.device_plugins_dir.mkdir()
    path = sim_node.device_plugins_dir / "nvidia-gpu.sock"
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen()
    try:
        yield path
    finally:
        server.close()


def published_slices(sim_node: SimulatedNode) -> list[dict[str, object]]:
    return sim_node.api.slices(DRIVER, NODE)


def test_a_device_plugin_socket_keeps_every_gpu_unpublished_until_it_is_gone(
        sim_node: SimulatedNode, device_plugin: Path) -> None:
    sim_node.start()
    # The pool is published, empty: what the kubelet had from an earlier run of the driver is withdrawn too.
    wait_until(lambda: len(published_slices(sim_node)) == 1, what="the driver's (empty) pool")
    assert sim_node.device_names() == []
    [refusal] = [e for e in sim_node.log()
                 if e.get("level") == "error" and "another GPU allocator" in str(e.get("msg"))]
    assert str(refusal["msg"]).startswith(f"another GPU allocator is on this node: NVIDIA device plugin "
                                          f"(nvidia.com/gpu) at {device_plugin}. Publishing no GPUs")
    assert "nvidia.com/gpu.deploy.device-plugin=false" in str(refusal["msg"])
    assert "--owned-gpus" in str(refusal["msg"])
    # The same line as a Warning Event on the Node, where `kubectl describe node` shows it.
    wait_until(lambda: any(e["reason"] == "OtherGpuAllocator" for e in sim_node.api.events("default")),
               what="the Node event")
    [event] = [e for e in sim_node.api.events("default") if e["reason"] == "OtherGpuAllocator"]
    assert event["type"] == "Warning" and event["note"] == refusal["msg"]
    assert event["regarding"] == {"apiVersion": "v1", "kind": "Node", "namespace": "", "name": NODE,
                                  "uid": sim_node.api.get_object("nodes", "", NODE)["metadata"]["uid"]}
    # The device plugin leaves the node (its pod and socket gone): the next rescan publishes every GPU.
    device_plugin.unlink()
    sim_node.wait_for_devices(DEMO_DEVICES)
    assert any("no other GPU allocator on this node" in str(e.get("msg")) for e in sim_node.log())


def test_with_owned_gpus_listed_only_those_are_published_beside_the_device_plugin(
        sim_node: SimulatedNode, device_plugin: Path) -> None:
    uuid_of_minor_2 = sim_node.inventory.gpus[2].uuid
    sim_node.start("--owned-gpus", f"0,{uuid_of_minor_2}")
    sim_node.wait_for_devices(["gpu-0", "gpu-2"])
    assert not any(e.get("level") == "error" for e in sim_node.log())
    assert any(str(e.get("msg")).startswith("ownedGpus lists the GPUs Tessera owns beside NVIDIA device plugin "
                                            "(nvidia.com/gpu)") and "publishing GPU minor(s) 0, 2" in str(e.get("msg"))
               for e in sim_node.log())


def test_a_bad_owned_gpu_entry_stops_the_driver_before_it_registers(sim_node: SimulatedNode) -> None:
    status, output = sim_node.run_to_exit("--owned-gpus", "0,MIG-1234")
    assert status == 2
    assert ("--owned-gpus '0,MIG-1234': 'MIG-1234' is neither a GPU minor (the N of /dev/nvidiaN) nor a GPU UUID "
            "(GPU-...)") in output
    assert not list((sim_node.work / "reg").glob("*.sock"))


def test_a_claim_allocated_before_the_device_plugin_came_is_refused_and_a_prepared_one_keeps_its_gpu(
        sim_node: SimulatedNode) -> None:
    sim_node.start()
    sim_node.wait_for_devices(DEMO_DEVICES)
    kept = sim_node.claim("kept", [("gpu", "gpu-0")])
    sim_node.prepare_ok(kept)
    late = sim_node.claim("late", [("gpu", "gpu-2")])  # allocated from the slice, not yet prepared
    sim_node.device_plugins_dir.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(sim_node.device_plugins_dir / "nvidia-gpu.sock"))
        sim_node.wait_for_devices([])
        error = sim_node.prepare(late)[late.uid].error
        assert error is not None and error.startswith("devices gpu-2 are no longer published on this node, so they "
                                                      "may be another allocator's: another GPU allocator is on this "
                                                      "node: NVIDIA device plugin (nvidia.com/gpu)")
        assert sim_node.prepare_ok(kept).devices, "the kubelet sends a prepared claim again: it keeps its GPU"
        assert sim_node.unprepare(kept) == {kept.uid: None}
