"""A node-wide lock shared by threads of this process and by other plugin pods on the node.

During a rolling update two plugin pods serve the same node and share the state directory;
``flock`` on a file in that directory serialises their state changes. The in-process mutex
keeps threads of one process from relying on flock semantics between their own descriptors.

The lock file is opened without following a symlink and must be a regular file: the state
directory is shared with the previous pod, and a planted link or FIFO must not make the driver
lock (or block on) something else.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from driver.kubeletplugin.filemodes import PRIVATE_FILE_MODE, ensure_private_dir


class LockTimeout(Exception):
    pass


class LockFileError(OSError):
    """The lock file cannot be used (a symlink or not a regular file); the message says which."""


class NodeLock:
    def __init__(self, path: Path, timeout: float = 10.0):
        self.path = path
        self.timeout = timeout
        self._mutex = threading.Lock()

    @contextmanager
    def held(self) -> Iterator[None]:
        def timed_out(by_other_process: bool) -> Exception:
            if by_other_process:
                return LockTimeout(f"another plugin process held {self.path} for over {self.timeout:.0f}s "
                                   "(a rolling update in progress?); the kubelet will retry")
            return LockTimeout(f"another operation in this driver held the node lock for over {self.timeout:.0f}s")

        with hold_lock_file(self.path, self._mutex, time.monotonic() + self.timeout, timed_out):
            yield


@contextmanager
def hold_lock_file(path: Path, mutex: threading.Lock, deadline: float,
                   timed_out: Callable[[bool], Exception]) -> Iterator[None]:
    """Hold ``mutex`` (threads of this process), then ``flock`` on ``path`` (other plugin processes).

    Gives up at ``deadline`` (``time.monotonic()``) with ``timed_out(by_other_process)``. The lock
    file's directory is created private if missing.
    """
    if not mutex.acquire(timeout=max(0.0, deadline - time.monotonic())):
        raise timed_out(False)
    try:
        ensure_private_dir(path.parent)
        fd = _open_lock_file(path)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise timed_out(True) from None
                    time.sleep(0.005)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
    finally:
        mutex.release()


def _open_lock_file(path: Path) -> int:
    # O_NONBLOCK: opening a FIFO planted in place of the file must not hang; it is refused below.
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, PRIVATE_FILE_MODE)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise LockFileError(errno.ELOOP, f"lock file {path} is a symlink; remove it (the driver "
                                             "creates a regular file there)") from None
        raise
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise LockFileError(errno.EINVAL, f"lock file {path} is not a regular file; remove it "
                                              "(the driver creates a regular file there)")
        if stat.S_IMODE(info.st_mode) != PRIVATE_FILE_MODE:
            os.fchmod(fd, PRIVATE_FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd
