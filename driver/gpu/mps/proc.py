"""Which process is an MPS control daemon, read from /proc only.

A PID the driver acts on comes from its own launcher or its checkpoint, and may have been recycled
since. Before it is adopted or signalled, /proc must show the same start time (field 22 of
``/proc/<pid>/stat``), a command line that runs the control binary as a daemon (``-f`` or ``-d``),
and ``CUDA_MPS_PIPE_DIRECTORY=<its pipe dir>`` in its environment. Nothing is read from the pipe
directory: clients can write there (an older layout mounted it read-write), and 535.x drivers write
no pid file at all (docs/sharing.md, "NVIDIA's daemon, as measured").
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

CONTROL_BINARY = "nvidia-cuda-mps-control"
# The control binary without these is the front-end client (`echo cmd | nvidia-cuda-mps-control`),
# which carries the same CUDA_MPS_PIPE_DIRECTORY: never mistake it for the daemon.
_DAEMON_FLAGS = (b"-f", b"-d")
_POLL_INTERVAL_S = 0.05


@dataclass(frozen=True)
class ProcStat:
    state: str
    pgrp: int
    start_time: int


def read_proc_stat(pid: int) -> ProcStat | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # Field 2 (comm) is parenthesised and may contain spaces or ')'; the fields after it are plain.
    rest = text.rpartition(")")[2].split()
    try:
        return ProcStat(state=rest[0], pgrp=int(rest[2]), start_time=int(rest[19]))
    except (IndexError, ValueError):
        return None


def is_same_process(pid: int, start_time: int) -> bool:
    """The PID is alive and started at ``start_time``: never a recycled PID."""
    stat = read_proc_stat(pid)
    return stat is not None and stat.start_time == start_time and stat.state not in ("Z", "X")


def runs_control_daemon(pid: int) -> bool:
    """Whether ``pid`` runs the control binary as a daemon (the simulation's runs under an interpreter)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    name = os.fsencode(CONTROL_BINARY)
    for i, arg in enumerate(argv):
        if os.path.basename(arg) == name:
            return any(flag in argv[i + 1:] for flag in _DAEMON_FLAGS)
    return False


def daemon_start_time(pid: int, pipe_dir: Path) -> int | None:
    """The start time of ``pid`` if it is a live control daemon serving ``pipe_dir``, else None."""
    stat = read_proc_stat(pid)
    if stat is None or stat.state in ("Z", "X"):
        return None
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or not ours to read: either way not our daemon
        return None
    if b"CUDA_MPS_PIPE_DIRECTORY=" + os.fsencode(pipe_dir) not in environ or not runs_control_daemon(pid):
        return None
    # The files above were read after the stat: a PID recycled in between would show a new start time.
    again = read_proc_stat(pid)
    if again is None or again.start_time != stat.start_time:
        return None
    return stat.start_time


def find_daemons(pipe_dir: Path) -> list[tuple[int, int]]:
    """``(pid, start time)`` of every live control daemon serving ``pipe_dir``, found by scanning /proc.

    For daemons without a record (their starter crashed before checkpointing them).
    """
    found: list[tuple[int, int]] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        pid = int(name)
        if not runs_control_daemon(pid):  # cheap filter before reading the environment
            continue
        start_time = daemon_start_time(pid, pipe_dir)
        if start_time is not None:
            found.append((pid, start_time))
    return sorted(found)


def wait_for_exit(pid: int, start_time: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        stat = read_proc_stat(pid)
        if stat is None or stat.start_time != start_time:
            return True
        if stat.state in ("Z", "X"):
            # A daemon this process launched, or one orphaned to it when it runs as PID 1.
            reap(pid)
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_INTERVAL_S)


def reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):  # not our child (or already reaped): its parent reaps it
        os.waitpid(pid, os.WNOHANG)


def signal_daemon(pid: int, start_time: int, signum: signal.Signals) -> None:
    stat = read_proc_stat(pid)
    if stat is None or stat.start_time != start_time:
        return
    try:
        # If the daemon leads its own process group, signalling the group also ends the MPS servers
        # it spawned, which would otherwise outlive it holding the GPU.
        if stat.pgrp == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
    except ProcessLookupError:
        pass
