"""The chart's MPS host DaemonSet and how the plugin's DaemonSet reaches it."""

from __future__ import annotations

import argparse
from typing import Any

import helm_python
import kubernetes_validate  # type: ignore[import-untyped]
import pytest

from deploy.render import render_objects
from driver.commands.mpshost import add_host_arguments
from tests.unit.test_deploy import KUBE_VERSIONS, Obj, daemonset, env_value, plugin_container, pod_spec

DATA_DIR = "/var/lib/kubelet/plugins/gpu.tessera.dev"
OPERATOR: dict[str, Any] = {"nvidiaDriverRoot": "/run/nvidia/driver"}


def host_pod(objects: list[Obj]) -> Obj:
    spec: Obj = daemonset(objects, "mps-host")["spec"]["template"]["spec"]
    return spec


def host_container(objects: list[Obj]) -> Obj:
    containers: list[Obj] = host_pod(objects)["containers"]
    assert [c["name"] for c in containers] == ["mps-host"]
    return containers[0]


def host_args(objects: list[Obj]) -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_host_arguments(parser)  # the rendered args must parse as the real command line does
    container = host_container(objects)
    assert container["command"] == ["python", "-m", "driver"] and container["args"][0] == "mps-host"
    parsed: dict[str, Any] = vars(parser.parse_args(container["args"][1:]))
    return parsed


def mount_sources(objects: list[Obj], container: Obj) -> dict[str, str]:
    """Container path -> host path, for the MPS host's pod."""
    volumes = {v["name"]: v for v in host_pod(objects)["volumes"]}
    return {m["mountPath"]: volumes[m["name"]]["hostPath"]["path"] for m in container["volumeMounts"]
            if "hostPath" in volumes[m["name"]]}


@pytest.fixture(scope="module")
def operator_objects() -> list[Obj]:
    return render_objects(OPERATOR)


