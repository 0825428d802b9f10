"""SIMULATION: find and stop every process a simulated node started, daemons included.

The MPS control daemon stand-in detaches into a session of its own (as NVIDIA's daemon does), so
neither the driver's process group nor a ``Popen`` handle reaches it. The demo gives the driver an
environment variable holding a token nobody else uses; every process the driver starts inherits it,
and /proc shows it in their environment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path


def processes_with_env(name: str, value: str) -> list[int]:
    """PIDs (other than this process) whose environment holds ``name=value``."""
    wanted = f"{name}={value}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            # Processes exit while we look, and other users' environments are unreadable: skip both.
            if wanted in (entry / "environ").read_bytes().split(b"\0"):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def stop_processes(pids: list[int], grace_s: float = 3.0) -> None:
    """SIGTERM each of ``pids``, then SIGKILL those still running after ``grace_s``."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _running(pid)]
        time.sleep(0.05)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
