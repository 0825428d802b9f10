"""Processes that look like MPS control daemons of a pipe directory, as a hostile tenant would keep them.

A keeper shell (its own session, optionally as another UID) starts ``count`` look-alikes and starts
a new one whenever one exits. Each look-alike is a shell whose command line is
``nvidia-cuda-mps-control -c <loop> -f`` and whose environment names the pipe directory; SIGTERM is
ignored throughout. So a look-alike that was signalled (SIGKILL) is replaced under a new PID: a test
sees whether any was touched by comparing PIDs. Everything is killed with the keeper's process group.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

NOBODY = 65534
_KEEPER = r"""
trap '' TERM
spawn() { (exec -a nvidia-cuda-mps-control bash -c 'while :; do sleep 3600; done' -f) & }
for _ in $(seq "$1"); do spawn; done
while :; do wait -n; spawn; done
"""


class LookAlikes:
    def __init__(self, keeper: subprocess.Popen[bytes], pipe_dir: Path, count: int) -> None:
        self.keeper = keeper
        self.pipe_dir = pipe_dir
        self.count = count

    def current(self) -> set[tuple[int, int]]:
        """``(pid, start time)`` of the keeper's look-alikes alive now (read here, not with the driver's code)."""
        found = set()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv0 = (entry / "cmdline").read_bytes().split(b"\0")[0]
                fields = (entry / "stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            if argv0 == b"nvidia-cuda-mps-control" and int(fields[1]) == self.keeper.pid and fields[0] != "Z":
                found.add((int(entry.name), int(fields[19])))
        return found

    def wait_all_running(self, limit: float = 20.0) -> set[tuple[int, int]]:
        deadline = time.monotonic() + limit
        while len(found := self.current()) != self.count:
            assert self.keeper.poll() is None, f"the look-alike keeper exited with {self.keeper.returncode}"
            assert time.monotonic() < deadline, f"only {len(found)} of {self.count} look-alikes started"
            time.sleep(0.02)
        return found

    def close(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.keeper.pid, signal.SIGKILL)
        self.keeper.wait()


@contextlib.contextmanager
def look_alikes(pipe_dir: Path, count: int, uid: int | None = NOBODY) -> Iterator[LookAlikes]:
    """``count`` SIGTERM-ignoring look-alikes of ``pipe_dir``'s daemon, kept alive as ``uid`` (None: this
    process's own UID), all running when this yields; killed on exit, whatever happened."""
    env = {"PATH": "/usr/bin:/bin", "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    # setpriv(1) (util-linux) changes the UID and execs the keeper: Popen(user=...) would fork() this
    # process, running gRPC's fork handlers in tests that hold gRPC channels.
    as_uid = [] if uid is None else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
    keeper = subprocess.Popen([*as_uid, "bash", "-c", _KEEPER, "keeper", str(count)], env=env, cwd="/",
                              stdin=subprocess.DEVNULL, start_new_session=True)
    kept = LookAlikes(keeper, pipe_dir, count)
    try:
        kept.wait_all_running()
        yield kept
    finally:
        kept.close()
