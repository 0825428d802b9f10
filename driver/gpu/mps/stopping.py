"""Stopping an MPS control daemon: ``quit`` first, then SIGTERM and SIGKILL, each bounded in time.

A client may hold the daemon's control socket while it is stopped. One that connected and sent
nothing keeps ``quit`` waiting as long as it likes (measured with NVIDIA's 550.163 and 535.261,
scripts/measure-mps-control.py): that connection is shut down first (``holders.py``; the daemon is
being stopped anyway), and ``quit`` gets a few seconds to be taken, not the whole stop budget. One
that holds the daemon's control session makes NVIDIA's front-end exit at once, at times with status 0
and nothing done, so ``quit`` is sent again while the daemon has not exited and time is left.
SIGTERM ends the daemon within milliseconds even while it is held (measured).
"""

from __future__ import annotations

import logging
from pathlib import Path

from driver.gpu.mps.control import MpsControl
from driver.gpu.mps.holders import held_connection, release
from driver.gpu.mps.model import MpsError
from driver.gpu.mps.proc import StopSteps, end_processes, wait_for_exit
from driver.kubeletplugin.types import Deadline

log = logging.getLogger(__name__)

# NVIDIA's front-end takes quit in milliseconds; longer means a client holds the socket.
QUIT_ANSWER_S = 2.0
# How long a quit the front-end took is given to show (the daemon exits) before it is sent again.
_QUIT_TAKEN_S = 0.5


def stop_processes(control: MpsControl, pipe_dir: Path, log_dir: Path, targets: list[tuple[int, int]],
                   steps: StopSteps) -> None:
    """Stop ``targets`` (pid, start time) serving ``pipe_dir`` within ``steps``; MpsError if one survives SIGKILL."""
    if not targets:
        return
    for pid, _ in targets:
        held = held_connection(pid)
        if held is not None:
            release(held)
    deadline = Deadline.after(steps.quit_s, purpose="stop")
    quit_until: float | None = None
    pid, start_time = targets[0]
    while deadline.remaining() > 0:
        try:
            control.send(pipe_dir, log_dir, "quit", deadline.capped(QUIT_ANSWER_S))
        except MpsError as exc:
            log.info("MPS quit not delivered; will signal the daemon", extra={"pipe_dir": str(pipe_dir),
                                                                               "reason": str(exc)})
            break
        quit_until = deadline.at
        if wait_for_exit(pid, start_time, deadline.bound(_QUIT_TAKEN_S)):
            break
    left = end_processes(targets, quit_until, steps)
    if left:
        raise MpsError(f"MPS control daemon pid {left[0]} is still running after SIGKILL")
