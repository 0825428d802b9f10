"""Which GPUs the driver may publish beside another GPU allocator: the sockets that betray one, and the GPUs an
operator states Tessera owns."""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.gpu.published.devices import make_view
from driver.gpu.published.ownership import (
    GpuOwnership,
    OtherAllocator,
    find_other_allocators,
    owned_view,
    parse_owned_gpus,
)
from driver.nodelayout import SIMULATED_NODE_NAME
from driver.simulation.discovery import SimulatedDiscovery


@pytest.fixture
def kubelet() -> Iterator[Path]:
    """A kubelet root with its device-plugins and plugins_registry directories (a short path: socket names)."""
    root = Path(tempfile.mkdtemp(prefix="tko-", dir="/tmp"))
    (root / "device-plugins").mkdir()
    (root / "plugins_registry").mkdir()
    try:
        yield root
    finally:
        for directory in (root / "device-plugins", root / "plugins_registry"):
            for entry in directory.iterdir():
                entry.unlink()
            directory.rmdir()
        root.rmdir()


def bind(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(path))  # the file stays after close, as a crashed plugin's does


def found(kubelet: Path, own_driver: str = "gpu.tessera.dev") -> list[str]:
    return [o.what for o in find_other_allocators(kubelet / "device-plugins", kubelet / "plugins_registry",
                                                  own_driver)]


def test_nvidia_device_plugin_sockets_are_found_by_their_resource(kubelet: Path) -> None:
    bind(kubelet / "device-plugins" / "nvidia-gpu.sock")
    bind(kubelet / "device-plugins" / "nvidia-mig-1g.10gb.sock")
    bind(kubelet / "device-plugins" / "kubelet.sock")  # the kubelet's own
    bind(kubelet / "device-plugins" / "amd-gpu.sock")
    assert found(kubelet) == ["NVIDIA device plugin (nvidia.com/gpu)", "NVIDIA device plugin (nvidia.com/mig-1g.10gb)"]


def test_nvidias_dra_driver_is_found_with_or_without_a_pod_uid_and_compute_domains_do_not_count(
        kubelet: Path) -> None:
    registry = kubelet / "plugins_registry"
    bind(registry / "gpu.nvidia.com-reg.sock")
    bind(registry / "gpu.nvidia.com-6f1c2d1e-reg.sock")
    bind(registry / "compute-domain.nvidia.com-reg.sock")  # IMEX channels, not GPUs
    bind(registry / "gpu.tessera.dev-reg.sock")  # this driver itself
    bind(registry / "csi.example.com-reg.sock")
    assert found(kubelet) == ["DRA driver gpu.nvidia.com", "DRA driver gpu.nvidia.com"]


def test_files_that_are_not_sockets_and_hidden_sockets_are_not_allocators(kubelet: Path) -> None:
    (kubelet / "device-plugins" / "nvidia-gpu.sock").write_text("")  # the kubelet ignores non-sockets too
    bind(kubelet / "device-plugins" / ".nvidia-gpu.sock")
    os.symlink("/nonexistent", kubelet / "plugins_registry" / "gpu.nvidia.com-reg.sock")
    assert found(kubelet) == []


def test_missing_directories_hold_no_allocator_and_unreadable_ones_rule_nothing_out(kubelet: Path) -> None:
    assert find_other_allocators(kubelet / "none", kubelet / "none", "gpu.tessera.dev") == ()
    not_a_dir = kubelet / "device-plugins" / "file"
    not_a_dir.write_text("")
    [unknown] = find_other_allocators(not_a_dir, kubelet / "none", "gpu.tessera.dev")
    assert unknown.what.startswith("unknown (cannot list the directory") and unknown.path == not_a_dir


def test_owned_gpus_are_minors_and_gpu_uuids() -> None:
    assert parse_owned_gpus("") is None
    assert parse_owned_gpus(" 0, GPU-abc ,3") == frozenset({"0", "GPU-abc", "3"})
    for bad in ("MIG-abc", "gpu0", "GPU-", "-1"):
        with pytest.raises(ValueError, match="is neither a GPU minor"):
            parse_owned_gpus(f"0,{bad}")


def test_ownership_publishes_every_gpu_alone_none_beside_another_allocator_and_the_listed_ones_when_told() -> None:
    inventory = SimulatedDiscovery("demo", SIMULATED_NODE_NAME).discover()
    view = make_view(inventory, {})
    plugin = (OtherAllocator("NVIDIA device plugin (nvidia.com/gpu)", Path("/k/nvidia-gpu.sock")),)
    alone, beside, told = GpuOwnership(), GpuOwnership(None, plugin), GpuOwnership(frozenset({"1", "GPU-x"}), plugin)
    assert owned_view(view, alone) is view
    assert owned_view(view, beside).devices == ()
    assert [d.name for d in owned_view(view, told).devices] == [
        "gpu-1-mig-3g40gb-0", "gpu-1-mig-2g20gb-4", "gpu-1-mig-1g10gb-6"]
    assert alone.refusal() is None and told.refusal() is None
    assert beside.refusal() is not None and beside.summary(inventory) == beside.refusal()
    assert told.summary(inventory) == ("ownedGpus lists the GPUs Tessera owns beside NVIDIA device plugin "
                                       "(nvidia.com/gpu) at /k/nvidia-gpu.sock: publishing GPU minor(s) 1; not on "
                                       "this node: GPU-x")
