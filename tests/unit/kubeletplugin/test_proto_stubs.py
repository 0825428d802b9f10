"""The committed gRPC stubs: up to date with proto/dra/*.proto and naming what the kubelet calls."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from google.protobuf.message import Message

from driver.kubeletplugin.api import (
    dra_v1_pb2,
    dra_v1beta1_pb2,
    drahealth_v1_pb2,
    drahealth_v1alpha1_pb2,
    pluginregistration_v1_pb2,
)

REPO = Path(__file__).resolve().parents[3]
API_DIR = REPO / "driver" / "kubeletplugin" / "api"


def stub_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file() and p.suffix in {".py", ".pyi"}}


def test_regenerating_gives_the_committed_files(tmp_path: Path) -> None:
    out = tmp_path / "api"
    subprocess.run(
        [sys.executable, str(REPO / "proto" / "generate.py"), "--out", str(out)],
        check=True,
        capture_output=True,
        cwd=tmp_path,
        timeout=120,
    )
    regenerated, committed = stub_files(out), stub_files(API_DIR)
    assert sorted(regenerated) == sorted(committed)
    stale = [name for name in committed if committed[name] != regenerated[name]]
    assert stale == [], f"stale generated files (run python proto/generate.py): {stale}"


def test_generated_grpc_modules_import_their_messages_by_package_path() -> None:
    for grpc_module in API_DIR.glob("*_pb2_grpc.py"):
        text = grpc_module.read_text()
        assert f"from driver.kubeletplugin.api import {grpc_module.stem.removesuffix('_grpc')} as" in text


@pytest.mark.parametrize(
    ("module", "service", "full_name"),
    [
        (pluginregistration_v1_pb2, "Registration", "pluginregistration.Registration"),
        (dra_v1_pb2, "DRAPlugin", "k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin"),
        (dra_v1beta1_pb2, "DRAPlugin", "k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin"),
        (drahealth_v1alpha1_pb2, "DRAResourceHealth", "v1alpha1.DRAResourceHealth"),
        (drahealth_v1_pb2, "DRAResourceHealth", "v1.DRAResourceHealth"),
    ],
)
def test_service_full_names_match_the_kubelet(module: ModuleType, service: str, full_name: str) -> None:
    descriptor = module.DESCRIPTOR.services_by_name[service]
    assert descriptor.full_name == full_name


def test_dra_method_names() -> None:
    for module in (dra_v1_pb2, dra_v1beta1_pb2):
        methods = module.DESCRIPTOR.services_by_name["DRAPlugin"].methods_by_name
        assert sorted(methods) == ["NodePrepareResources", "NodeUnprepareResources"]
    health = drahealth_v1alpha1_pb2.DESCRIPTOR.services_by_name["DRAResourceHealth"].methods_by_name
    assert health["NodeWatchResources"].server_streaming
    assert not health["NodeWatchResources"].client_streaming


def test_share_id_is_optional_field_5_only_in_v1() -> None:
    share_id = dra_v1_pb2.Device.DESCRIPTOR.fields_by_name["share_id"]
    assert share_id.number == 5
    assert share_id.has_presence
    device = dra_v1_pb2.Device(pool_name="node-a", device_name="gpu-0")
    assert not device.HasField("share_id")
    device.share_id = ""
    assert device.HasField("share_id")  # presence, not just a value: "" is distinguishable from unset
    assert "share_id" not in dra_v1beta1_pb2.Device.DESCRIPTOR.fields_by_name


def test_field_numbers_follow_the_upstream_tables() -> None:
    def numbers(message: type[Message]) -> dict[str, int]:
        return {f.name: f.number for f in message.DESCRIPTOR.fields}

    assert numbers(pluginregistration_v1_pb2.PluginInfo) == {
        "type": 1,
        "name": 2,
        "endpoint": 3,
        "supported_versions": 4,
    }
    assert numbers(pluginregistration_v1_pb2.RegistrationStatus) == {"plugin_registered": 1, "error": 2}
    for dra in (dra_v1_pb2, dra_v1beta1_pb2):
        assert numbers(dra.Claim) == {"namespace": 1, "uid": 2, "name": 3}
        assert numbers(dra.NodePrepareResourceResponse) == {"devices": 1, "error": 2}
        assert numbers(dra.NodeUnprepareResourceResponse) == {"error": 1}
    assert numbers(dra_v1beta1_pb2.Device) == {
        "request_names": 1,
        "pool_name": 2,
        "device_name": 3,
        "cdi_device_ids": 4,
    }
    for health in (drahealth_v1alpha1_pb2, drahealth_v1_pb2):
        assert numbers(health.DeviceHealth) == {
            "device": 1,
            "health": 2,
            "last_updated_time": 3,
            "health_check_timeout_seconds": 4,
            "message": 5,
        }
        assert numbers(health.DeviceIdentifier) == {"pool_name": 1, "device_name": 2}
        assert {v.name: v.number for v in health.HealthStatus.DESCRIPTOR.values} == {
            "UNKNOWN": 0,
            "HEALTHY": 1,
            "UNHEALTHY": 2,
        }


def test_wire_compatible_between_v1beta1_and_v1() -> None:
    # A v1beta1 kubelet reading a v1 answer (and vice versa) must see the same fields.
    v1 = dra_v1_pb2.NodePrepareResourcesResponse()
    v1.claims["uid-1"].devices.add(
        request_names=["gpu"],
        pool_name="node-a",
        device_name="gpu-0",
        cdi_device_ids=["k8s.gpu.tessera.dev/claim=uid-1-gpu-0"],
        share_id="s",
    )
    beta = dra_v1beta1_pb2.NodePrepareResourcesResponse.FromString(v1.SerializeToString())
    (device,) = beta.claims["uid-1"].devices
    assert (list(device.request_names), device.pool_name, device.device_name, list(device.cdi_device_ids)) == (
        ["gpu"],
        "node-a",
        "gpu-0",
        ["k8s.gpu.tessera.dev/claim=uid-1-gpu-0"],
    )
