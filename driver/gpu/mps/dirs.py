"""The on-disk side of MPS daemons: their directories, kept safe from what tenants plant in them.

Layout under the MPS base directory (the driver's own; tenants never see it whole)::

    <base>/<daemon_id>/pipe/           CUDA_MPS_PIPE_DIRECTORY, bind-mounted read-only into clients
    <base>/<daemon_id>/log/            CUDA_MPS_LOG_DIRECTORY (control.log)
    <base>/<daemon_id>/shm/            a per-daemon /dev/shm: a tmpfs of its own where the launcher mounts one
    <base>/<daemon_id>/restarts.json   restart backoff state

The shared MPS ``/dev/shm`` directory lives outside ``<base>``, so it can never be taken for a
daemon directory. Tenants write into ``shm/`` (and, with older mounts, ``pipe/``): everything here
uses ``lstat`` and never follows a symlink found inside those directories. Nor one anywhere below
``<base>``: a link planted at ``<base>/<daemon_id>`` must not make the driver empty, unmount or write
a directory elsewhere, so paths there are walked one directory fd at a time with ``O_NOFOLLOW``
(:func:`open_dir_below`, :func:`open_below_base`); ``<base>`` and what leads to it are configuration.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
import re
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from driver.gpu.mps.model import MpsError

# The names the driver gives its daemons (driver/gpu/claim/claimplan.py: shared_daemon_id,
# claim_daemon_id, share_daemon_id; the multi-user probe's in manager.py). Anything else under the
# base directory is not the driver's to stop or remove.
DRIVER_DAEMON_DIR_NAME = re.compile(
    r"^(plan-[0-9a-f]{12}|claim-[0-9a-f]{12}-[0-9]{1,4}|share-[0-9a-f]{12}|probe-multi-user)$")
RESTART_STATE_NAME = "restarts.json"


DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def open_dir_below(top: Path, path: Path, flags: int = DIR_FLAGS) -> int:
    """An fd of the directory ``path``, reached from ``top`` one component at a time without following a link
    (``top`` itself is opened without following one either; what leads to it is trusted). OSError (ELOOP,
    ENOTDIR, ENOENT) where a component is a link or no directory; ValueError if ``path`` is not under ``top``."""
    fd = os.open(top, DIR_FLAGS if path != top else flags)
    try:
        parts = path.relative_to(top).parts
        for index, part in enumerate(parts):
            following = os.open(part, flags if index == len(parts) - 1 else DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = following
    except BaseException:
        os.close(fd)
        raise
    return fd


def daemon_base(path: Path) -> Path:
    """The MPS base directory of ``path`` (``<base>/<daemon_id>/...``): what is above its last component of
    the driver's daemon-id form; ``path``'s parent if it has none (a path the driver did not name)."""
    for index in range(len(path.parts) - 1, 0, -1):
        if DRIVER_DAEMON_DIR_NAME.fullmatch(path.parts[index]):
            return Path(*path.parts[:index])
    return path.parent


def open_below_base(path: Path, flags: int, mode: int = 0o600) -> int:
    """Open the file ``path`` under an MPS base directory, following no link below the base (O_NOFOLLOW)."""
    parent = open_dir_below(daemon_base(path), path.parent)
    try:
        return os.open(path.name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=parent)
    finally:
        os.close(parent)


class DaemonDirError(MpsError):
    """A daemon directory could not be prepared or removed; the message says which and why."""


@dataclass(frozen=True)
class RestartState:
    count: int  # failed starts in a row (a daemon a client stopped after a clean start does not count)
    last_at: float  # wall-clock time of the latest failed start


def driver_daemon_ids(base_dir: Path) -> list[str]:
    """Names of real directories (no symlinks) under ``base_dir`` that have the driver's daemon-id form."""
    try:
        entries = list(os.scandir(base_dir))
    except FileNotFoundError:
        return []
    return sorted(
        e.name for e in entries if DRIVER_DAEMON_DIR_NAME.fullmatch(e.name) and e.is_dir(follow_symlinks=False)
    )


