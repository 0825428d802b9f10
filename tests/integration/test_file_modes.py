"""The driver runs with umask 0o077: its own files are private, what others must read keeps its mode."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from tests.support.node import SimulatedNode, gpu_config


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


def process_umask(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    raise AssertionError(f"no Umask line for pid {pid}")


def test_state_is_private_and_cdi_specs_and_the_mps_pipe_dir_are_not(sim_node: SimulatedNode) -> None:
    sim_node.start()
    ref = sim_node.claim("mps", [("gpu", "gpu-0")], configs=[gpu_config(strategy="MPS")])
    sim_node.prepare_ok(ref)

    driver_pid = sim_node.proc.pid if sim_node.proc else 0
    assert process_umask(driver_pid) == 0o077
    assert mode(sim_node.state_dir) == 0o700
    candidates = [*sim_node.state_dir.iterdir(), *(sim_node.work / "reg").iterdir()]
    sockets = [p for p in candidates if stat.S_ISSOCK(p.lstat().st_mode)]
    assert len(sockets) == 2, sockets
    assert {p.name: mode(p) for p in sockets} == {p.name: 0o600 for p in sockets}
    assert [(p.name, mode(p)) for p in sim_node.state_dir.glob("*.lock")] == [("state.lock", 0o600)]
    assert mode(sim_node.state_dir / "checkpoint.json") == 0o600

    # Container runtimes may read specs as another user; clients of other UIDs traverse the pipe dir.
    assert mode(sim_node.cdi_spec(ref.uid)) == 0o644
    edits = json.loads(sim_node.cdi_spec(ref.uid).read_text())["devices"][0]["containerEdits"]
    pipe_dir = Path(next(m["hostPath"] for m in edits["mounts"] if m["containerPath"] == "/tmp/nvidia-mps"))
    assert mode(pipe_dir) == 0o755
    # The daemon creates the sockets clients connect to; the driver's private umask must not reach it.
    [daemon_pid] = [e["pid"] for e in sim_node.journal() if e.get("event") == "start"]
    assert process_umask(daemon_pid) & 0o077 != 0o077, "the MPS daemon inherited the driver's umask 0o077"
    assert process_umask(daemon_pid) == 0o022
