from __future__ import annotations

import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.node import SimulatedNode
from tests.support.processes import kill_processes_mentioning


@pytest.fixture
def sim_node() -> Iterator[SimulatedNode]:
    """The demo layout (gpu-0 H100 whole, gpu-1 H100 with three MIG devices, gpu-2 L4), no sharing plan."""
    n = SimulatedNode("demo")
    try:
        yield n
    finally:
        n.close()


@pytest.fixture
def workdir() -> Iterator[Path]:
    """A demo --workdir, with everything the demo started there stopped and removed afterwards."""
    # /tmp, not tmp_path: the driver's Unix socket paths under it must stay short.
    top = Path(tempfile.mkdtemp(prefix="tdemo-", dir="/tmp"))
    try:
        yield top / "work"
    finally:
        kill_processes_mentioning(str(top), in_environment=True)
        subprocess.run(["rm", "-rf", str(top)], check=False)
