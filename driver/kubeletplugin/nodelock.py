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
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from driver.kubeletplugin.filemodes import PRIVATE_FILE_MODE, ensure_private_dir


class LockTimeout(Exception):
    pass


class LockFileError(OSError):
    """The lock file cannot be used (a symlink or not a regular file); the message says which."""


class LockFile:
    """A lock shared by this process's threads (a mutex) and by other plugin processes (``flock``).

    The file stays open between holds: a prepare takes the node lock several times and its GPU's lock
    twice, and opening, checking and closing the file each time cost more than the work done under it.
    """

    def __init__(self, path: Path):
        self.path = path
        self._path_text = os.fspath(path)  # stat at every hold: no Path conversion each time
        self._mutex = threading.Lock()
        self._fd: int | None = None  # guarded by _mutex
        self._identity: tuple[int, int] = (0, 0)  # (st_dev, st_ino) of the file _fd has open
        self._close: weakref.finalize[[int], LockFile] | None = None  # closes _fd once: now, or with this object

    @contextmanager
    def held(self, deadline: float, timed_out: Callable[[bool], Exception]) -> Iterator[None]:
        """Hold the mutex, then the flock; give up at ``deadline`` (``time.monotonic()``) with
        ``timed_out(by_other_process)``. The file's directory is created private if missing."""
        if not self._mutex.acquire(timeout=max(0.0, deadline - time.monotonic())):
            raise timed_out(False)
        try:
            fd = self._lock(deadline, timed_out)
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            self._mutex.release()

    def _lock(self, deadline: float, timed_out: Callable[[bool], Exception]) -> int:
        """flock the file (opened once, and again if it was replaced); the descriptor. Mutex held."""
        while True:
            if self._fd is None:
                ensure_private_dir(self.path.parent)
                fd = _open_lock_file(self.path)
                info = os.fstat(fd)
                self._fd, self._identity = fd, (info.st_dev, info.st_ino)
                self._close = weakref.finalize(self, os.close, fd)
            _flock(self._fd, deadline, timed_out)
            # Other processes lock whatever file is at the path now: if ours was removed or replaced
            # since it was opened, holding it would exclude nobody, so open the one there and lock that.
            try:
                now: os.stat_result | None = os.stat(self._path_text, follow_symlinks=False)
            except FileNotFoundError:
                now = None
            if now is not None and (now.st_dev, now.st_ino) == self._identity:
                return self._fd
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            if self._close is not None:
                self._close()
            self._fd = None


class NodeLock:
    def __init__(self, path: Path, timeout: float = 10.0):
        self.path = path
        self.timeout = timeout
        self._file = LockFile(path)

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._file.held(time.monotonic() + self.timeout, self._timed_out):
            yield

    def _timed_out(self, by_other_process: bool) -> Exception:
        if by_other_process:
            return LockTimeout(f"another plugin process held {self.path} for over {self.timeout:.0f}s "
                               "(a rolling update in progress?); the kubelet will retry")
        return LockTimeout(f"another operation in this driver held the node lock for over {self.timeout:.0f}s")


def _flock(fd: int, deadline: float, timed_out: Callable[[bool], Exception]) -> None:
    """Exclusive flock on ``fd``, polling until ``deadline`` (another process holds it meanwhile)."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise timed_out(True) from None
            time.sleep(0.005)


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
