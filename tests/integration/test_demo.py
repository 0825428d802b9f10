"""``python -m driver demo`` run as a user runs it: kept claims readable afterwards, and SIGTERM mid-run.

Kept lean: one full run and one run stopped early; the demo's choices are unit-tested in
tests/unit/commands/test_demo.py.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import processes_mentioning


def _demo(*args: str) -> list[str]:
    return [sys.executable, "-m", "driver", "demo", *args]


def test_kept_claims_can_be_inspected_with_the_commands_the_demo_prints(workdir: Path) -> None:
    done = subprocess.run(_demo("--workdir", str(workdir), "--keep-prepared"), capture_output=True, text=True,
                          timeout=120, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    # Nothing the demo started outlives it: not the driver, not the MPS daemon stand-ins.
    assert processes_mentioning(str(workdir), in_environment=True) == []
    inspect_line = next(line.strip() for line in done.stdout.splitlines()
                        if line.strip().startswith(f"{sys.executable} -m driver inspect"))
    # Runnable as printed, from another directory (one holding a cdi/ folder, like /var/run).
    elsewhere = workdir.parent / "elsewhere"
    (elsewhere / "cdi").mkdir(parents=True)
    inspected = subprocess.run([*shlex.split(inspect_line), "--json"], cwd=elsewhere, capture_output=True,
                               text=True, timeout=60, check=False)
    report = json.loads(inspected.stdout)
    claims = {c["claim"]: c for c in report["claims"]}
    assert sorted(claims) == ["default/demo-gpu-mps-per-claim", "default/demo-mig-by-profile",
                              "default/demo-mps-share-from-plan"]
    assert all(c["phase"] == "PrepareCompleted" and Path(c["cdi_spec"]).is_file() for c in claims.values())
    assert f"rm -rf {workdir}" in done.stdout
    # A rerun on the same directory starts clean: the kept claims would otherwise fail every prepare as stale.
    again = subprocess.run(_demo("--workdir", str(workdir)), capture_output=True, text=True, timeout=120, check=False)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"Removed the previous demo run's files from {workdir}" in again.stdout
    assert "FAILED" not in again.stdout


def test_failed_prepares_make_the_demo_exit_non_zero(workdir: Path) -> None:
    env = dict(os.environ, TESSERA_SIM_MPS_FAIL="start")  # every MPS daemon stand-in fails to start
    done = subprocess.run(_demo("--workdir", str(workdir)), capture_output=True, text=True, timeout=120, env=env,
                          check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "NodePrepareResources FAILED" in done.stdout
    assert "claim(s) FAILED: demo-gpu-mps-per-claim" in done.stdout


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_sigterm_mid_run_stops_the_driver_and_every_stand_in(workdir: Path, signum: int) -> None:
    proc = subprocess.Popen(_demo("--workdir", str(workdir)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    assert proc.stdout is not None
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "MPS control daemon" in line:  # a daemon stand-in, detached from the driver, is running now
                break
        assert processes_mentioning(str(workdir), in_environment=True), "the demo's processes should be running"
        proc.send_signal(signum)
        rest, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    output = "".join(seen) + rest
    assert proc.returncode == 128 + signum, output
    assert "Traceback" not in output
    assert f"demo stopped by {signal.Signals(signum).name}" in output
    assert processes_mentioning(str(workdir), in_environment=True) == []


def test_a_second_demo_on_the_same_workdir_is_refused_and_the_first_finishes(workdir: Path) -> None:
    first = subprocess.Popen(_demo("--workdir", str(workdir)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             text=True)
    assert first.stdout is not None
    seen = []
    try:
        for line in first.stdout:
            seen.append(line)
            if "MPS control daemon" in line:  # mid-run: its files are in use
                break
        second = subprocess.run(_demo("--workdir", str(workdir)), capture_output=True, text=True, timeout=60,
                                check=False)
        rest, _ = first.communicate(timeout=120)
    finally:
        first.kill()
    assert second.returncode == 2, second.stdout + second.stderr
    assert second.stdout == ""
    assert second.stderr.strip() == (f"python -m driver demo: --workdir {workdir}: another demo (pid {first.pid}) is "
                                     "running in it; wait for it to end, or give another --workdir")
    output = "".join(seen) + rest
    assert first.returncode == 0, output
    assert "FAILED" not in output and "No such file" not in output


def test_an_example_the_node_cannot_serve_names_its_claim_and_node_and_fails(workdir: Path) -> None:
    done = subprocess.run(_demo("--workdir", str(workdir), "--example", "consumable-share-kernel-memory.yaml"),
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert ("NOT ALLOCATED: claim default/demo-consumable-share-kernel-memory (from "
            "consumable-share-kernel-memory.yaml): request 'share': no free consumable device matches; this example "
            "needs the simulated node --layout kernel-memory") in done.stdout
    assert "1 claim(s) FAILED: demo-consumable-share-kernel-memory" in done.stdout
    # And on that node it is served.
    served = subprocess.run(_demo("--workdir", str(workdir), "--layout", "kernel-memory", "--example",
                                  "consumable-share-kernel-memory.yaml"),
                            capture_output=True, text=True, timeout=120, check=False)
    assert served.returncode == 0, served.stdout + served.stderr
    assert "NOT ALLOCATED" not in served.stdout
