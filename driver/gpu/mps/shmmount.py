"""A ``/dev/shm`` of its own for each MPS daemon: a tmpfs of the daemon's size at ``<mps dir>/<id>/shm``.

Why one per daemon, with nothing of the driver's on it: docs/sharing.md, "The pipe directory and `/dev/shm`".
It is mounted in the mount namespace where the client containers' CDI bind mounts resolve (the MPS host's, whose
MPS directory volume has Bidirectional propagation, or the ``LocalLauncher``'s, the plugin's), never in the
daemon's private one, which binds it over ``/dev/shm`` (``hostcmd.py``) after this mount. It lives from the
daemon's first launch until the driver removes the daemon's directory (its launcher's ``unmount_shm``), so the
clients' bind mounts of it meet a restarted daemon's files.

mount(2) and umount2(2) go through ctypes: no child process to bound in time (a tmpfs mount does
no I/O), and the errno comes back as it is. The target is reached from the MPS directory one
directory fd at a time with ``O_NOFOLLOW`` (``dirs.open_dir_below``) and mounted and unmounted
through ``/proc/self/fd``, so a symlink at any component below the MPS directory (``<id>`` or
``shm``) is never followed: its mount or unmount fails with ELOOP or ENOTDIR, naming the path.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
import os
import stat
from dataclasses import dataclass, field
from pathlib import Path

from driver.gpu.claimconfig.quantity import check_shm_size, parse_quantity
from driver.gpu.mps.dirs import daemon_base, open_dir_below
from driver.gpu.mps.hostclient import HostReply, ShmRelease
from driver.gpu.mps.hostcmd import HostMode, Tools, daemon_argv
from driver.gpu.mps.launch import DaemonLaunch, DaemonLauncher, MpsLaunchError
from driver.gpu.mps.model import check_daemon_id

log = logging.getLogger(__name__)

# <sys/mount.h>
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MNT_DETACH = 2
# nosuid,nodev,noexec: what the chart's shared tmpfs had; a tenant's files there are data, never programs.
TMPFS_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
# More stacked mounts than this on one shm directory is not something a crash leaves: stop, say so.
_MAX_STACKED = 16


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)  # the running process's C library (glibc or musl)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
    libc.mount.restype = ctypes.c_int
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.umount2.restype = ctypes.c_int
    return libc


def _errno_error(path: Path) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, os.strerror(code), str(path))


def is_mount_point(path: Path) -> bool:
    """Whether a file system is mounted on the directory ``path`` (reached as ``dirs.open_dir_below`` does from
    its MPS directory, or its parent: a symlink is not one)."""
    try:
        parent = open_dir_below(daemon_base(path), path.parent)
    except (OSError, ValueError):
        return False
    try:
        return _mounted_at(parent, path.name)
    finally:
        os.close(parent)


def _mounted_at(parent: int, name: str) -> bool:
    try:
        own = os.stat(name, dir_fd=parent, follow_symlinks=False)
    except OSError:
        return False
    return stat.S_ISDIR(own.st_mode) and own.st_dev != os.fstat(parent).st_dev


def _target_fd(parent: int, name: str) -> int:
    return os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=parent)


def mount_tmpfs(path: Path, size: int) -> None:
    """Mount a tmpfs of at most ``size`` bytes, mode 1777 (as /dev/shm), on the real directory ``path``."""
    parent = open_dir_below(daemon_base(path), path.parent)
    try:
        fd = _target_fd(parent, path.name)
    finally:
        os.close(parent)
    try:
        options = f"size={size},mode=1777".encode()
        if _libc().mount(b"tmpfs", f"/proc/self/fd/{fd}".encode(), b"tmpfs", TMPFS_FLAGS, options) != 0:
            raise _errno_error(path)
    finally:
        os.close(fd)


def unmount_all(path: Path) -> int:
    """Unmount whatever is mounted on ``path``, stacked mounts included; how many were unmounted.

    Lazily (MNT_DETACH): the mount leaves every namespace it propagated to at once, even while a
    process still has a file open on it, and its memory goes when the last user does. A client's own
    bind mount of it is a mount of its own and keeps working until its container ends. Each is
    unmounted through an fd of its root (``/proc/self/fd``), so no link below the MPS directory is followed.
    """
    count = 0
    parent = open_dir_below(daemon_base(path), path.parent)
    try:
        while _mounted_at(parent, path.name):
            if count >= _MAX_STACKED:
                raise OSError(errno.EBUSY, f"still a mount point after {count} unmounts", str(path))
            fd = _target_fd(parent, path.name)  # the top mount's root: opened again after each unmount
            try:
                if _libc().umount2(f"/proc/self/fd/{fd}".encode(), MNT_DETACH) != 0:
                    raise _errno_error(path)
            finally:
                os.close(fd)
            count += 1
    finally:
        os.close(parent)
    return count


def parse_shm_size(text: str) -> int:
    """Bytes from a quantity such as ``1Gi``, within the bounds of a daemon's /dev/shm; ValueError says why."""
    try:
        size = parse_quantity(text, "size")
    except ValueError as exc:
        raise ValueError(str(exc).removeprefix("size: ")) from exc
    return check_shm_size(size)


