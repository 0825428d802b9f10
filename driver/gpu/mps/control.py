"""Control commands to an MPS control daemon: ``echo '<cmd>' | nvidia-cuda-mps-control``, bounded in time.

Whatever listens on a pipe directory's sockets (with an older read-write client mount, a tenant
could plant its own), a command never holds the caller longer than its timeout, and is never sent
through a symlink, which could lead to another daemon's socket.
"""

from __future__ import annotations

import os
import random
import re
import stat
import time
from collections.abc import Sequence
from pathlib import Path

from driver.gpu.host.binaries import (
    BinaryFailed,
    BinaryNotFound,
    BinaryTimedOut,
    driver_env,
    find_binary,
    run_binary,
)
from driver.gpu.mps.model import MpsBusy, MpsError, MpsNoAnswer
from driver.gpu.mps.proc import CONTROL_BINARY
from driver.kubeletplugin.types import Deadline

CONTROL_SOCKET_NAME = "control"
# The socket NVIDIA's front-end client uses when run as root (measured: 0755, beside the 0666 control).
PRIVILEGED_SOCKET_NAME = "control_privileged"
# What the real daemon answers to a command it does not carry out (measured on 535.261 and 550.163:
# `Unknown command "x"`, "Insufficient privileges for UID ...", "Not enough privilege ..."), plus the
# simulation's injected errors. Many refusals print nothing at all, hence the manager's read-backs.
_REFUSAL = re.compile(r"error|invalid|unknown command|privilege|unrecogni[sz]ed|fail|not supported|usage", re.I)
# While another client holds the daemon's one control session, NVIDIA's front-end exits at once with
# this (exit 1), or with nothing (exit 1 or 0), and the daemon carries out none of its commands
# (measured with 550.163 and 535.261 against an open session, scripts/measure-mps-control.py). A
# session that was served always prints the answer of the sentinel sent last, so no answer at all is
# a busy socket too, not an empty reply.
BUSY_MESSAGE = "Cannot send command to MPS control daemon process"
SENTINEL = "get_default_active_thread_percentage"
# Sessions last milliseconds (about 3 ms each with NVIDIA's binary): try again soon, jittered so that
# looping clients do not keep taking the turn in lockstep with the driver.
_BUSY_PAUSE_FIRST_S = 0.005
_BUSY_PAUSE_MAX_S = 0.1


class MpsControl:
    """Sends control commands with the driver root's ``nvidia-cuda-mps-control``."""

    def __init__(self, driver_root: Path, command_timeout: float) -> None:
        self.driver_root = driver_root
        self.command_timeout = command_timeout

    def send(self, pipe_dir: Path, log_dir: Path, command: str, deadline: Deadline | None = None) -> str:
        """Send one command (or several, a line each) and return the answer, stripped.

        It gets ``command_timeout``, or what is left before ``deadline`` if that is less. While another
        client holds the daemon's one control session the command is sent again until that time is up,
        then :class:`MpsBusy`; a daemon that answers nothing at all is :class:`MpsNoAnswer`.
        """
        label = f"control command {command!r}"
        timeout, limit = self.command_timeout, f"within {self.command_timeout:g}s"
        if deadline is not None and deadline.remaining() < timeout:
            timeout, limit = deadline.remaining(), f"before {deadline.what}"
            if timeout <= 0:
                raise MpsError(f"{label} not sent: {deadline.what} has passed")
        ends = time.monotonic() + timeout
        pause, tries = _BUSY_PAUSE_FIRST_S, 0
        while True:
            tries += 1
            try:
                answer = self._send_once(pipe_dir, log_dir, command, label, ends - time.monotonic(), limit)
            except MpsNoAnswer as exc:
                if tries == 1:
                    raise
                answer = None  # the socket was busy and the last try ran out of the time left
                if ends - time.monotonic() > 0:
                    raise MpsNoAnswer(f"{label} got no answer {limit} after the socket was busy: {exc}") from exc
            if answer is not None:
                return answer
            time.sleep(max(min(random.uniform(pause / 2, pause), ends - time.monotonic()), 0.0))
            pause = min(pause * 2, _BUSY_PAUSE_MAX_S)
            if ends - time.monotonic() <= 0:
                raise MpsBusy(f"{label} not carried out: another client held the daemon's control socket "
                              f"{pipe_dir / CONTROL_SOCKET_NAME} (its one control session) {limit}, {tries} tries")

    def _send_once(self, pipe_dir: Path, log_dir: Path, command: str, label: str, timeout: float,
                   limit: str) -> str | None:
        """The answer, or None if the control socket was busy."""
        for name, required in ((CONTROL_SOCKET_NAME, True), (PRIVILEGED_SOCKET_NAME, False)):
            if not _socket_or_absent(pipe_dir / name, required):
                what = "missing or not a socket" if required else "not a socket"
                raise MpsError(f"{label} not sent: {pipe_dir / name} is {what}")
        if timeout <= 0:
            raise MpsNoAnswer(f"{label} got no answer {limit}")
        try:
            binary = find_binary(self.driver_root, CONTROL_BINARY)
            env = driver_env(self.driver_root)
        except (BinaryNotFound, BinaryFailed) as exc:
            raise MpsError(str(exc)) from exc
        env["CUDA_MPS_PIPE_DIRECTORY"] = str(pipe_dir)
        env["CUDA_MPS_LOG_DIRECTORY"] = str(log_dir)
        # No sentinel after quit: the daemon is gone before it could answer one.
        sentinel = command.split()[:1] != ["quit"]
        text = f"{command}\n{SENTINEL}\n" if sentinel else command + "\n"
        try:
            out = run_binary([str(binary)], env=env, timeout=timeout, stdin_text=text, label=label)
        except BinaryTimedOut as exc:
            raise MpsNoAnswer(f"{label} got no answer {limit}") from exc
        except BinaryFailed as exc:
            if _busy(str(exc), label):
                return None
            raise MpsError(str(exc)) from exc
        except OSError as exc:
            raise MpsError(str(exc)) from exc
        if not sentinel:
            return out.strip()
        lines = out.splitlines()
        if not lines:
            return None
        return "\n".join(lines[:-1]).strip()

    def set(self, pipe_dir: Path, log_dir: Path, command: str, deadline: Deadline) -> None:
        """Send a ``set_*`` command; an answer that reads as a refusal is an MpsError."""
        answer = self.send(pipe_dir, log_dir, command, deadline)
        if _REFUSAL.search(answer):
            raise MpsError(f"the daemon refused {command!r}: {answer}")

    def set_all(self, pipe_dir: Path, log_dir: Path, commands: Sequence[str], deadline: Deadline) -> None:
        """Send ``set_*`` commands through one client, which carries out one command a line (measured with
        535.261 and 550.163): each spawn costs, and while a daemon starts a tenant may `quit` it. An
        answer that reads as a refusal has each sent alone again, so the MpsError names the one refused."""
        answer = self.send(pipe_dir, log_dir, "\n".join(commands), deadline)
        if _REFUSAL.search(answer):
            for command in commands:
                self.set(pipe_dir, log_dir, command, deadline)
            raise MpsError(f"the daemon refused one of {list(commands)}: {answer}")


def _busy(failure: str, label: str) -> bool:
    """Whether a failed front-end said the socket was busy: the message, or exit 1 with nothing said."""
    return BUSY_MESSAGE in failure or failure == f"{label} failed with exit code 1: (no output)"


def _socket_or_absent(path: Path, required: bool) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return not required
    except OSError:
        return False