def ensure_real_dir(path: Path, mode: int) -> None:
    """Make ``path`` a directory with ``mode``, keeping it (and its inode) if it already is one.

    Anything else in its place (a symlink, a file) is removed first, never followed.
    """
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        st = None
    if st is None:
        os.mkdir(path, mode)
    # mkdir's mode is cut by the umask; a kept directory may have been chmodded.
    os.chmod(path, mode, follow_symlinks=False)


def clear_dir(path: Path) -> None:
    """Remove everything inside ``path`` but keep ``path`` itself, so bind mounts of it stay valid.

    Entries are judged by ``lstat``: a symlink is unlinked, never followed, so whatever a tenant
    planted cannot make this remove files elsewhere.
    """
    fd = open_dir_below(daemon_base(path), path)
    try:
        _clear_tree(fd)
    finally:
        os.close(fd)


def _clear_tree(fd: int) -> None:
    """Empty the directory ``fd`` (see :func:`clear_dir`).

    Tenants write here (shm/): a tree nested past the recursion limit made shutil.rmtree raise
    RecursionError, so a subdirectory's subdirectories are moved up here, not descended into.
    """
    pending = _clear_fd(fd)
    queued, fresh_names = set(pending), (f".tessera-rm-{n}" for n in itertools.count(1))
    while pending:
        name = pending.pop()
        queued.discard(name)
        sub = _open_subdir(fd, name)
        if sub is None:
            continue
        try:
            for child in _clear_fd(sub):
                target = _move_up(sub, child, fd, fresh_names, taken=queued)
                pending.append(target)
                queued.add(target)
        finally:
            os.close(sub)
        os.rmdir(name, dir_fd=fd)


def _open_subdir(parent: int, name: str) -> int | None:
    """An fd of the directory ``name`` in ``parent``, not following a link; None when it is gone or is no
    directory any more (swapped for a symlink or a file since it was listed: that is unlinked)."""
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
    os.unlink(name, dir_fd=parent)
    return None


def _move_up(sub: int, name: str, parent: int, fresh_names: Iterator[str], taken: set[str]) -> str:
    """Rename ``name`` from ``sub`` into ``parent`` under the first fresh name free there and not ``taken`` (the
    names still queued: a directory renamed onto one of them, if empty, would silently replace it)."""
    while True:
        target = next(fresh_names)
        if target in taken:
            continue
        try:
            os.rename(name, target, src_dir_fd=sub, dst_dir_fd=parent)
            return target
        except OSError as exc:  # a tenant's entry has that name: try the next one
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise


def _clear_fd(fd: int) -> list[str]:
    """Unlink everything in ``fd`` but directories (symlinks are unlinked, never followed); their names."""
    with os.scandir(fd) as entries:
        found = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
    for name, is_dir in found:
        if not is_dir:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)
    return [name for name, is_dir in found if is_dir]


def remove_daemon_dir(daemon_dir: Path) -> None:
    """Remove a daemon's directory. Its launcher unmounts a tmpfs on shm/ first (shmmount.py); one still
    mounted (the launcher could not) is emptied and the directory left for the next start's sweep.
    Anything but a directory in its place (a link planted there) is removed, never followed."""
    try:
        base = open_dir_below(daemon_base(daemon_dir), daemon_dir.parent)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise DaemonDirError(f"could not remove {daemon_dir}: {exc}") from exc
    try:
        if _remove_entry(base, daemon_dir.name):
            os.rmdir(daemon_dir.name, dir_fd=base)
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.EBUSY:  # EBUSY: a mount there after all; the next start's sweep tries again
            raise DaemonDirError(f"could not remove {daemon_dir}: {exc}") from exc
    finally:
        os.close(base)


