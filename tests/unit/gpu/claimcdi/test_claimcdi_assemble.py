"""build_claim_spec_file: spec-level edits from the toolkit plus control nodes, device entries, annotations, version."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

import cdi
from driver.gpu.claimcdi.assemble import (
    ClaimIdentity,
    DeviceEdits,
    build_claim_spec_file,
    cdi_device_name,
)

KIND = "k8s.gpu.tessera.dev/claim"
UID = "0b7c2f4e-1111-2222-3333-444455556666"
CLAIM = ClaimIdentity(UID, "team-a", "training")


def _toolkit_edits() -> dict[str, Any]:
    return {
        "env": ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu"],
        "deviceNodes": [{"path": "/dev/nvidiactl"}, {"path": "/dev/nvidia-uvm"}],
        "mounts": [{"hostPath": "/usr/lib/libcuda.so.580", "containerPath": "/usr/lib/libcuda.so.580",
                    "options": ["ro", "nosuid", "nodev", "bind"]}],
        "hooks": [{"hookName": "createContainer", "path": "/usr/bin/nvidia-cdi-hook",
                   "args": ["nvidia-cdi-hook", "update-ldcache"]}],
    }


CONTROL = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]


def _gpu0() -> DeviceEdits:
    return DeviceEdits("gpu-0", device_nodes=[{"path": "/dev/nvidia0"}],
                       annotations={"gpu.tessera.dev/device": "gpu-0"})


def _build(**overrides: Any) -> cdi.Spec:
    args: dict[str, Any] = {"kind": KIND, "claim": CLAIM, "devices": [_gpu0()], "common_edits": _toolkit_edits(),
                            "control_nodes": [{"path": p} for p in CONTROL],
                            "annotation_prefix": "gpu.tessera.dev"}
    args.update(overrides)
    return build_claim_spec_file(**args).spec


def _spec_edits(spec: cdi.Spec) -> dict[str, Any]:
    edits: dict[str, Any] = spec.to_wire()["containerEdits"]
    return edits


def test_control_nodes_are_merged_with_the_toolkit_nodes_without_duplicates() -> None:
    paths = [n["path"] for n in _spec_edits(_build())["deviceNodes"]]
    assert paths == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]


def test_control_nodes_keep_their_host_path_and_the_spec_version_follows() -> None:
    under_driver_root = [{"path": p, "hostPath": f"/run/nvidia/driver{p}"} for p in CONTROL]
    spec = _build(common_edits=None, control_nodes=under_driver_root)
    assert _spec_edits(spec)["deviceNodes"] == under_driver_root
    # A hostPath needs 0.5.0 (cdi/version.py); the claim annotations already need 0.6.0.
    assert spec.to_wire()["cdiVersion"] in ("0.6.0", "0.7.0", "0.8.0", "1.0.0", "1.1.0")
    # Nodes the toolkit already lists stay as the toolkit wrote them.
    toolkit = _toolkit_edits()
    toolkit["deviceNodes"] = [{"path": "/dev/nvidiactl", "hostPath": "/run/nvidia/driver/dev/nvidiactl"}]
    nodes = _spec_edits(_build(common_edits=toolkit, control_nodes=[{"path": p} for p in CONTROL]))["deviceNodes"]
    assert nodes[0] == {"path": "/dev/nvidiactl", "hostPath": "/run/nvidia/driver/dev/nvidiactl"}
    assert [n["path"] for n in nodes] == CONTROL


def test_toolkit_mounts_and_hooks_are_kept_at_spec_level() -> None:
    edits = _spec_edits(_build())
    assert [m["containerPath"] for m in edits["mounts"]] == ["/usr/lib/libcuda.so.580"]
    assert [h["path"] for h in edits["hooks"]] == ["/usr/bin/nvidia-cdi-hook"]


def test_visible_devices_void_comes_first_and_replaces_the_toolkit_value() -> None:
    env = _spec_edits(_build())["env"]
    assert env[0] == "NVIDIA_VISIBLE_DEVICES=void"
    assert [e for e in env if e.startswith("NVIDIA_VISIBLE_DEVICES=")] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert "NVIDIA_CTK_LIBCUDA_DIR=/usr/lib/x86_64-linux-gnu" in env


def test_toolkit_void_is_not_repeated() -> None:
    edits = _toolkit_edits()
    edits["env"] = ["NVIDIA_VISIBLE_DEVICES=void", "A=1"]
    assert _spec_edits(_build(common_edits=edits))["env"] == ["NVIDIA_VISIBLE_DEVICES=void", "A=1"]


def test_toolkit_edits_passed_in_are_not_modified() -> None:
    edits = _toolkit_edits()
    before = copy.deepcopy(edits)
    _build(common_edits=edits)
    assert edits == before


def test_without_toolkit_edits_the_spec_has_void_and_control_nodes_only() -> None:
    edits = _spec_edits(_build(common_edits=None))
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]
    assert [n["path"] for n in edits["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    assert "mounts" not in edits and "hooks" not in edits


def test_no_device_nodes_key_when_there_are_none() -> None:
    edits = _spec_edits(_build(common_edits=None, control_nodes=[]))
    assert "deviceNodes" not in edits
    assert edits["env"] == ["NVIDIA_VISIBLE_DEVICES=void"]


def test_devices_are_named_claim_uid_dash_device() -> None:
    mig = DeviceEdits("gpu-1-mig-1g10gb-6", device_nodes=[{"path": "/dev/nvidia1"}],
                      env=["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"],
                      mounts=[{"hostPath": "/var/mps/pipe", "containerPath": "/tmp/nvidia-mps", "options": ["bind"]}])
    spec = _build(devices=[_gpu0(), mig])
    assert [d.name for d in spec.devices] == [f"{UID}-gpu-0", f"{UID}-gpu-1-mig-1g10gb-6"]
    assert cdi_device_name(UID, "gpu-0") == f"{UID}-gpu-0"
    wire = spec.to_wire()["devices"]
    assert wire[0]["containerEdits"] == {"deviceNodes": [{"path": "/dev/nvidia0"}]}
    assert wire[0]["annotations"] == {"gpu.tessera.dev/device": "gpu-0"}
    assert wire[1]["containerEdits"]["env"] == ["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"]
    assert wire[1]["containerEdits"]["mounts"][0]["containerPath"] == "/tmp/nvidia-mps"
    assert "annotations" not in wire[1]


def test_spec_annotations_name_the_claim_and_carry_extras() -> None:
    spec = _build(annotations={"gpu.tessera.dev/driver-libraries": "from /etc/cdi/nvidia.yaml"})
    assert spec.annotations == {
        "gpu.tessera.dev/claim": "team-a/training",
        "gpu.tessera.dev/claim-uid": UID,
        "gpu.tessera.dev/driver-libraries": "from /etc/cdi/nvidia.yaml",
    }


def test_kind_is_the_given_kind() -> None:
    assert _build().kind == KIND


def test_cdi_version_is_the_computed_minimum() -> None:
    for common in (_toolkit_edits(), None):
        spec = _build(common_edits=common)
        assert spec.cdi_version == cdi.minimum_version(spec)
    # Spec annotations need 0.6.0 and nothing in a plain claim spec needs more.
    assert _build().cdi_version == "0.6.0"


def test_cdi_version_rises_with_toolkit_content_that_needs_it() -> None:
    edits = _toolkit_edits()
    edits["additionalGids"] = [44]  # needs 0.7.0
    spec = _build(common_edits=edits)
    assert spec.cdi_version == "0.7.0" == cdi.minimum_version(spec)


def test_spec_writes_and_reads_back(tmp_path: Path) -> None:
    spec = _build()
    path = cdi.write_spec(tmp_path, f"k8s.gpu.tessera.dev-claim_{UID}.json", spec)
    assert cdi.read_spec(path) == spec


def test_the_written_text_is_the_checked_spec_without_a_second_model_pass() -> None:
    mps = DeviceEdits("gpu-1", device_nodes=[{"path": "/dev/nvidia1"}],
                      env=["CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps"],
                      mounts=[{"hostPath": "/run/mps/d1", "containerPath": "/tmp/nvidia-mps",
                               "options": ["rw", "bind"]}],
                      annotations={"gpu.tessera.dev/z": "last", "gpu.tessera.dev/a": "first"})
    for toolkit in (_toolkit_edits(), None):
        args: dict[str, Any] = {"kind": KIND, "claim": CLAIM, "devices": [_gpu0(), mps], "common_edits": toolkit,
                                "control_nodes": [{"path": p} for p in CONTROL], "annotation_prefix": "gpu.tessera.dev",
                                "annotations": {"gpu.tessera.dev/timeslice": "{}"}}
        fast = build_claim_spec_file(**args)
        strict = cdi.Spec.from_text(fast.spec.to_json(), "strict")
        assert cdi.Spec.from_text(fast.text, "fast") == strict == fast.spec, "the text loads as the checked spec"
        assert json.loads(fast.text) == json.loads(fast.spec.to_json()), "and is what the model would write"


def test_a_spec_the_loader_would_reject_is_refused_before_any_text_exists() -> None:
    bad = DeviceEdits("gpu-0", device_nodes=[{"path": "/dev/nvidia0"}], env=["NOT-KEY-VALUE"])
    with pytest.raises(cdi.SpecError, match="is not KEY=VALUE"):
        build_claim_spec_file(kind=KIND, claim=CLAIM, devices=[bad], common_edits=None, control_nodes=[],
                              annotation_prefix="gpu.tessera.dev")
