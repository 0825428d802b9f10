"""``check-node``: result classification and rendering, and the command end to end on a simulated node."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from driver.commands.checknode.checks import classify_compute_mode
from driver.commands.checknode.mps import (
    CHECK_MEMORY,
    CHECK_SMS,
    PINNED_LIMIT_MIB,
    choose_target,
    classify_client,
)
from driver.commands.checknode.result import NodeReport, exit_status, fail, ok, render_json, render_table, skipped
from driver.gpu.discovery.cudaprobe import ClientReport
from driver.gpu.discovery.inventory import ComputeMode, NodeInventory
from driver.units import MIB
from tests.support.processes import processes_mentioning

REPO = Path(__file__).resolve().parents[3]
TARGET = "GPU-a338e955-d4a5-5fe1-a1d9-69aa948b59b7"


# --- rendering and exit status ----------------------------------------------------------------------


def test_any_failure_makes_the_exit_status_one_and_skips_do_not() -> None:
    assert exit_status(NodeReport(checks=[ok("a", "x"), skipped("b", "no GPU")])) == 0
    assert exit_status(NodeReport(checks=[ok("a", "x"), fail("b", "broken"), skipped("c", "no GPU")])) == 1


def test_table_aligns_wraps_and_summarises() -> None:
    long = "word " * 40
    report = NodeReport(simulated=True, notes=["SIMULATION: layout 'demo'"],
                        checks=[ok("NVML", "3 GPU(s)"), fail("toolkit CDI spec", long.strip()),
                                skipped("MPS SM limit", "no real GPU")])
    lines = render_table(report).splitlines()
    assert lines[0] == "SIMULATION: layout 'demo'"
    assert lines[2].split() == ["CHECK", "STATUS", "DETAIL"]
    column = lines[2].index("DETAIL")
    assert lines[3].index("3 GPU(s)") == column
    failing = lines.index(next(line for line in lines if line.startswith("toolkit CDI spec")))
    assert lines[failing + 1].startswith(" " * column + "word"), "a long detail wraps under its column"
    assert "1 OK, 1 FAILED, 1 SKIPPED: this node is NOT ready" in render_table(report)
    assert lines[-2].startswith("Not run here (SIMULATION") and lines[-1] == "  - MPS SM limit: no real GPU"


def test_json_carries_every_check_and_the_exit_status() -> None:
    data = json.loads(render_json(NodeReport(checks=[ok("a", "x"), fail("b", "y")])))
    assert [(c["check"], c["status"]) for c in data["checks"]] == [("a", "OK"), ("b", "FAIL")]
    assert data["exit_status"] == 1 and data["counts"] == {"OK": 1, "FAIL": 1, "SKIPPED": 0}


# --- classification -----------------------------------------------------------------------------


def _client(**fields: object) -> ClientReport:
    base: dict[str, object] = {"device_uuid": TARGET.removeprefix("GPU-"), "multiprocessors": 132,
                               "affinity_sm_count": 34, "allocated_bytes": 1920 * MIB,
                               "allocation_error": "CUDA_ERROR_OUT_OF_MEMORY"}
    return ClientReport.model_validate({**base, **fields})


def _statuses(report: ClientReport, full_sms: int | None = 132) -> dict[str, str]:
    return {r.check: r.status for r in classify_client(report, TARGET, full_sms)}


def test_limits_enforced_are_ok() -> None:
    assert _statuses(_client()) == {CHECK_MEMORY: "OK", CHECK_SMS: "OK"}


@pytest.mark.parametrize("fields", [
    {"allocated_bytes": 2 * PINNED_LIMIT_MIB * MIB, "allocation_error": None},  # hit the cap: no limit at all
    {"allocated_bytes": PINNED_LIMIT_MIB * MIB + 128 * MIB},  # stopped, but above the limit
    {"allocation_error": "CUDA_ERROR_INVALID_VALUE"},  # stopped for another reason
    {"allocated_bytes": 0},  # nothing at all could be allocated
])
def test_memory_limit_not_shown_is_a_failure(fields: dict[str, object]) -> None:
    assert _statuses(_client(**fields))[CHECK_MEMORY] == "FAIL"


def test_sm_limit_not_enforced_is_a_failure() -> None:
    assert _statuses(_client(affinity_sm_count=132))[CHECK_SMS] == "FAIL"
    assert _statuses(_client(affinity_sm_count=34, multiprocessors=34), full_sms=None)[CHECK_SMS] == "FAIL"


def test_a_client_that_ran_without_mps_fails_both_and_says_why() -> None:
    results = classify_client(_client(device_uuid="bbbbbbbb-0000-0000-0000-000000000000"), TARGET, 132)
    assert [r.status for r in results] == ["FAIL", "FAIL"]
    assert "did not run under the daemon" in results[0].detail and "DEFAULT" in results[0].detail


def test_a_client_error_fails_both() -> None:
    report = _client(error="cuDevicePrimaryCtxRetain returned CUDA_ERROR_MPS_CONNECTION_FAILED (805)")
    assert {r.status for r in classify_client(report, TARGET, 132)} == {"FAIL"}


def test_mps_target_prefers_a_whole_gpu_in_default_mode(demo: NodeInventory) -> None:
    gpu0, gpu1, gpu2 = demo.gpus
    assert choose_target(demo, {gpu0.uuid: "DEFAULT", gpu2.uuid: "DEFAULT"}, None) == gpu0.uuid
    assert choose_target(demo, {gpu0.uuid: "EXCLUSIVE_PROCESS", gpu2.uuid: "DEFAULT"}, None) == gpu2.uuid
    assert choose_target(demo, {}, None) == gpu1.mig_instances[0].uuid
    assert choose_target(demo, {}, gpu2.uuid) == gpu2.uuid


def test_prohibited_compute_mode_fails_and_says_how_to_undo() -> None:
    assert classify_compute_mode(TARGET, ComputeMode.DEFAULT)[0]
    assert classify_compute_mode(TARGET, ComputeMode.EXCLUSIVE_PROCESS)[0]
    good, meaning = classify_compute_mode(TARGET, ComputeMode.PROHIBITED)
    assert not good and f"nvidia-smi -i {TARGET} -c DEFAULT" in meaning


# --- the command on a simulated node ---------------------------------------------------------------------


def _check_node(layout: str, *args: str, tmp: Path | None = None) -> subprocess.CompletedProcess[str]:
    """``tmp``: the TMPDIR its scratch directories go under (a path no other test's processes mention)."""
    env = {**os.environ, "TMPDIR": str(tmp)} if tmp is not None else None
    return subprocess.run([sys.executable, "-m", "driver", "check-node", "--simulate", layout, *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO, check=False, env=env)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A TMPDIR short enough for MPS sockets below it (pytest's tmp_path is not), unique to the test."""
    path = Path(tempfile.mkdtemp(prefix="tck-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_simulated_node_runs_what_it_can_and_says_what_needs_a_gpu(short_tmp: Path) -> None:
    done = _check_node("demo", "--json", tmp=short_tmp)
    report = json.loads(done.stdout)
    status = {c["check"]: c["status"] for c in report["checks"]}
    assert report["simulated"] is True
    skipped_checks = sorted(c for c, s in status.items() if s == "SKIPPED")
    assert skipped_checks == ["MPS SM limit", "MPS pinned memory limit", "libcuda"]
    assert all("SIMULATION" in c["detail"] for c in report["checks"] if c["status"] == "SKIPPED")
    for check in ("NVML (SIMULATED)", "device nodes", "toolkit CDI spec", "libcuda in toolkit spec", "nvidia-smi",
                  "MPS control daemon", "MPS daemon stopped"):
        assert status[check] == "OK", report
    daemon = next(c["detail"] for c in report["checks"] if c["check"] == "MPS control daemon")
    assert "pinned limit 2048M reads back" in daemon and "25% reads back 25" in daemon
    assert [c for c in report["checks"] if c["status"] == "FAIL"] == []
    assert done.returncode == 0 == report["exit_status"]
    assert status["compute mode GPU 0"] == status["compute mode GPU 2"] == "OK", "read, never set"
    assert processes_mentioning(str(short_tmp), in_environment=True) == [], "the throwaway daemon is gone"
    smi = next(c["detail"] for c in report["checks"] if c["check"] == "nvidia-smi")
    assert "`nvidia-smi -L` ran and listed 3 line(s)" in smi, "one line per simulated GPU"


def test_one_simulated_layout_has_the_same_gpu_uuids_in_check_node_inspect_check_plan_and_the_demo(
        tmp_path: Path) -> None:
    from driver.commands.demo.scenario import NODE
    from driver.simulation.discovery import SimulatedDiscovery

    expected = [g.uuid for g in SimulatedDiscovery("demo", NODE).discover().gpus]
    checked = json.loads(_check_node("demo", "--json").stdout)
    gpu_lines = [c["detail"].split()[0] for c in checked["checks"] if c["check"].startswith("GPU ")]
    inspected = subprocess.run([sys.executable, "-m", "driver", "inspect", "--json", "--simulate", "demo",
                                "--plugins-dir", str(tmp_path / "plugins"), "--cdi-root", str(tmp_path / "cdi")],
                               capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert inspected.stderr == "", "inspect --json writes its report, and nothing else"
    assert [g["uuid"] for g in json.loads(inspected.stdout)["gpus"]] == gpu_lines == expected
    plans = tmp_path / "plans.yaml"
    plans.write_text("plans: {}\n")
    planned = subprocess.run([sys.executable, "-m", "driver", "check-plan", str(plans), "--simulate", "demo"],
                             capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert all(uuid in planned.stdout for uuid in expected), planned.stdout


def test_a_failing_check_makes_the_table_say_not_ready_and_exit_one(tmp_path: Path) -> None:
    done = _check_node("gpu-operator", "--nvidia-cdi-spec", str(tmp_path / "missing.yaml"))
    assert done.returncode == 1
    assert "/run/nvidia/driver/dev (the driver root's /dev)" in done.stdout
    line = next(line for line in done.stdout.splitlines() if line.startswith("toolkit CDI spec"))
    assert line.split()[3] == "FAIL" and "missing.yaml" in done.stdout
    assert "this node is NOT ready" in done.stdout
    assert "Not run here (SIMULATION: there is no real GPU on a simulated node):" in done.stdout
    assert "  - MPS pinned memory limit: SIMULATION: no real GPU" in done.stdout


def test_another_gpu_allocators_socket_fails_the_node_unless_the_owned_gpus_are_listed() -> None:
    # Short path: a Unix socket path must stay under 108 bytes.
    directory = Path(tempfile.mkdtemp(prefix="tdp-", dir="/tmp"))
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(str(directory / "nvidia-mig-1g.10gb.sock"))
        done = _check_node("demo", "--json", "--device-plugins-dir", str(directory))
        report = json.loads(done.stdout)
        [line] = [c for c in report["checks"] if c["check"] == "other GPU allocators"]
        assert line["status"] == "FAIL" and done.returncode == 1
        assert line["detail"].startswith("another GPU allocator is on this node: NVIDIA device plugin "
                                         f"(nvidia.com/mig-1g.10gb) at {directory}/nvidia-mig-1g.10gb.sock")
        owned = json.loads(_check_node("demo", "--json", "--device-plugins-dir", str(directory),
                                       "--owned-gpus", "2").stdout)
        [line] = [c for c in owned["checks"] if c["check"] == "other GPU allocators"]
        assert line["status"] == "OK" and "publishing GPU minor(s) 2" in line["detail"]
    finally:
        server.close()
        shutil.rmtree(directory, ignore_errors=True)


def test_mig_capability_nodes_missing_on_the_host_are_no_failure_the_proc_files_are(tmp_path: Path) -> None:
    # The kernel module does not create /dev/nvidia-caps/nvidia-cap<N> (nvidia-modprobe does, on demand); the CDI
    # spec carries type, major and minor read from /proc, so the runtime makes them in the container.
    import shutil

    from driver.simulation.discovery import SimulatedDiscovery
    from driver.simulation.hostroot import build_host_root

    host = build_host_root(tmp_path / "host", SimulatedDiscovery("demo", "check").discover())
    shutil.rmtree(host.root / "dev" / "nvidia-caps")
    done = _check_node("demo", "--json", *host.driver_args())
    nodes = next(c for c in json.loads(done.stdout)["checks"] if c["check"] == "device nodes")
    assert nodes["status"] == "OK", nodes
    assert "6 MIG capability node(s) read from /proc (0 of them also on the host" in nodes["detail"]
    # Without the /proc access file the CDI path cannot write the node either: that fails, naming the file.
    [access] = list((host.root / "proc/driver/nvidia/capabilities/gpu1/mig").glob("gi*/access"))[:1]
    access.unlink()
    nodes = next(c for c in json.loads(_check_node("demo", "--json", *host.driver_args()).stdout)["checks"]
                 if c["check"] == "device nodes")
    assert nodes["status"] == "FAIL" and str(access) in nodes["detail"], nodes


def test_a_pending_mig_mode_says_what_applies_it_in_both_directions(tmp_path: Path) -> None:
    # nvmlDeviceGetMigMode answers (current, pending): after nvidia-smi -mig 1 an A100 needs a GPU reset, a Hopper
    # GPU no process holding it; telling the operator to run nvidia-smi -mig 1 again would be wrong.
    import yaml

    layout = tmp_path / "pending.yaml"
    layout.write_text(yaml.safe_dump({"gpus": [{"model": "A100-40GB", "migModePending": True},
                                               {"model": "H100-80GB", "migModePending": True},
                                               {"model": "A100-80GB", "mig": [], "migModePending": True}]}))
    checks = {c["check"]: c["detail"] for c in json.loads(_check_node(str(layout), "--json").stdout)["checks"]}
    a100, h100, disabling = checks["dynamic MIG GPU 0"], checks["dynamic MIG GPU 1"], checks["GPU 2"]
    assert "MIG mode enable is pending on Ampere: it needs a GPU reset (nvidia-smi -i GPU-" in a100
    assert "running nvidia-smi -mig 1 again does not apply it" in a100 and "-mig 1'" not in a100
    assert "MIG mode enable is pending on Hopper: it needs no process holding the GPU" in h100
    assert "MIG mode disable is pending on Ampere: it needs a GPU reset" in disabling
    assert "MIG mode disable is pending" in checks["dynamic MIG GPU 2"]
    assert "MIG mode enable is pending on Ampere" in checks["GPU 0"]


def test_check_node_says_what_the_health_source_cannot_watch_on_each_gpu() -> None:
    # nvml.h: remapped rows are NOT_SUPPORTED on a GPU in MIG mode with instances (the demo's gpu 1).
    checks = {c["check"]: c for c in json.loads(_check_node("demo", "--json").stdout)["checks"]}
    assert checks["health watch GPU 0"]["detail"] == ("XIDs, ECC errors, a lost GPU, the recovery action and row "
                                                      "remapping are watched")
    migged = checks["health watch GPU 1"]
    assert migged["status"] == "OK" and migged["detail"].startswith(
        "memory row remapping is not watched: NVML does not report remapped rows on a GPU in MIG mode with instances")
