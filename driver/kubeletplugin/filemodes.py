"""The modes of what the plugin creates in its state directory, set explicitly rather than left to the umask.

The process runs with umask 0o077 (``driver/cli.py``), so anything created without a mode is
private already; these helpers also correct what an older release or another tool left with a
wider mode. Only the kubelet (root) talks to the sockets and only the plugin reads the state, so
nothing here needs to be readable by others. What must be (CDI specs, the MPS pipe directory)
sets its own mode where it is written.
"""

from __future__ import annotations

import stat
from pathlib import Path

STATE_DIR_MODE = 0o700
SOCKET_MODE = 0o600
PRIVATE_FILE_MODE = 0o600


def ensure_private_dir(directory: Path) -> None:
    """Create ``directory`` (and missing parents) and make it mode 0700; refuse a non-directory.

    Parents that already exist keep their mode: they may be the kubelet's or the host's.
    """
    directory.mkdir(mode=STATE_DIR_MODE, parents=True, exist_ok=True)
    info = directory.lstat()
    if not stat.S_ISDIR(info.st_mode):
        raise NotADirectoryError(f"{directory} is not a directory (a symlink or a file is in its place); "
                                 "remove it so the driver can create its state directory")
    if info.st_mode & stat.S_ISVTX:
        # A sticky directory (/tmp and the like) is shared by design: narrowing it would lock
        # every other user of the host out of it.
        raise PermissionError(f"{directory} is a shared (sticky) directory; give the driver a directory of its own")
    if stat.S_IMODE(info.st_mode) != STATE_DIR_MODE:
        directory.chmod(STATE_DIR_MODE)


def restrict_socket(path: Path) -> None:
    """Make a socket this process just bound mode 0600 (only root, the kubelet, connects)."""
    path.chmod(SOCKET_MODE)