@pytest.mark.parametrize("version", KUBE_VERSIONS)
@pytest.mark.parametrize("values", [OPERATOR, {"mps": {"host": {"privateShm": False}}}])
def test_host_daemonset_variants_are_schema_valid(values: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(daemonset(render_objects(values), "mps-host"), version, strict=True)


def test_host_is_updated_only_on_delete_and_runs_where_the_plugin_runs(default_objects: list[Obj]) -> None:
    host = daemonset(default_objects, "mps-host")
    assert host["spec"]["updateStrategy"] == {"type": "OnDelete"}
    for key in ("nodeSelector", "tolerations", "priorityClassName"):
        assert host_pod(default_objects)[key] == pod_spec(default_objects)[key]
    spec = host_pod(default_objects)
    assert spec["hostPID"] is True and spec["automountServiceAccountToken"] is False
    container = host_container(default_objects)
    assert container["securityContext"]["privileged"] is True
    assert container["resources"]["limits"]["memory"] == "4Gi", "its own limit, not the plugin's"


def test_plugin_and_host_meet_at_one_socket_and_one_mps_directory(default_objects: list[Obj]) -> None:
    args = host_args(default_objects)
    socket_path = env_value(plugin_container(default_objects), "MPS_HOST_SOCKET")
    assert str(args["socket"]) == socket_path == f"{DATA_DIR}/mps-host/mps-host.sock"
    # The plugin keeps daemons in <plugins dir>/<driver>/mps (Settings.state_dir / "mps").
    plugins_dir = env_value(plugin_container(default_objects), "KUBELET_PLUGINS_DIRECTORY_PATH")
    assert str(args["mps_dir"]) == f"{plugins_dir}/gpu.tessera.dev/mps"
    sources = mount_sources(default_objects, host_container(default_objects))
    assert sources[f"{DATA_DIR}/mps-host"] == f"{DATA_DIR}/mps-host"
    assert sources[f"{DATA_DIR}/mps"] == f"{DATA_DIR}/mps"
    # The plugin reaches the socket through its own mount of its data directory.
    plugin_mounts = {m["mountPath"] for m in plugin_container(default_objects)["volumeMounts"]}
    assert DATA_DIR in plugin_mounts


def test_with_the_host_the_plugin_neither_mounts_nor_uses_a_dev_shm(default_objects: list[Obj]) -> None:
    assert "initContainers" not in pod_spec(default_objects)
    assert "/dev/shm" not in {m["mountPath"] for m in plugin_container(default_objects)["volumeMounts"]}


def test_private_shm_gives_each_daemon_a_tmpfs_of_its_own_mounted_by_the_host(default_objects: list[Obj]) -> None:
    args = host_args(default_objects)
    assert args["private_shm"] is True and args["shm_tmpfs"] is True
    # No tmpfs over the whole MPS directory: the driver's own files (restart records, logs, pipe
    # directories) stay on the node's disk, which tenants cannot write.
    assert "initContainers" not in host_pod(default_objects)
    mounts = {m["mountPath"]: m for m in host_container(default_objects)["volumeMounts"]}
    assert mounts[f"{DATA_DIR}/mps"]["mountPropagation"] == "Bidirectional"
    assert host_container(default_objects)["securityContext"]["privileged"] is True  # Bidirectional needs it
    assert "/dev/shm" not in mounts
    assert env_value(plugin_container(default_objects), "MPS_SHM_SIZE") == "1Gi"
    assert "shm_size" in args and args["shm_size"] is not None


def test_without_private_shm_the_shared_tmpfs_is_the_hosts_dev_shm() -> None:
    objects = render_objects({"mps": {"host": {"privateShm": False}}})
    assert host_args(objects)["private_shm"] is False
    (init,) = host_pod(objects)["initContainers"]
    assert f'dir="{DATA_DIR}/mps-shm"' in init["command"][-1] and "mode=1777" in init["command"][-1]
    assert mount_sources(objects, host_container(objects))["/dev/shm"] == f"{DATA_DIR}/mps-shm"


def test_host_installed_driver_is_not_chrooted_and_sees_only_the_driver_dirs(default_objects: list[Obj]) -> None:
    assert host_args(default_objects)["chroot"] is False
    sources = mount_sources(default_objects, host_container(default_objects))
    assert sources["/driver-root/usr"] == "/usr"
    assert "/driver-root" not in sources, "never the whole host root"


def test_operator_driver_root_is_chrooted_into_with_the_mps_directory_visible_inside(
    operator_objects: list[Obj],
) -> None:
    args = host_args(operator_objects)
    assert args["chroot"] is True and str(args["driver_root"]) == "/driver-root"
    container = host_container(operator_objects)
    sources = mount_sources(operator_objects, container)
    assert sources["/driver-root"] == "/run/nvidia/driver"
    assert sources[f"{DATA_DIR}/mps"] == f"{DATA_DIR}/mps"
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    assert mounts["/driver-root"]["mountPropagation"] == "HostToContainer"
    # The host makes <root><mps dir> to bind the MPS directory there for each chrooted daemon.
    assert not mounts["/driver-root"].get("readOnly", False)


def test_disabling_the_host_restores_daemons_in_the_plugin() -> None:
    objects = render_objects({"mps": {"host": {"enabled": False}}})
    assert [o for o in objects if o["kind"] == "DaemonSet" and o["metadata"]["name"].endswith("mps-host")] == []
    assert "MPS_HOST_SOCKET" not in {e["name"] for e in plugin_container(objects)["env"]}
    assert "initContainers" not in pod_spec(objects)
    assert env_value(plugin_container(objects), "MPS_SHM_TMPFS") == "true"


def test_host_without_host_pid_is_a_render_error_naming_the_value() -> None:
    with pytest.raises(helm_python.HelmError, match=r"mps\.hostPID: must be true while mps\.host\.enabled"):
        render_objects({"mps": {"hostPID": False}})