def _describe(exc: OSError) -> str:
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return f"{name} ({exc.strerror})"


@dataclass(frozen=True)
class ShmTmpfs:
    """A launcher's per-daemon tmpfs, turned on by the setting ``flag`` (named in every error)."""

    default_size: int  # bytes, for a request that names none
    flag: str
    tools: Tools = field(default_factory=Tools)

    def mount(self, request: DaemonLaunch) -> Path:
        """Make ``request.shm_dir`` a tmpfs of the request's size, keeping one already there; return it.

        Kept: it is this daemon's from an earlier run (a restart in the same directories), and its
        clients' bind mounts hold it.
        """
        shm = request.shm_dir
        if shm is None:
            raise MpsLaunchError(f"{self.flag}: daemon {request.daemon_id} was launched without a shm directory")
        if is_mount_point(shm):
            return shm
        size = request.shm_size or self.default_size
        try:
            mount_tmpfs(shm, size)
        except OSError as exc:
            hint = "; mounting needs CAP_SYS_ADMIN" if exc.errno == errno.EPERM else ""
            raise MpsLaunchError(f"{self.flag}: cannot mount a tmpfs of {size} bytes at {shm} for daemon "
                                 f"{request.daemon_id}: {_describe(exc)}{hint}") from exc
        return shm

    def wrap(self, request: DaemonLaunch, binary: Path, driver_root: Path) -> list[str]:
        """The command line that runs the daemon with the tmpfs bound over ``/dev/shm`` in a private
        mount namespace, as the MPS host's ``--private-shm`` does (``hostcmd.py``)."""
        for tool in (self.tools.unshare, self.tools.sh, self.tools.mount):
            if not os.access(tool, os.X_OK):
                raise MpsLaunchError(f"{self.flag}: needs {tool} (util-linux unshare and mount, a shell) to give "
                                     f"daemon {request.daemon_id} its tmpfs as /dev/shm")
        mps_dir = request.pipe_dir.parent.parent  # <mps dir>/<id>/pipe; used only by --chroot, off here
        return daemon_argv(request, binary, mps_dir, HostMode(driver_root=driver_root, private_shm=True),
                           self.tools)


def try_unmount_daemon_shm(launcher: DaemonLauncher, daemon_dir: Path) -> None:
    """Have ``launcher`` unmount the tmpfs on ``daemon_dir``'s shm directory before it is removed.

    A failure is logged, not raised: the daemon is stopped either way, and the directory removal that
    follows leaves a still-mounted shm directory in place (dirs.py), so nothing a tenant wrote there
    is lost track of: the sweep at the next start stops and removes it again.
    """
    try:
        launcher.unmount_shm(daemon_dir.name, daemon_dir / "shm")
    except MpsLaunchError as exc:
        log.warning("MPS daemon /dev/shm tmpfs not unmounted", extra={"daemon_dir": str(daemon_dir),
                                                                       "reason": str(exc)})


def unmount_shm_here(shm_dir: Path, flag: str) -> None:
    """Unmount whatever tmpfs a launcher left on ``shm_dir``, even one mounted under an earlier setting."""
    try:
        unmount_all(shm_dir)
    except OSError as exc:
        raise MpsLaunchError(f"{flag}: cannot unmount the tmpfs at {shm_dir}: {_describe(exc)}") from exc


def answer_release(release: ShmRelease, mps_dir: Path) -> HostReply:
    """The MPS host's answer to a release: unmount ``<mps dir>/<daemon id>/shm``, and nothing else.

    Also without ``--shm-tmpfs``: a tmpfs mounted under an earlier configuration must not outlive its
    daemon. Not refused while the daemon runs: it keeps its own /dev/shm bind either way.
    """
    try:
        check_daemon_id(release.daemon_id)
    except ValueError as exc:
        return HostReply(error=f"invalid release: {exc}")
    expected = mps_dir / release.daemon_id / "shm"
    if release.shm_dir != expected:
        return HostReply(error=f"invalid release: shm_dir {release.shm_dir} is not {expected}, the shm directory "
                               f"of daemon {release.daemon_id}")
    try:
        unmount_shm_here(expected, "--shm-tmpfs")
    except MpsLaunchError as exc:
        log.warning("MPS daemon /dev/shm tmpfs not unmounted", extra={"daemon_id": release.daemon_id,
                                                                       "reason": str(exc)})
        return HostReply(error=str(exc))
    return HostReply(released=True)