def _remove_entry(parent: int, name: str) -> bool:
    """Empty the directory ``name`` in ``parent`` (its shm/ first); unlink it if it is no directory. True
    when the directory is left empty, False when its shm/ is still a mount point."""
    if not stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
        os.unlink(name, dir_fd=parent)
        return False
    fd = os.open(name, DIR_FLAGS, dir_fd=parent)
    try:
        with contextlib.suppress(FileNotFoundError):
            if os.stat("shm", dir_fd=fd, follow_symlinks=False).st_dev != os.fstat(fd).st_dev:
                shm = os.open("shm", DIR_FLAGS, dir_fd=fd)
                try:
                    _clear_tree(shm)
                finally:
                    os.close(shm)
                return False  # still mounted: the sweep at the next start asks the launcher again
        _clear_tree(fd)
        return True
    finally:
        os.close(fd)


def read_restart_state(daemon_dir: Path) -> RestartState:
    try:
        fd = open_below_base(daemon_dir / RESTART_STATE_NAME, os.O_RDONLY)
    except (OSError, ValueError):
        return RestartState(count=0, last_at=0.0)
    try:
        data = json.loads(os.read(fd, 4096))
        return RestartState(count=max(int(data["count"]), 0), last_at=float(data["last_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return RestartState(count=0, last_at=0.0)
    finally:
        os.close(fd)


def write_restart_state(daemon_dir: Path, state: RestartState) -> None:
    # Losing the last restart to a power failure only shortens one backoff: no fsync. Written through the
    # daemon directory's fd, so a link planted in its place cannot send the write elsewhere.
    data = json.dumps({"count": state.count, "last_at": state.last_at}).encode()
    directory = open_dir_below(daemon_base(daemon_dir), daemon_dir)
    temp = f".{RESTART_STATE_NAME}.{os.getpid()}.tmp"
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=directory)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.replace(temp, RESTART_STATE_NAME, src_dir_fd=directory, dst_dir_fd=directory)
    finally:
        os.close(directory)


def restart_delay(state: RestartState, base: float, cap: float, now: float | None = None) -> float:
    """Seconds to wait before the next start: 0 without failed starts, then ``base`` doubling per failed
    start up to ``cap`` (``restarts.py``). A failure more than twice ``cap`` ago no longer counts.
    """
    now = time.time() if now is None else now
    if state.count == 0 or now - state.last_at > 2 * cap:
        return 0.0
    # The exponent is bounded: a daemon that keeps crashing counts past 1000 in days, and float(2**1024)
    # overflows. ``cap`` also bounds the result: a wall clock set back leaves ``last_at`` in the future.
    wait = min(base * 2.0 ** min(state.count - 1, 64), cap)
    return float(min(max(state.last_at + wait - now, 0.0), wait))


def next_restart_state(state: RestartState, cap: float, now: float) -> RestartState:
    count = 0 if now - state.last_at > 2 * cap else state.count
    return RestartState(count=count + 1, last_at=now)


def trim_log(path: Path, max_bytes: int) -> bool:
    """Empty the daemon's log once it passes ``max_bytes``; True if it did. The daemon appends to it
    (O_APPEND, ``launch.py``), so its next line lands at the new end; the limit watcher's read-backs
    would otherwise grow it by megabytes a day."""
    try:
        fd = open_below_base(path, os.O_WRONLY)
    except (OSError, ValueError):
        return False
    try:
        if os.fstat(fd).st_size <= max_bytes:
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"[log emptied by the driver: it passed {max_bytes} bytes]\n".encode())
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def log_tail(path: Path, lines: int) -> str:
    """The last ``lines`` lines of a daemon's log, for an error message (never through a symlink)."""
    try:
        fd = open_below_base(path, os.O_RDONLY)
        with os.fdopen(fd, encoding="utf-8", errors="replace") as f:
            found = f.read().splitlines()
    except (OSError, ValueError):
        return f"\n(no {path})"
    tail = "\n".join(found[-lines:])
    return f"\nlast {min(len(found), lines)} lines of {path}:\n{tail}"
