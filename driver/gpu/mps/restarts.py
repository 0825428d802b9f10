"""When a gone MPS daemon is started again: at once if it had started cleanly, later only if it failed to start.

A tenant who is root in its container can `quit` the daemon it shares with other tenants (a
read-only mount of the pipe dir still allows ``connect()``). Such a daemon is restarted at once,
so the quit costs the others a reconnect, never a deferred prepare. The backoff (``dirs.py``:
``restart_delay``, counted in ``restarts.json``) is only for a daemon that fails to start, so a
broken binary or GPU cannot make the driver spin; even then a prepare waits at most
``MAX_BACKOFF_WAIT_S`` for it, and fails with the reason rather than waiting longer.
"""

from __future__ import annotations

import logging
import os
import re
import time
from pathlib import Path

from driver.gpu.mps.dirs import RestartState, next_restart_state, read_restart_state, restart_delay, write_restart_state
from driver.gpu.mps.launch import CONTROL_LOG_NAME
from driver.gpu.mps.model import MpsError
from driver.gpu.mps.proc import read_proc_stat, wait_for_exit
from driver.kubeletplugin.types import Deadline

log = logging.getLogger(__name__)

# The longest a caller (a prepare) waits out the backoff of a daemon that failed to start.
MAX_BACKOFF_WAIT_S = 2.0
# How long a daemon that stopped answering gets to show it exited (a `quit` ends it within milliseconds).
STOPPED_EXIT_WAIT_S = 0.5
# How long a prepare keeps starting a daemon that a client stops while it starts. Past that the prepare
# goes on without it (the watcher restarts it): a tenant's quits must not fail or stall other claims.
STOPPED_RETRY_S = 0.5
_LOG_END_BYTES = 64 * 1024


class RestartBackoff:
    """The backoff of failed starts: ``base`` seconds after the first, doubling up to ``cap``."""

    def __init__(self, base: float, cap: float) -> None:
        self.base = base
        self.cap = cap

    def wait_turn(self, daemon_id: str, daemon_dir: Path, deadline: Deadline) -> RestartState:
        """Wait out the backoff if it ends within ``MAX_BACKOFF_WAIT_S`` and the deadline, else MpsError
        saying when the next start is due. Returns the state to pass to :meth:`done`."""
        state = read_restart_state(daemon_dir)
        delay = restart_delay(state, self.base, self.cap, time.time())
        if deadline.expired() or delay > min(MAX_BACKOFF_WAIT_S, deadline.remaining()):
            raise MpsError(f"MPS control daemon {daemon_id} is not running; it failed to start {state.count} time(s) "
                           f"in a row, so the next start is deferred for {delay:.0f}s")
        time.sleep(delay)
        return state

    def done(self, daemon_dir: Path, state: RestartState, started: bool) -> None:
        """Count a failed start, or forget the failures after a clean one. Best effort: failing to
        write the record costs one backoff, never the start it is about."""
        if started and not state.count:
            return
        new = next_restart_state(state, self.cap, time.time()) if not started else RestartState(0, 0.0)
        try:
            write_restart_state(daemon_dir, new)
        except OSError as exc:
            log.warning("could not record the MPS daemon's failed starts", extra={"daemon_dir": str(daemon_dir),
                                                                                 "reason": str(exc)})


def stopped_by_quit(log_dir: Path, pid: int | None, started: tuple[int, int] | None) -> bool:
    """Whether a start failed because a client sent the new daemon ``quit``: it is gone, and its log
    shows the command. NVIDIA's daemons (535.261, 550.163) and the stand-in log each command as
    ``[<time> Control <pid, padded to 5>] Cmd:quit`` (measured); tenants cannot write the log dir.
    Any other exit is a failure to start, which backs off."""
    if pid is None:
        return False
    if started is not None:
        gone = wait_for_exit(*started, STOPPED_EXIT_WAIT_S)
    else:
        proc = read_proc_stat(pid)
        gone = proc is None or proc.state in ("Z", "X")
    return gone and re.search(rf"^\[[^]]* Control +{pid}\] Cmd:quit$", _log_end(log_dir / CONTROL_LOG_NAME),
                              re.MULTILINE) is not None


def _log_end(path: Path) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        size = os.fstat(fd).st_size
        return os.pread(fd, _LOG_END_BYTES, max(size - _LOG_END_BYTES, 0)).decode("utf-8", errors="replace")
    except OSError:
        return ""
    finally:
        os.close(fd)
