"""``python -m driver demo --health``: the GPU's taints appear and go, the stream and metrics follow (one lean run)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from tests.support.processes import kill_processes_mentioning


def test_demo_health_shows_a_gpu_failing_and_recovering() -> None:
    # /tmp, not tmp_path: the driver's Unix socket paths under it must stay short.
    top = Path(tempfile.mkdtemp(prefix="tdemoh-", dir="/tmp"))
    try:
        done = subprocess.run([sys.executable, "-m", "driver", "demo", "--health", "--workdir", str(top / "w"),
                               "--example", "mps-share-from-plan.yaml"],
                              capture_output=True, text=True, timeout=120, check=False)
        out = done.stdout
        assert done.returncode == 0, out + done.stderr
        failed, recovered = out.split("ResourceSlice taints (after the XID):")[1].split("The GPU is reset")
        assert "gpu-2-mps-0              gpu.tessera.dev/unhealthy=xid-79:NoSchedule" in failed
        assert "gpu-2-mps-0              Unhealthy xid-79: XID 79" in failed
        assert 'tessera_device_healthy{device="gpu-2-mps-0",reason="xid-79"} 0' in failed
        assert "gpu-2-mps-0              none" in recovered
        assert "gpu-2-mps-0              Healthy" in recovered
        assert 'tessera_device_healthy{device="gpu-2-mps-0"} 1' in recovered
    finally:
        kill_processes_mentioning(str(top), in_environment=True)
        subprocess.run(["rm", "-rf", str(top)], check=False)
