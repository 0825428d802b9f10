"""One demo at a time on a ``--workdir``: a second run would clear the first one's files under it.

The lock is an ``flock`` on a file in the working directory, held by the demo process for its whole
run: the kernel drops it when that process ends, however it ends, so a killed demo never leaves the
directory locked.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".demo.lock"


class WorkdirBusy(Exception):
    """Another demo process holds the working directory; the message is one line."""


@contextmanager
def workdir_lock(workdir: Path) -> Iterator[None]:
    """Hold ``workdir`` for this process (creating it), or raise :class:`WorkdirBusy` at once."""
    workdir.mkdir(parents=True, exist_ok=True)
    fd = os.open(workdir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise WorkdirBusy(f"--workdir {workdir}: another demo (pid {holder}) is running in it; wait for it to "
                              "end, or give another --workdir") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        yield
    finally:
        os.close(fd)
