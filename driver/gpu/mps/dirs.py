"""The on-disk side of MPS daemons: their directories, kept safe from what tenants plant in them.

Layout under the MPS base directory (the driver's own; tenants never see it whole)::

    <base>/<daemon_id>/pipe/           CUDA_MPS_PIPE_DIRECTORY, bind-mounted read-only into clients
    <base>/<daemon_id>/log/            CUDA_MPS_LOG_DIRECTORY (control.log)
    <base>/<daemon_id>/shm/            a per-daemon /dev/shm, when the launcher can give one
    <base>/<daemon_id>/restarts.json   restart backoff state

The shared MPS ``/dev/shm`` directory lives outside ``<base>``, so it can never be taken for a
daemon directory. Tenants write into ``shm/`` (and, with older mounts, ``pipe/``): everything here
uses ``lstat`` and never follows a symlink found inside those directories.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from cdi.atomicfile import write_atomic

# The names the driver gives its daemons (driver/gpu/claimplan.py: plan_daemon_id,
# claim_daemon_id). Anything else under the base directory is not the driver's to stop or remove.
DRIVER_DAEMON_DIR_NAME = re.compile(r"^(plan-[0-9a-f]{12}|claim-[0-9a-f]{12}-[0-9]{1,4})$")
RESTART_STATE_NAME = "restarts.json"


class DaemonDirError(Exception):
    """A daemon directory could not be prepared or removed; the message says which and why."""


@dataclass(frozen=True)
class RestartState:
    count: int  # restarts since the daemon last ran long enough to be called stable
    last_at: float  # wall-clock time of the latest restart attempt


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
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        pending = _clear_fd(fd)
        queued, hoisted = set(pending), 0
        while pending:
            name = pending.pop()
            queued.discard(name)
            # Tenants write here (shm/): a tree nested past the recursion limit made shutil.rmtree raise
            # RecursionError, so a subdirectory's subdirectories are moved up here, not descended into.
            try:
                sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            except FileNotFoundError:
                continue
            except OSError as exc:  # swapped for a symlink or a file since it was listed: unlink that
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                os.unlink(name, dir_fd=fd)
                continue
            try:
                for child in _clear_fd(sub):
                    while True:
                        hoisted += 1
                        target = f".tessera-rm-{hoisted}"
                        if target in queued:
                            continue
                        try:
                            os.rename(child, target, src_dir_fd=sub, dst_dir_fd=fd)
                            break
                        except OSError as exc:  # a tenant's entry has that name: try the next one
                            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                                raise
                    pending.append(target)
                    queued.add(target)
            finally:
                os.close(sub)
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)


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
    """Remove a daemon's directory. A mounted per-daemon shm (its launcher's) is emptied and left."""
    shm = daemon_dir / "shm"
    try:
        if shm.is_dir() and not shm.is_symlink():
            clear_dir(shm)
            try:
                shm.rmdir()
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                return  # still mounted: the launcher that mounted it unmounts it, and removes the rest later
        clear_dir(daemon_dir)
        daemon_dir.rmdir()
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise DaemonDirError(f"could not remove {daemon_dir}: {exc}") from exc


def read_restart_state(daemon_dir: Path) -> RestartState:
    try:
        fd = os.open(daemon_dir / RESTART_STATE_NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return RestartState(count=0, last_at=0.0)
    try:
        data = json.loads(os.read(fd, 4096))
        return RestartState(count=max(int(data["count"]), 0), last_at=float(data["last_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return RestartState(count=0, last_at=0.0)
    finally:
        os.close(fd)


def write_restart_state(daemon_dir: Path, state: RestartState) -> None:
    # Losing the last restart to a power failure only shortens one backoff: no directory fsync.
    data = json.dumps({"count": state.count, "last_at": state.last_at}).encode()
    write_atomic(daemon_dir / RESTART_STATE_NAME, data, mode=0o600, durable=False)


def restart_delay(state: RestartState, base: float, cap: float, now: float | None = None) -> float:
    """Seconds to wait before the next restart: 0 for the first, then ``base`` doubling up to ``cap``.

    A daemon whose last restart is more than twice ``cap`` ago counts as stable again.
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
