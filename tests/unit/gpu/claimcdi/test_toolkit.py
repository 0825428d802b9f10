"""load_toolkit_edits: the explicit spec, auto-detection over candidates, and the problems reported."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import yaml

from driver.gpu.claimcdi.toolkit import (
    DEFAULT_TOOLKIT_SPEC_PATHS,
    has_libcuda,
    load_toolkit_edits,
    toolkit_spec_candidates,
    toolkit_spec_changed,
)
from driver.simulation.discovery import SimulatedDiscovery
from driver.simulation.hostroot import toolkit_spec


def _spec() -> dict[str, Any]:
    return toolkit_spec(SimulatedDiscovery("l4", "node-a").discover())


def _write_spec(path: Path, spec: dict[str, Any] | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec if spec is not None else _spec()))
    return path


def test_explicit_spec_is_used(tmp_path: Path) -> None:
    path = _write_spec(tmp_path / "custom" / "nvidia.yaml")
    result = load_toolkit_edits(path, candidates=())
    assert result.source == path
    assert result.problem is None
    assert result.edits is not None
    assert result.edits["env"] == _spec()["containerEdits"]["env"]
    assert [n["path"] for n in result.edits["deviceNodes"]] == ["/dev/nvidiactl", "/dev/nvidia-uvm",
                                                                "/dev/nvidia-uvm-tools"]
    assert result.status == f"from {path}"


def test_json_spec_is_read_too(tmp_path: Path) -> None:
    path = tmp_path / "nvidia.json"
    path.write_text(json.dumps(_spec()))
    result = load_toolkit_edits(path)
    assert result.edits is not None and result.source == path


def test_auto_detect_takes_the_first_existing_candidate(tmp_path: Path) -> None:
    missing = tmp_path / "etc" / "cdi" / "nvidia.yaml"
    second = _write_spec(tmp_path / "etc" / "cdi" / "nvidia.json")
    spec = _spec()
    spec["containerEdits"]["env"] = ["FROM_THIRD=1"]
    third = _write_spec(tmp_path / "run" / "cdi" / "nvidia.yaml", spec)
    result = load_toolkit_edits(None, candidates=(missing, second, third))
    assert result.source == second
    assert result.edits is not None and "FROM_THIRD=1" not in result.edits["env"]


def test_auto_detect_skips_directories(tmp_path: Path) -> None:
    directory = tmp_path / "nvidia.yaml"
    directory.mkdir()
    real = _write_spec(tmp_path / "other.yaml")
    assert load_toolkit_edits(None, candidates=(directory, real)).source == real


def test_explicit_path_is_not_replaced_by_a_candidate(tmp_path: Path) -> None:
    candidate = _write_spec(tmp_path / "found.yaml")
    explicit = tmp_path / "named-by-operator.yaml"
    result = load_toolkit_edits(explicit, candidates=(candidate,))
    assert result.edits is None and result.source is None
    assert result.problem is not None and str(explicit) in result.problem
    assert str(candidate) not in result.problem


def test_nothing_found_tells_how_to_fix_it(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.json"
    with caplog.at_level(logging.WARNING, logger="driver.gpu.claimcdi.toolkit"):
        result = load_toolkit_edits(None, candidates=(a, b))
    assert result.source is None and result.edits is None
    assert result.problem is not None
    assert "nvidia-ctk cdi generate" in result.problem
    assert str(a) in result.problem and str(b) in result.problem
    assert result.status == f"not injected: {result.problem}"
    # Required by default: the node is not ready, and the log says so at error level.
    assert result.readiness_problem is not None and "nvidia-ctk cdi generate" in result.readiness_problem
    assert any(r.levelno == logging.ERROR and "not ready" in r.getMessage() for r in caplog.records)


def test_operator_can_accept_a_node_without_driver_libraries(tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="driver.gpu.claimcdi.toolkit"):
        result = load_toolkit_edits(None, candidates=(tmp_path / "a.yaml",), required=False)
    assert result.problem is not None and result.status == f"not injected: {result.problem}"
    assert result.readiness_problem is None
    assert all(r.levelno == logging.WARNING and "not ready" not in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("content", ["cdiVersion: [unclosed", "cdiVersion: 0.5.0\nkind: nvidia.com/gpu\n",
                                     "cdiVersion: 9.9.9\nkind: nvidia.com/gpu\ndevices: []\n", "just a string"])
def test_invalid_spec_problem_names_the_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "nvidia.yaml"
    path.write_text(content)
    result = load_toolkit_edits(path)
    assert result.edits is None
    assert result.source == path
    assert result.problem is not None and str(path) in result.problem and "invalid" in result.problem
    assert result.status.startswith("not injected: ")


def test_spec_without_spec_level_edits_is_as_bad_as_none(tmp_path: Path) -> None:
    spec = _spec()
    del spec["containerEdits"]
    path = _write_spec(tmp_path / "nvidia.yaml", spec)
    result = load_toolkit_edits(path)
    assert result.edits == {}
    assert result.problem is not None and "libcuda" in result.problem and str(path) in result.problem
    assert result.readiness_problem is not None


def test_spec_without_libcuda_is_named_as_such(tmp_path: Path) -> None:
    spec = _spec()
    spec["containerEdits"]["mounts"] = [m for m in spec["containerEdits"]["mounts"]
                                        if "libcuda" not in m["containerPath"]]
    path = _write_spec(tmp_path / "nvidia.yaml", spec)
    required = load_toolkit_edits(path)
    assert required.problem is not None and "mounts no libcuda.so*" in required.problem
    assert required.readiness_problem is not None
    # Accepted by the operator: the other edits are still injected, and the gap is in the status.
    accepted = load_toolkit_edits(path, required=False)
    assert accepted.edits is not None and accepted.edits["mounts"] == spec["containerEdits"]["mounts"]
    assert accepted.readiness_problem is None
    assert accepted.status.startswith(f"from {path}, but ") and "libcuda" in accepted.status


def test_a_usable_spec_is_ready() -> None:
    assert has_libcuda(_spec()["containerEdits"])
    assert not has_libcuda({"mounts": [{"hostPath": "/usr/lib/libnvidia-ml.so.1",
                                        "containerPath": "/usr/lib/libnvidia-ml.so.1"}]})


def test_candidates_put_the_operators_spec_first_and_the_cdi_root_before_etc(tmp_path: Path) -> None:
    root, etc = tmp_path / "run" / "cdi", tmp_path / "etc" / "cdi"
    assert toolkit_spec_candidates(root, etc) == (
        root / "management.nvidia.com-gpu.yaml", root / "management.nvidia.com-gpu.json",
        etc / "management.nvidia.com-gpu.yaml", etc / "management.nvidia.com-gpu.json",
        root / "nvidia.yaml", root / "nvidia.json", etc / "nvidia.yaml", etc / "nvidia.json")
    # A CDI root that is /etc/cdi itself lists each file once.
    assert len(toolkit_spec_candidates(etc, etc)) == 4
    assert toolkit_spec_candidates(Path("/var/run/cdi"), Path("/etc/cdi")) == DEFAULT_TOOLKIT_SPEC_PATHS


def test_the_operators_spec_wins_over_a_stale_hand_made_one(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    root, etc = tmp_path / "run" / "cdi", tmp_path / "etc" / "cdi"
    stale = _spec()
    stale["containerEdits"]["env"] = ["STALE=1"]
    _write_spec(etc / "nvidia.yaml", stale)
    _write_spec(root / "nvidia.yaml", stale)
    operator = _write_spec(root / "management.nvidia.com-gpu.yaml")
    with caplog.at_level(logging.INFO, logger="driver.gpu.claimcdi.toolkit"):
        result = load_toolkit_edits(None, toolkit_spec_candidates(root, etc))
    assert result.source == operator and result.edits is not None and "STALE=1" not in result.edits["env"]
    assert result.also_found == (root / "nvidia.yaml", etc / "nvidia.yaml")
    assert any("several" in r.getMessage() for r in caplog.records)


def test_a_regenerated_spec_is_noticed(tmp_path: Path) -> None:
    path = _write_spec(tmp_path / "nvidia.yaml")
    loaded = load_toolkit_edits(path)
    assert not toolkit_spec_changed(loaded, path)
    spec = _spec()
    spec["containerEdits"]["env"] = ["NVIDIA_VISIBLE_DEVICES=void", "NEW_DRIVER=1"]
    replacement = _write_spec(tmp_path / "nvidia.new.yaml", spec)
    replacement.replace(path)  # how nvidia-ctk --output rewrites a file: a new inode
    assert toolkit_spec_changed(loaded, path)
    assert "NEW_DRIVER=1" in (load_toolkit_edits(path).edits or {})["env"]


def test_a_spec_appearing_or_disappearing_is_noticed(tmp_path: Path) -> None:
    candidates = (tmp_path / "a.yaml", tmp_path / "b.yaml")
    missing = load_toolkit_edits(None, candidates)
    assert not toolkit_spec_changed(missing, None, candidates)
    _write_spec(candidates[1])
    assert toolkit_spec_changed(missing, None, candidates)
    found = load_toolkit_edits(None, candidates)
    candidates[1].unlink()
    assert toolkit_spec_changed(found, None, candidates)
