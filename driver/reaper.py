"""Nothing a short-lived command started outlives it: not on a signal, not on ``kill -9``.

``check-node`` and the demo start processes that leave their process group on purpose (MPS
control daemons, real or stand-in, run in sessions of their own; the demo's driver too), so a
signal to the terminal's process group, or the death of the command, does not reach them. A
parent-death signal does not either: it is cleared when a daemon forks, and fires when the
*thread* that started a child exits, not the process.

So each command runs under a :class:`Reaper`:

* a token in this process's environment, inherited by everything it starts (the drivers' own
  subprocess environments are built from ``os.environ``), is how those processes are found in
  /proc, whatever session they moved to;
* the command asks for SIGTERM when its own parent exits (``PR_SET_PDEATHSIG``), so a vanished shell
  or ``kubectl exec`` session stops it as SIGTERM does;
* a watchdog process, in a session of its own so the terminal's signals do not reach it, holds the
  read end of a pipe whose write end only this process has. When this process ends, however it
  ends, the pipe reads end-of-file, and the watchdog stops every process holding the token and
  removes the directories it was told about.

On a normal exit or a handled signal the command does the same itself first and waits for the
watchdog, so nothing is left running when the command's exit status is seen.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from types import FrameType, TracebackType

from driver.gpu.mps.proc import read_proc_stat

TOKEN_ENV = "TESSERA_REAPER_TOKEN"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_WATCHDOG_WAIT_S = 15.0


class Interrupted(BaseException):
    """SIGTERM, SIGINT or SIGHUP arrived; a BaseException so that no ``except Exception`` swallows it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def status(self) -> int:
        return 128 + self.signum


def _interrupt(signum: int, _frame: FrameType | None) -> None:
    # The first signal starts the shutdown; more (an impatient Ctrl-C, a hangup after a TERM) must
    # not cut the cleanup short.
    for other in STOP_SIGNALS:
        signal.signal(other, signal.SIG_IGN)
    raise Interrupted(signum)


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
    stat = read_proc_stat(pid)
    return stat is not None and stat.state not in ("Z", "X")


def reap(token: str, dirs: list[Path], grace_s: float = 3.0) -> None:
    """Stop every process holding ``token``, then remove ``dirs`` (a daemon must not see its directory go first)."""
    stop_processes(processes_with_env(TOKEN_ENV, token), grace_s)
    for path in dirs:
        shutil.rmtree(path, ignore_errors=True)


class Reaper:
    """The token, the watchdog and the stop signals for one command; see the module docstring."""

    def __init__(self) -> None:
        self.token = uuid.uuid4().hex
        self._dirs: list[Path] = []
        self._pipe: int | None = None
        self._watchdog: subprocess.Popen[bytes] | None = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> Reaper:
        # os.pipe() descriptors are not inherited: only the watchdog (given the read end) and this
        # process hold the pipe, so its end-of-file means this process is gone.
        read_end, self._pipe = os.pipe()
        env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
        self._watchdog = subprocess.Popen(
            [sys.executable, "-m", "driver.reaper", self.token, str(read_end)], env=env, pass_fds=(read_end,),
            stdin=subprocess.DEVNULL, start_new_session=True)
        os.close(read_end)
        os.environ[TOKEN_ENV] = self.token
        self._previous = {s: signal.signal(s, _interrupt) for s in STOP_SIGNALS}
        # The command's own parent (a shell, kubectl exec) dying is a SIGTERM to it, handled like any other.
        parent = os.getppid()
        _parent_death_signal(signal.SIGTERM)
        if os.getppid() != parent:  # it died before the request took effect
            os.kill(os.getpid(), signal.SIGTERM)
        return self

    def remove_on_exit(self, path: Path) -> None:
        """Have ``path`` removed after the processes are stopped, also if this process is killed."""
        self._dirs.append(path)
        if self._pipe is not None:
            os.write(self._pipe, f"{path}\n".encode())

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        try:
            reap(self.token, self._dirs)
        finally:
            _parent_death_signal(0)  # the process may go on (tests call commands in-process)
            os.environ.pop(TOKEN_ENV, None)
            if self._pipe is not None:
                os.close(self._pipe)
                self._pipe = None
            if self._watchdog is not None:
                try:
                    self._watchdog.wait(timeout=_WATCHDOG_WAIT_S)
                except subprocess.TimeoutExpired:
                    self._watchdog.kill()
                    self._watchdog.wait()
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)  # type: ignore[arg-type]


def _parent_death_signal(signum: int) -> None:
    """prctl(PR_SET_PDEATHSIG): ``signum`` when the parent exits (0: none). Linux only; elsewhere nothing."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signum, 0, 0, 0)
    except (OSError, AttributeError):
        pass  # no prctl here: a signal or the watchdog still covers everything but the parent's death


def no_cleanup(_path: Path) -> None:
    """For a command that runs under no :class:`Reaper` (in-process callers): its own cleanup is all."""


def watchdog(token: str, read_fd: int) -> None:
    """Read directory names until end-of-file (the command has ended), then stop and remove what it left."""
    for signum in STOP_SIGNALS:
        # Its own session already keeps the terminal's signals away; this covers a signal sent to the
        # whole process tree, which must not stop the one process that cleans up after it.
        signal.signal(signum, signal.SIG_IGN)
    dirs: list[Path] = []
    with os.fdopen(read_fd, "rb") as pipe:
        for line in pipe:
            dirs.append(Path(line.decode().rstrip("\n")))
    reap(token, dirs)


if __name__ == "__main__":
    watchdog(sys.argv[1], int(sys.argv[2]))
