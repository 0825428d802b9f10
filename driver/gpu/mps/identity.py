"""Which processes are the driver's MPS daemons: known by how they were started, never by how they look.

Any user can run a process whose command line names ``nvidia-cuda-mps-control -f`` and whose
environment names a daemon's pipe directory (a plan daemon's is predictable from the GPU UUID).
Such a process cannot serve that directory (it is root's, 0755, and read-only for clients), but a
driver that took it for the daemon would wait for it, signal it and refuse to start beside it:
twenty of them ignoring SIGTERM held another tenant's prepare past the kubelet's deadline.
So a process is one of the driver's daemons only if, besides looking like one
(``proc.py``: the control binary with ``-f``/``-d``, the pipe directory in its environment):

* it runs as the driver's UID, real and effective, and
* recorded: it is the PID the launcher returned, with the recorded start time; or
* unrecorded (found by scanning /proc, after a crash between launch and checkpoint or a lost
  checkpoint): its launcher says it started it (:meth:`DaemonLauncher.started_here`: its parent is
  the launcher's process, or it sits in that process's cgroup).

Everything else is foreign: never adopted, signalled or waited for, never in the way of a start.
It is logged once, and ``python -m driver inspect`` lists it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from driver.gpu.mps.launch import DaemonLauncher
from driver.gpu.mps.proc import DaemonLike, find_daemon_like, is_same_process

log = logging.getLogger(__name__)

# Foreign processes already logged are remembered by (pid, start time); a tenant can start many, so
# the memory is bounded.
_MAX_REMEMBERED = 4096


class DaemonIdentity:
    """Tells the driver's unrecorded daemons from look-alikes, for one launcher (the MPS manager holds
    one, so each look-alike is logged once per driver process)."""

    def __init__(self, launcher: DaemonLauncher) -> None:
        self._launcher = launcher
        self._reported: set[tuple[int, int]] = set()
        self._reported_lock = threading.Lock()

    def ours(self, found: DaemonLike) -> bool:
        if not found.runs_as_driver() or not self._launcher.started_here(found.pid):
            return False
        # Parent and cgroup were read after the scan: the PID must still be the process scanned.
        return is_same_process(found.pid, found.start_time)

    def unrecorded(self, pipe_dir: Path) -> list[tuple[int, int]]:
        """``(pid, start time)`` of each daemon serving ``pipe_dir`` that a launcher of the driver started
        and nobody recorded. Look-alikes are logged once and left alone."""
        daemons: list[tuple[int, int]] = []
        for found in find_daemon_like(pipe_dir):
            if self.ours(found):
                daemons.append((found.pid, found.start_time))
            else:
                self._report(found, pipe_dir)
        return daemons

    def _report(self, found: DaemonLike, pipe_dir: Path) -> None:
        key = (found.pid, found.start_time)
        with self._reported_lock:
            if key in self._reported:
                return
            if len(self._reported) >= _MAX_REMEMBERED:
                self._reported.clear()
            self._reported.add(key)
        log.warning("a process that looks like an MPS control daemon names a Tessera pipe directory but was not "
                    "started by this driver; it is ignored (never signalled, adopted or waited for)",
                    extra={"pid": found.pid, "uid": found.uid, "euid": found.euid, "pipe_dir": str(pipe_dir)})


@dataclass(frozen=True)
class ForeignProcess:
    pid: int
    uid: int
    euid: int
    daemon_id: str  # the daemon directory under the MPS base directory whose pipe dir it names
    pipe_dir: Path


def foreign_processes(base_dir: Path, recorded: Mapping[str, tuple[int, int]],
                      launcher: DaemonLauncher) -> list[ForeignProcess]:
    """Processes that look like a daemon serving ``<base_dir>/<id>/pipe`` but are neither the daemon
    recorded for ``<id>`` (``recorded``: id to pid and start time) nor one the launcher started."""
    identity = DaemonIdentity(launcher)
    foreign: list[ForeignProcess] = []
    for found in find_daemon_like():
        for pipe_dir in found.pipe_dirs:
            if pipe_dir.name != "pipe" or pipe_dir.parent.parent != base_dir:
                continue
            daemon_id = pipe_dir.parent.name
            if (found.runs_as_driver() and recorded.get(daemon_id) == (found.pid, found.start_time)) or \
                    identity.ours(found):
                continue
            foreign.append(ForeignProcess(pid=found.pid, uid=found.uid, euid=found.euid, daemon_id=daemon_id,
                                          pipe_dir=pipe_dir))
    return foreign
