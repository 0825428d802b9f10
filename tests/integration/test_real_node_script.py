"""scripts/real-node-e2e.py, the end-to-end check for a GPU machine without a cluster, on a simulated node.

On real GPUs it runs from scripts/gpu-machine-check.sh; here its --simulate form keeps it from rotting:
the same registration, publishing, prepare, health, inspect and unprepare steps must pass.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short work directory: the plugin's socket paths under it must stay within gRPC's 105 bytes."""
    path = Path(tempfile.mkdtemp(prefix="rn-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_real_node_script_passes_on_a_simulated_node(short_tmp: Path) -> None:
    tmp_path = short_tmp
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "real-node-e2e.py"), "--simulate", "demo",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    out = done.stdout
    assert "SIMULATED layout demo" in out
    lines = out.splitlines()
    # the demo layout's two whole GPUs (the third is in MIG mode)
    assert len([line for line in lines if line.startswith("prepare whole-") and " ok in " in line]) == 2
    assert "health stream: first report received" in out
    assert "2 prepared claim(s)" in out  # inspect, while both are prepared
    assert len([line for line in lines if line.startswith("unprepare whole-") and ": ok in" in line]) == 2
    assert not list((tmp_path / "cdi").glob("k8s.gpu.tessera.dev-claim_*"))
    assert out.rstrip().endswith("RESULT: ok")


def test_real_node_script_reports_a_driver_that_cannot_start(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "real-node-e2e.py"), "--simulate", "no-such-layout",
                           "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode != 0
    assert "RESULT: ok" not in done.stdout
