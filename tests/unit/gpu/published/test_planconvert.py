"""NVIDIA device plugin sharing configs (a file, or the GPU Operator's ConfigMap of them) converted into
sharing plans by ``convert-plan``: what each field becomes, what is reported, and the exit status."""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.cli import main
from driver.gpu.published.deviceplugincfg import DevicePluginConfig
from driver.gpu.published.planconvert import convert
from driver.gpu.published.sharingplan import load_plans, resolve_layout
from driver.nodelayout import SIMULATED_NODE_NAME
from driver.simulation.discovery import SimulatedDiscovery
from driver.units import MIB

PROG = "python -m driver convert-plan"

# The issue's example: what a GPU Operator user with MIG in mixed mode writes.
MIXED_TIME_SLICING = """\
version: v1
flags:
  migStrategy: mixed
sharing:
  timeSlicing:
    renameByDefault: false
    failRequestsGreaterThanOne: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
    - name: nvidia.com/mig-1g.10gb
      replicas: 2
"""

# The GPU Operator's shape: one config per key, a node picks one by nvidia.com/device-plugin.config.
OPERATOR_CONFIGMAP = """\
apiVersion: v1
kind: ConfigMap
metadata: {name: device-plugin-config, namespace: gpu-operator}
data:
  h100-ts: |-
    version: v1
    flags: {migStrategy: none}
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/gpu
          replicas: 8
  h100-mps: |-
    version: v1
    sharing:
      mps:
        resources:
        - name: nvidia.com/gpu
          replicas: 4
"""


