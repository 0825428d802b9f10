"""Which process is an MPS control daemon, read from /proc only.

A PID the driver acts on comes from its own launcher or its checkpoint, and may have been recycled
since. Before it is adopted or signalled, /proc must show the same start time (field 22 of
``/proc/<pid>/stat``), the driver's own UID (real and effective, ``/proc/<pid>/status``), a command
line that runs the control binary as a daemon (``-f`` or ``-d``), and
``CUDA_MPS_PIPE_DIRECTORY=<its pipe dir>`` in its environment. Nothing is read from the pipe
directory: clients can write there (an older layout mounted it read-write), and 535.x drivers write
no pid file at all (docs/sharing.md, "NVIDIA's daemon, as measured"). How a process *looks* never
makes it a daemon of the driver's: ``identity.py`` adds who started it.
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
    ppid: int
    pgrp: int
    start_time: int


def read_proc_stat(pid: int, proc_root: Path = Path("/proc")) -> ProcStat | None:
    """``/proc/<pid>/stat`` (``proc_root``: another view of /proc, such as the host's from a container)."""
    try:
        text = (proc_root / str(pid) / "stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    # Field 2 (comm) is parenthesised and may contain spaces or ')'; the fields after it are plain.
    rest = text.rpartition(")")[2].split()
    try:
        return ProcStat(state=rest[0], ppid=int(rest[1]), pgrp=int(rest[2]), start_time=int(rest[19]))
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


@dataclass(frozen=True)
class DaemonLike:
    """A live process running the control binary as a daemon: what it looks like, not who started it."""

    pid: int
    start_time: int
    uid: int  # real
    euid: int
    pipe_dirs: tuple[Path, ...]  # every CUDA_MPS_PIPE_DIRECTORY in its environment
    visible_devices: tuple[str, ...] | None = None  # its CUDA_VISIBLE_DEVICES, if set: the devices it serves

    def runs_as_driver(self) -> bool:
        """Real and effective UID are this process's effective UID: no other user's process is a daemon
        of the driver's, whatever it looks like."""
        return self.uid == self.euid == os.geteuid()


def read_uids(pid: int) -> tuple[int, int] | None:
    """``(real, effective)`` UID of ``pid`` from ``/proc/<pid>/status``."""
    try:
        text = Path(f"/proc/{pid}/status").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Uid:"):
            fields = line.split()
            try:
                return int(fields[1]), int(fields[2])
            except (IndexError, ValueError):
                return None
    return None


def read_cgroup(pid: int) -> bytes | None:
    try:
        return Path(f"/proc/{pid}/cgroup").read_bytes()
    except OSError:
        return None


def daemon_like(pid: int) -> DaemonLike | None:
    """What /proc shows of ``pid`` if it runs the control binary as a daemon, else None."""
    stat = read_proc_stat(pid)
    if stat is None or stat.state in ("Z", "X") or not runs_control_daemon(pid):
        return None
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:  # gone, or not ours to read: either way not our daemon
        return None
    prefix = b"CUDA_MPS_PIPE_DIRECTORY="
    pipe_dirs = tuple(Path(os.fsdecode(e[len(prefix):])) for e in environ if e.startswith(prefix))
    devices = b"CUDA_VISIBLE_DEVICES="
    visible = next((tuple(os.fsdecode(e[len(devices):]).split(",")) for e in environ if e.startswith(devices)), None)
    uids = read_uids(pid)
    # The files above were read after the stat: a PID recycled in between would show a new start time.
    again = read_proc_stat(pid)
    if not pipe_dirs or uids is None or again is None or again.start_time != stat.start_time:
        return None
    return DaemonLike(pid=pid, start_time=stat.start_time, uid=uids[0], euid=uids[1], pipe_dirs=pipe_dirs,
                      visible_devices=visible)


def recorded_daemon(pid: int, pipe_dir: Path) -> DaemonLike | None:
    """``pid`` if it is a live control daemon serving ``pipe_dir`` as the driver's UID, else None. For a PID
    the driver's launcher returned (a recorded daemon)."""
    found = daemon_like(pid)
    if found is None or pipe_dir not in found.pipe_dirs or not found.runs_as_driver():
        return None
    return found


def daemon_start_time(pid: int, pipe_dir: Path) -> int | None:
    """The start time of :func:`recorded_daemon` ``pid``, else None."""
    found = recorded_daemon(pid, pipe_dir)
    return found.start_time if found is not None else None


def find_daemon_like(pipe_dir: Path | None = None) -> list[DaemonLike]:
    """Every live process that looks like a control daemon (serving ``pipe_dir``, if given), by scanning
    /proc. Who started each one is for ``identity.py`` to say."""
    found: list[DaemonLike] = []
    try:
        names = os.listdir("/proc")
    except OSError:
        return found
    for name in names:
        if not name.isdigit():
            continue
        if not runs_control_daemon(int(name)):  # cheap filter before reading the rest
            continue
        candidate = daemon_like(int(name))
        if candidate is not None and (pipe_dir is None or pipe_dir in candidate.pipe_dirs):
            found.append(candidate)
    return sorted(found, key=lambda d: d.pid)


def tied_to(pid: int, launcher_pid: int) -> bool:
    """Whether ``launcher_pid`` started ``pid``: it is its parent, or ``pid`` sits in its cgroup (a daemon
    orphaned when the launching process died stays in that process's container cgroup)."""
    stat = read_proc_stat(pid)
    if stat is None or launcher_pid <= 0:
        return False
    if stat.ppid == launcher_pid:
        return True
    ours = read_cgroup(launcher_pid)
    return ours is not None and ours == read_cgroup(pid)


# A stop with no time left still sends SIGKILL and waits this long for it: cleanup is bounded, never skipped.
KILL_FLOOR_S = 1.0


@dataclass(frozen=True)
class StopSteps:
    """How long each step of stopping a daemon may take: ``quit`` and the wait for it, SIGTERM's grace,
    SIGKILL's wait."""

    quit_s: float
    term_s: float
    kill_s: float

    @property
    def total(self) -> float:
        return self.quit_s + self.term_s + self.kill_s

    def within(self, budget: float) -> StopSteps:
        """Each step shrunk in proportion so the whole fits ``budget`` (what is left of a caller's deadline)."""
        if budget >= self.total:
            return self
        scale = max(budget, 0.0) / self.total
        return StopSteps(self.quit_s * scale, self.term_s * scale, max(self.kill_s * scale, KILL_FLOOR_S))


def end_processes(targets: list[tuple[int, int]], quit_until: float | None, steps: StopSteps) -> list[int]:
    """Wait until ``quit_until`` (monotonic; None: quit was not delivered) for ``targets`` (pid, start
    time) to exit, then SIGTERM and SIGKILL what is left, each followed by its wait in ``steps``.
    Returns the PIDs still running at the end; only a PID with its start time is ever signalled."""
    left = targets
    if quit_until is not None:
        left = _still_running(left, quit_until)
    for signum, wait in ((signal.SIGTERM, steps.term_s), (signal.SIGKILL, steps.kill_s)):
        if not left:
            break
        for pid, start_time in left:
            signal_daemon(pid, start_time, signum)
        left = _still_running(left, time.monotonic() + wait)
    return [pid for pid, _ in left]


def _still_running(targets: list[tuple[int, int]], until: float) -> list[tuple[int, int]]:
    return [(pid, st) for pid, st in targets if not wait_for_exit(pid, st, max(until - time.monotonic(), 0.0))]


def wait_for_exit(pid: int, start_time: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    pause = _POLL_INTERVAL_S / 16  # a daemon told to quit is usually gone within milliseconds
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
        time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(pause * 2, _POLL_INTERVAL_S)


def reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError):  # not our child (or already reaped): its parent reaps it
        os.waitpid(pid, os.WNOHANG)


def signal_daemon(pid: int, start_time: int, signum: signal.Signals) -> None:
    stat = read_proc_stat(pid)
    if stat is None or stat.start_time != start_time:
        return
    with contextlib.suppress(ProcessLookupError):
        # If the daemon leads its own process group, signalling the group also ends the MPS servers
        # it spawned, which would otherwise outlive it holding the GPU.
        if stat.pgrp == pid:
            os.killpg(pid, signum)
        else:
            os.kill(pid, signum)
