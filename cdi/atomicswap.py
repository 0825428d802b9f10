"""Replacing a file that is rewritten often, atomically, without creating and freeing an inode each time.

:func:`cdi.atomicfile.write_atomic` creates a temporary file and renames it over the target, which
frees the old file's inode and blocks: on the 2-vCPU ext4 (``discard``) machine of docs/benchmarks.md
that cost ~170 µs of CPU and ~0.4 ms of wall time per durable write, and the driver rewrites its
checkpoint three times per prepare+unprepare cycle. Here a durable write puts the new content into a
companion file kept next to the target (``.<name>.swap.tmp``: every lister in this project skips dot
names), overwritten in place and synced, swaps the two with ``renameat2(RENAME_EXCHANGE)`` and syncs
the directory: the target holds the new content, the companion the previous one, ready for the next
write. ~90 µs of CPU and ~0.2 ms there.

Readers see the old content or the new, never part of either (the swap is atomic, like a rename).
The companion is overwritten only while the directory on disk is known to name it the companion:
after a swap made durable. A write that need not be durable (``durable=False``) therefore goes the
create-and-rename way and leaves the companion alone; so does a write where the kernel or the file
system cannot swap (Linux before 3.15, some network and overlay file systems) or the target does not
exist yet. A power failure thus finds the target whole, old or new, as with rename alone.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

from cdi.atomicfile import fsync_directory, write_atomic

_RENAME_EXCHANGE = 2  # <linux/fs.h>
_AT_FDCWD = -100


def _load_renameat2() -> Callable[[int, bytes, int, bytes, int], int] | None:
    try:
        function = ctypes.CDLL(None, use_errno=True).renameat2  # glibc 2.28+, musl 1.2.2+
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    function.restype = ctypes.c_int
    result: Callable[[int, bytes, int, bytes, int], int] = function
    return result


# Loaded once; never changed afterwards.
_RENAMEAT2 = _load_renameat2()


def swap_name(path: Path) -> Path:
    """The companion file of ``path``."""
    return path.with_name(f".{path.name}.swap.tmp")


class SwappedFile:
    """One file rewritten through its companion; :meth:`write` from one thread at a time."""

    def __init__(self, path: Path, mode: int = 0o600):
        self.path = path
        self.companion = swap_name(path)
        self._mode = mode
        self._lock = threading.Lock()
        # A swap done but not yet made durable (its directory fsync deferred, or failed): until one is, the
        # directory on disk may still call the companion the target, so the companion must not be overwritten.
        # True at first: a process killed -9 between its swap and that fsync left the same state behind.
        self._swap_pending = True

    def write(self, data: bytes, *, durable: bool = True, defer_directory_sync: bool = False) -> None:
        """Replace the file with ``data``; ``durable=False`` skips the directory fsync (and the swap).

        ``defer_directory_sync``: a durable write whose directory fsync the caller does later with
        :meth:`sync_directory` (e.g. after releasing a lock); until it does, the next write does it first.
        The directory must exist. On a failure before the file is replaced, it is left as it was."""
        with self._lock:
            if not durable or _RENAMEAT2 is None or not self._swap(data):
                write_atomic(self.path, data, mode=self._mode, durable=durable and not defer_directory_sync)
                self._swap_pending = self._swap_pending or (durable and defer_directory_sync)
                return
            if not defer_directory_sync:
                fsync_directory(self.path.parent)
                self._swap_pending = False

    def sync_directory(self) -> None:
        """Make the last durable write's swap (or rename) survive a power failure."""
        with self._lock:
            fsync_directory(self.path.parent)
            self._swap_pending = False

    def written_elsewhere(self) -> None:
        """Another process replaced the file (it may have swapped and not yet synced the directory, as a
        group commit does after releasing its lock): sync the directory before the companion is next overwritten."""
        with self._lock:
            self._swap_pending = True

    def _swap(self, data: bytes) -> bool:
        """Write through the companion and swap it in (the directory not yet synced: the caller's part);
        False where it cannot be done (the caller renames instead)."""
        if self._swap_pending:
            fsync_directory(self.path.parent)
            self._swap_pending = False
        try:
            # O_NONBLOCK: a FIFO in its place must not hang the open; anything but a regular file is refused.
            fd = os.open(self.companion, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                         0o600)
        except OSError:  # e.g. a symlink in its place (ELOOP): the plain way still works
            return False
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return False
            # In place and then cut to length: no blocks are freed unless the file shrinks by whole blocks.
            view = memoryview(data)
            offset = 0
            while offset < len(view):
                offset += os.pwrite(fd, view[offset:], offset)
            os.ftruncate(fd, len(data))
            os.fdatasync(fd)  # the data and its size, not the timestamps: what a reader after a power failure needs
            os.fchmod(fd, self._mode)
        finally:
            os.close(fd)
        if not _exchange(self.companion, self.path):
            return False  # no swap here, or no target yet: the companion stays, the content goes by rename
        self._swap_pending = True
        return True


def _exchange(first: Path, second: Path) -> bool:
    """Swap two paths atomically; False where that is not possible."""
    assert _RENAMEAT2 is not None
    if _RENAMEAT2(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOENT, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EXDEV):
        return False  # no target yet, or a kernel or file system without RENAME_EXCHANGE
    raise OSError(code, f"renameat2({first}, {second}, RENAME_EXCHANGE): {os.strerror(code)}")