def run_cli(argv: Sequence[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, list[str]]:
    try:
        status = main(list(argv))
    except SystemExit as exc:
        status = int(exc.code or 0)
    out, err = capsys.readouterr()
    return status, out, err.splitlines()


@pytest.fixture(autouse=True)
def _keep_umask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("driver.cli.os.umask", lambda mask: 0o022)


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def config(text: str) -> DevicePluginConfig:
    return DevicePluginConfig.model_validate(yaml.safe_load(textwrap.dedent(text)))


def one_plan(text: str, strategy: str = "none") -> tuple[list[dict[str, Any]], list[str], bool]:
    """The entries of the plan converted from a config whose sharing section is ``text``."""
    result = convert({"p": config(f"version: v1\nflags: {{migStrategy: {strategy}}}\n" + textwrap.dedent(text))}, None)
    return (result.plans["plans"]["p"].get("gpus", []), [f.line() for f in result.findings], result.differs)


def test_the_issues_mixed_time_slicing_config_becomes_gpu_and_mig_profile_entries(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, MIXED_TIME_SLICING, "time-slicing.yaml")
    status, out, err = run_cli(["convert-plan", str(path)], capsys)
    assert status == 0
    plans = yaml.safe_load(out)
    # A single config served every node the plugin ran on: it is the plan of nodes without the label.
    assert plans == {"defaultPlan": "time-slicing", "plans": {"time-slicing": {"gpus": [
        {"match": {"all": True}, "timeSlicing": {"shares": 4}, "allowMultipleSharesPerClaim": False},
        {"match": {"migProfile": "1g.10gb"}, "timeSlicing": {"shares": 2}, "allowMultipleSharesPerClaim": False},
    ]}}}
    assert "- match: {migProfile: 1g.10gb}" in out  # one line per match, as in the docs
    assert err == [f"{PROG}: time-slicing: sharing.timeSlicing.failRequestsGreaterThanOne: allowMultipleSharesPerClaim:"
                   " false refuses a claim holding two shares of one GPU; a claim for shares of different GPUs is "
                   "admitted, where the device plugin failed every request for more than one replica"]
    # The converted plan is valid on a node with whole and MIG GPUs, and shares each as the device plugin did.
    converted = write(tmp_path, out, "plans.yaml")
    status, checked, _ = run_cli(["check-plan", str(converted), "--simulate", "demo"], capsys)
    assert status == 0
    assert "1g.10gb at 6 as 2 time-sliced shares" in checked
    assert "NVIDIA L4: plans.time-slicing.gpus[0] -> 4 time-sliced shares" in checked


def test_the_gpu_operators_configmap_becomes_one_plan_per_key_and_passes_check_plan(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, OPERATOR_CONFIGMAP, "configmap.yaml")
    status, out, err = run_cli(["convert-plan", str(path), "--default", "h100-ts"], capsys)
    assert status == 0, err
    plans = yaml.safe_load(out)
    assert plans["defaultPlan"] == "h100-ts"
    assert plans["plans"] == {
        "h100-ts": {"gpus": [{"match": {"all": True}, "timeSlicing": {"shares": 8},
                              "allowMultipleSharesPerClaim": True}]},
        "h100-mps": {"gpus": [{"match": {"all": True}, "mps": {"shares": 4},
                               "allowMultipleSharesPerClaim": False}]},
    }
    assert "nvidia.com/device-plugin.config" in out  # the header says how nodes keep their labels
    converted = write(tmp_path, out, "plans.yaml")
    for plan in ("h100-ts", "h100-mps"):
        status, checked, _ = run_cli(["check-plan", str(converted), "--simulate", "dgx-h100", "--plan", plan], capsys)
        assert status == 0
        assert f"{converted}: valid; 2 plan(s), defaultPlan h100-ts" in checked


def test_without_default_a_configmaps_unlabelled_nodes_publish_whole_gpus(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, _ = run_cli(["convert-plan", str(write(tmp_path, OPERATOR_CONFIGMAP))], capsys)
    assert status == 0
    assert "defaultPlan" not in yaml.safe_load(out)


def test_converted_mps_shares_get_the_device_plugins_per_replica_limits(tmp_path: Path) -> None:
    entries, _, _ = one_plan("""\
        sharing:
          mps:
            resources: [{name: nvidia.com/gpu, replicas: 3}]
        """)
    plans = tmp_path / "plans.yaml"
    plans.write_text(yaml.safe_dump({"plans": {"p": {"gpus": entries}}}))
    plan = load_plans(plans).plans["p"]
    inventory = SimulatedDiscovery("dgx-h100", SIMULATED_NODE_NAME).discover()
    layout = resolve_layout(plan, inventory, "p")
    for gpu in inventory.gpus:
        shares = layout[gpu.uuid]
        assert gpu.memory_bytes is not None
        # k8s-device-plugin mps/daemon.go: "%vM" of totalMemory/replicas/1024/1024, and 100/replicas.
        assert shares.memory_bytes_per_share == gpu.memory_bytes // 3 // 1024 // 1024 * MIB
        assert shares.active_thread_percentage == 100 // 3 == 33
        assert shares.mps_clients == "nonRoot"


def test_fail_requests_greater_than_one_defaults_as_the_device_plugin_and_maps_onto_multiple_shares() -> None:
    ts, _, _ = one_plan("sharing: {timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n")
    mps, _, _ = one_plan("sharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n")
    relaxed, findings, _ = one_plan(
        "sharing: {mps: {failRequestsGreaterThanOne: false, resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n")
    assert ts[0]["allowMultipleSharesPerClaim"] is True  # time slicing: default false
    assert mps[0]["allowMultipleSharesPerClaim"] is False  # MPS: default true
    assert relaxed[0]["allowMultipleSharesPerClaim"] is True
    assert not any("failRequestsGreaterThanOne" in line for line in findings)


def test_single_strategy_shares_the_mig_instances_nvidia_com_gpu_names_there() -> None:
    entries, findings, differs = one_plan("""\
        sharing:
          timeSlicing:
            resources: [{name: nvidia.com/gpu, replicas: 3}]
        """, strategy="single")
    assert [e["match"] for e in entries] == [{"migProfile": "*"}, {"all": True}]
    assert all(e["timeSlicing"] == {"shares": 3} for e in entries)
    assert not differs and findings == []


def test_mig_resources_outside_mixed_shared_nothing_and_are_left_out_without_failing() -> None:
    entries, findings, differs = one_plan("""\
        sharing:
          timeSlicing:
            resources: [{name: nvidia.com/gpu, replicas: 2}, {name: nvidia.com/mig-1g.10gb, replicas: 2}]
        """, strategy="none")
    assert [e["match"] for e in entries] == [{"all": True}]
    assert findings == ["p: sharing.timeSlicing.resources[1] (nvidia.com/mig-1g.10gb): the device plugin serves "
                        "nvidia.com/mig-1g.10gb only under migStrategy mixed (here none), so it shared nothing: "
                        "not converted"]
    assert not differs


def test_mps_on_mig_instances_is_converted_with_a_line_saying_the_device_plugin_refused_it() -> None:
    entries, findings, differs = one_plan(
        "sharing: {mps: {resources: [{name: nvidia.com/mig-3g.40gb, replicas: 2}]}}\n", strategy="mixed")
    assert entries == [{"match": {"migProfile": "3g.40gb"}, "mps": {"shares": 2}, "allowMultipleSharesPerClaim": False}]
    assert any("refuses MPS on MIG devices" in line for line in findings)
    assert not differs


def test_rename_by_default_is_reported_as_a_difference() -> None:
    _, findings, differs = one_plan(
        "sharing: {timeSlicing: {renameByDefault: true, resources: [{name: nvidia.com/gpu, replicas: 2}]}}\n")
    assert differs
    assert findings == ["p: sharing.timeSlicing.renameByDefault: the device plugin served the shares as <name>.shared; "
                        "Tessera has no resource names: the shares are devices of DeviceClass "
                        "timeslice.gpu.tessera.dev, so pods that asked for nvidia.com/gpu.shared need a claim "
                        "(docs/migration.md)"]


def test_rename_and_devices_the_device_plugin_ignores_are_reported_and_every_gpu_is_shared() -> None:
    entries, findings, differs = one_plan("""\
        sharing:
          timeSlicing:
            resources:
            - name: nvidia.com/gpu
              replicas: 2
              rename: nvidia.com/gpu-light
              devices: [0, "GPU-8f3b1c2e-1111-2222-3333-444455556666"]
        """)
    assert [e["match"] for e in entries] == [{"all": True}]
    assert len(findings) == 2
    assert findings[0].startswith("p: sharing.timeSlicing.resources[0] (nvidia.com/gpu): rename nvidia.com/gpu-light: "
                                  "the device plugin ignores it")
    assert "devices [0, 'GPU-8f3b1c2e-1111-2222-3333-444455556666']: the device plugin ignores it" in findings[1]
    assert "match: {minor: N} or {uuid: GPU-...}" in findings[1]
    assert not differs


def test_replicas_beyond_a_plans_limit_are_capped_and_one_replica_shares_nothing() -> None:
    entries, findings, differs = one_plan("""\
        sharing:
          timeSlicing:
            resources: [{name: nvidia.com/gpu, replicas: 64}, {name: nvidia.com/mig-1g.10gb, replicas: 1}]
        """, strategy="mixed")
    assert entries == [{"match": {"all": True}, "timeSlicing": {"shares": 48}, "allowMultipleSharesPerClaim": True}]
    assert differs
    assert any("replicas 64: a plan splits a device into at most 48 shares; converted to 48" in f for f in findings)
    assert any("replicas 1 shares nothing" in f for f in findings)


def test_compute_instance_profiles_and_repeated_resources_are_differences() -> None:
    entries, findings, differs = one_plan("""\
        sharing:
          timeSlicing:
            resources:
            - {name: nvidia.com/mig-1c.3g.20gb, replicas: 2}
            - {name: nvidia.com/gpu, replicas: 2}
            - {name: nvidia.com/gpu, replicas: 4}
        """, strategy="mixed")
    assert entries == [{"match": {"all": True}, "timeSlicing": {"shares": 2}, "allowMultipleSharesPerClaim": True}]
    assert differs
    assert any("1c.3g.20gb is a compute-instance profile" in f for f in findings)
    assert any("resources[2] (nvidia.com/gpu): a second entry for the same resource" in f for f in findings)


def test_with_both_sharing_forms_mps_wins_as_in_the_device_plugin() -> None:
    entries, findings, _ = one_plan("""\
        sharing:
          timeSlicing: {resources: [{name: nvidia.com/gpu, replicas: 8}]}
          mps: {resources: [{name: nvidia.com/gpu, replicas: 2}]}
        """)
    assert entries == [{"match": {"all": True}, "mps": {"shares": 2}, "allowMultipleSharesPerClaim": False}]
    assert any(f.startswith("p: sharing.timeSlicing: ignored") for f in findings)


def test_operational_flags_resources_and_imex_are_each_one_line(tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, """\
        version: v1
        flags: {migStrategy: none, failOnInitError: true, nvidiaDriverRoot: /run/nvidia/driver}
        resources:
          gpus: [{pattern: "*A100*", name: a100}]
        imex: {channelIDs: [0]}
        """, "node.yaml")
    status, out, err = run_cli(["convert-plan", str(path)], capsys)
    assert status == 1  # the IMEX channels are no longer handed out
    assert yaml.safe_load(out) == {"defaultPlan": "node", "plans": {"node": {}}}
    assert [line.split(": ")[2] for line in err] == ["flags.failOnInitError", "flags.nvidiaDriverRoot", "resources",
                                                     "imex"]


def test_a_config_without_sharing_publishes_every_gpu_whole() -> None:
    entries, findings, differs = one_plan("sharing: {}\n")
    assert entries == [] and findings == [] and not differs


def test_a_key_no_node_label_could_name_is_not_converted() -> None:
    result = convert({"bad key!": config("version: v1\n")}, "bad key!")
    assert result.plans == {"plans": {}}
    assert result.differs and result.findings[0].line().startswith("bad key!: not a label value")


@pytest.mark.parametrize(("text", "expected"), [
    ("version: v1\nsharing:\n  timeSlicing:\n    resources:\n    - {name: nvidia.com/gpu, replica: 4}\n",
     "sharing.timeSlicing.resources[0]: unknown field \"replica\" (known fields: name, replicas, rename, devices)"),
    ("version: v2\n", "version: \"v2\" is not allowed; expected 'v1'"),
    ("sharing:\n  mps:\n    resources: [{name: amd.com/gpu, replicas: 2}]\n",
     'sharing.mps.resources[0].name: "amd.com/gpu" is not an NVIDIA resource name'),
    ("sharing:\n  mps:\n    resources: [{name: nvidia.com/gpu, replicas: 2, devices: some}]\n",
     "sharing.mps.resources[0].devices: expected \"all\", a count, or a list of GPU indices, MIG indices or UUIDs, "
     "got 'some'"),
    ("flags: {migStrategy: auto}\n",
     "flags.migStrategy: \"auto\" is not allowed; expected 'none', 'single' or 'mixed'"),
    ("sharing: {mps: {resources: []}}\n", "sharing.mps.resources: no resources to share"),
    ("sharing: {mps: {resources: [{name: nvidia.com/gpu, replicas: 0}]}}\n",
     "sharing.mps.resources[0].replicas: must be at least 1, got 0"),
])
def test_a_config_that_is_not_the_device_plugins_is_refused_naming_the_field(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str) -> None:
    path = write(tmp_path, text)
    status, out, err = run_cli(["convert-plan", str(path)], capsys)
    assert status == 2 and out == ""
    assert any(line.startswith(f"{PROG}: {path}: {expected}") for line in err), err


def test_a_configmap_key_that_is_not_yaml_is_refused_naming_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, "kind: ConfigMap\ndata:\n  good: 'version: v1'\n  broken: '{version: v1'\n")
    status, out, err = run_cli(["convert-plan", str(path)], capsys)
    assert status == 2 and out == ""
    assert len(err) == 1 and err[0].startswith(f"{PROG}: {path}: data.broken: not valid YAML")


def test_unreadable_input_and_an_unknown_default_are_usage_errors(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    status, out, err = run_cli(["convert-plan", str(tmp_path / "missing.yaml")], capsys)
    assert (status, out) == (2, "") and "cannot read the file" in err[0]
    path = write(tmp_path, OPERATOR_CONFIGMAP)
    status, out, err = run_cli(["convert-plan", str(path), "--default", "a100"], capsys)
    assert (status, out) == (2, "")
    assert err == [f"{PROG}: --default 'a100': no such config in {path}; keys: h100-ts, h100-mps "
                   f"({PROG} --help lists the flags)"]
    status, _, err = run_cli(["convert-plan", str(path), "--plan", "x"], capsys)
    assert status == 2 and "unrecognized arguments: --plan x" in err[0]
