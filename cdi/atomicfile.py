"""Replacing a file so that readers see the old content or the new, never part of either.

The data goes to a temporary name in the same directory (``.<name>.<random>.tmp``: CDI runtimes
read only ``.json``/``.yaml`` files, and every lister in this project skips dot names), is
fsynced, gets its mode, and is renamed over the target; the directory is then fsynced so the
rename survives a power failure. Lives in the ``cdi`` package because CDI producers need it and
that package imports nothing from the driver; the driver's checkpoint uses the same function.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_atomic(path: Path, data: bytes, *, mode: int = 0o600, durable: bool = True,
                 sync_data: bool = True) -> None:
    """Create or replace ``path`` with ``data``, file mode ``mode``.

    On any failure the previous file, if any, is left as it was and no temporary file remains.
    ``durable=False`` skips the directory fsync: the file is whole whenever it is there, but a
    power failure may bring back the previous one (for callers that can recreate it).
    ``sync_data=False`` (only with ``durable=False``) also skips the file's fsync: readers and a
    kill -9 still see the old or the new content, but after a power failure the file may be
    empty or torn, so only for callers that check the file at start and rewrite it.
    The directory must exist.
    """
    if sync_data is False and durable:
        raise ValueError("a durable write must sync the file's data")
    directory = path.parent
    fd, temp_name = _create_temp(directory, path.name)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if sync_data:
                os.fdatasync(fd)  # the data and its size: what a reader after a power failure needs
            # Created 0600 whatever the umask; readers of other users need their mode set.
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        os.replace(temp_name, path)
    except BaseException:
        Path(temp_name).unlink(missing_ok=True)
        raise
    if durable:
        fsync_directory(directory)


def _create_temp(directory: Path, name: str) -> tuple[int, str]:
    """A new private file ``.<name>.<random>.tmp`` in ``directory``: its descriptor and path.

    Not ``tempfile.mkstemp``: its name generation and argument handling cost more than the rest of
    a small write, and a checkpoint or spec is written several times per prepare."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW
    while True:
        temp_name = os.path.join(directory, f".{name}.{os.urandom(6).hex()}.tmp")
        try:
            return os.open(temp_name, flags, 0o600), temp_name
        except FileExistsError:
            continue  # 48 random bits met a leftover of an interrupted write: draw again


def fsync_directory(directory: Path) -> None:
    """Make the renames and unlinks done in ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
