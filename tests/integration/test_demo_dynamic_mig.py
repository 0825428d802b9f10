"""``python -m driver demo --dynamic-mig`` run as a user runs it: a 3g.40gb and two 2g.20gb created on one H100,
a 7g.80gb refused by the allocator stand-in until they are unprepared, then prepared, and nothing left."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support.processes import processes_mentioning


def test_the_dynamic_mig_demo_creates_the_mix_and_the_full_gpu_after_it(workdir: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "driver", "demo", "--dynamic-mig", "--workdir", str(workdir)],
                          capture_output=True, text=True, timeout=120, check=False)
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "Traceback" not in out + done.stderr and "FAILED" not in out
    allocated = [line.split(" allocated: ")[1] for line in out.splitlines() if " allocated: mig -> " in line]
    assert allocated == ["mig -> gpu-0-dynmig-2g20gb-0", "mig -> gpu-0-dynmig-2g20gb-2", "mig -> gpu-0-dynmig-3g40gb-4",
                         "mig -> gpu-0-dynmig-7g80gb-0"]
    created = [line.strip() for line in out.splitlines() if line.strip().startswith("MIG instance for claim")]
    assert [line.split(": ", 1)[1].split(" (")[0] for line in created] == [
        "2g.20gb at placement 0", "2g.20gb at placement 2", "3g.40gb at placement 4",  # all three at once
        "7g.80gb at placement 0"]  # after they were unprepared
    refused = out.index("A 7g.80gb claim is refused by the allocator stand-in")
    assert refused < out.index("=== 5. The kubelet unprepares them") < out.index("so the 7g.80gb fits now")
    assert "MIG instance created by Tessera: 3g.40gb at placement 4" in out, "inspect shows the created instance"
    assert out.rstrip().count("MIG instances Tessera created: none") == 2  # after the mix, and after the 7g.80gb
    state = (workdir / "host" / "var" / "lib" / "tessera-sim-mig.json").read_text()
    assert '"gis": []' in state, "the simulated NVML holds no instance at the end"
    assert processes_mentioning(str(workdir), in_environment=True) == []
