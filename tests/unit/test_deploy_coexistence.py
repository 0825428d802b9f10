"""The chart beside NVIDIA's device plugin: it keeps off the nodes the GPU Operator deploys the device plugin on,
lets the plugin see the device plugin's sockets, passes the GPUs it owns, and selects converted plans by the
GPU Operator's own label."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from deploy.render import render_objects
from driver.config import settings_from_values
from driver.gpu.published.sharingplan import load_plans, select_plan
from tests.unit.test_deploy import (
    Obj,
    daemonset,
    env_of,
    env_value,
    mounts_by_name,
    plans_file,
    plugin_container,
    volumes_by_name,
)

REPO = Path(__file__).resolve().parents[2]
DEVICE_PLUGIN_LABEL = "nvidia.com/gpu.deploy.device-plugin"
OPERATOR_LABEL = "nvidia.com/device-plugin.config"


def node_terms(spec: Obj) -> list[Obj]:
    terms: list[Obj] = spec["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    return terms


def test_both_daemonsets_keep_off_nodes_the_gpu_operator_runs_its_device_plugin_on(
        default_objects: list[Obj]) -> None:
    expected = {"key": DEVICE_PLUGIN_LABEL, "operator": "NotIn", "values": ["true"]}
    for component in ("kubelet-plugin", "mps-host"):
        spec = daemonset(default_objects, component)["spec"]["template"]["spec"]
        # One term, so the rule holds on every node the plugin may run on; NotIn also admits unlabelled nodes.
        [term] = node_terms(spec)
        assert term["matchExpressions"] == [expected]


def test_the_device_plugin_directory_is_seen_read_only_at_its_host_path(default_objects: list[Obj]) -> None:
    for values, directory in ((None, "/var/lib/kubelet/device-plugins"),
                              ({"kubeletDir": "/var/lib/k0s/kubelet/"}, "/var/lib/k0s/kubelet/device-plugins")):
        objects = default_objects if values is None else render_objects(values)
        container = plugin_container(objects)
        assert env_value(container, "KUBELET_DEVICE_PLUGINS_DIRECTORY_PATH") == directory
        mount = mounts_by_name(container)["device-plugins"]
        assert mount == {"name": "device-plugins", "mountPath": directory, "readOnly": True}
        assert volumes_by_name(objects)["device-plugins"]["hostPath"]["path"] == directory


def test_owned_gpus_reach_the_plugin_and_are_checked_by_the_schema(default_objects: list[Obj]) -> None:
    assert "OWNED_GPUS" not in env_of(plugin_container(default_objects))
    owned = ["0", "GPU-8f3b1c2e-1111-2222-3333-444455556666"]
    value = env_value(plugin_container(render_objects({"ownedGpus": owned})), "OWNED_GPUS")
    assert value == "0,GPU-8f3b1c2e-1111-2222-3333-444455556666"
    assert settings_from_values({"owned_gpus": value}).owned_gpus == value  # what the plugin accepts
    with pytest.raises(helm_python.HelmError, match="ownedGpus"):
        render_objects({"ownedGpus": ["MIG-1234"]})


def test_converted_plans_in_the_chart_select_by_the_gpu_operators_label(tmp_path: Path) -> None:
    configmap = tmp_path / "configmap.yaml"
    configmap.write_text(textwrap.dedent("""\
        kind: ConfigMap
        data:
          t4-ts: |-
            version: v1
            sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 4}]}}
        """))
    converted = subprocess.run([sys.executable, "-m", "driver", "convert-plan", str(configmap)], capture_output=True,
                               text=True, timeout=60, cwd=REPO, check=True).stdout
    values: dict[str, Any] = {"sharing": {"planLabel": OPERATOR_LABEL, **yaml.safe_load(converted)}}
    objects = render_objects(values)
    assert env_value(plugin_container(objects), "SHARING_PLAN_LABEL") == OPERATOR_LABEL
    plans_path = tmp_path / "plans.yaml"
    plans_path.write_text(yaml.safe_dump(plans_file(objects)))
    settings = settings_from_values({"sharing_plan_label": env_value(plugin_container(objects), "SHARING_PLAN_LABEL")})
    name, plan = select_plan(load_plans(plans_path), {OPERATOR_LABEL: "t4-ts"}, settings.sharing_plan_label)
    assert name == "t4-ts" and plan.gpus[0].timeSlicing is not None and plan.gpus[0].timeSlicing.shares == 4
