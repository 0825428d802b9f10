"""Sharing plans converted from the GPU Operator's device plugin ConfigMap, run by the real driver process on a
simulated node that keeps its GPU Operator label: the shares the device plugin configs asked for are published."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from driver.gpu.published.devices import quantity_from_bytes
from driver.units import MIB
from tests.support.node import NODE, SimulatedNode

OPERATOR_LABEL = "nvidia.com/device-plugin.config"
CONFIGMAP = """\
kind: ConfigMap
metadata: {name: device-plugin-config, namespace: gpu-operator}
data:
  a100-ts: |-
    version: v1
    sharing:
      timeSlicing:
        resources: [{name: nvidia.com/gpu, replicas: 4}]
  a100-mps: |-
    version: v1
    sharing:
      mps:
        resources: [{name: nvidia.com/gpu, replicas: 3}]
"""
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def converted_node(tmp_path: Path) -> Iterator[SimulatedNode]:
    source = tmp_path / "configmap.yaml"
    source.write_text(CONFIGMAP)
    done = subprocess.run([sys.executable, "-m", "driver", "convert-plan", str(source)], capture_output=True,
                          text=True, timeout=60, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    sim_node = SimulatedNode("a100-80gb", plans=yaml.safe_load(done.stdout))
    sim_node.api.set_node_labels(NODE, {OPERATOR_LABEL: "a100-mps"})
    try:
        yield sim_node
    finally:
        sim_node.close()


def test_a_node_keeps_its_gpu_operator_label_and_gets_the_shares_its_config_named(
        converted_node: SimulatedNode) -> None:
    sim_node = converted_node
    sim_node.start("--sharing-plan-label", OPERATOR_LABEL)
    sim_node.wait_for_devices([f"gpu-{minor}-mps-{k}" for minor in (0, 1) for k in range(3)])
    share = next(d for d in sim_node.devices() if d["name"] == "gpu-0-mps-2")
    memory = sim_node.inventory.gpus[0].memory_bytes
    assert memory is not None
    # The device plugin's per-replica limits: memory / replicas in whole MiB, 100 / replicas percent.
    assert share["capacity"]["memory"] == {"value": quantity_from_bytes(memory // 3 // MIB * MIB)}
    assert share["attributes"]["activeThreadPercentage"] == {"int": 33}
    # The GPU Operator moves the node to another config by its label; so does the plan.
    sim_node.api.set_node_labels(NODE, {OPERATOR_LABEL: "a100-ts"})
    sim_node.wait_for_devices([f"gpu-{minor}-ts-{k}" for minor in (0, 1) for k in range(4)])
