"""What the MPS host accepts: its configuration, checked at start, and each request, checked before acting.

The host is privileged and starts processes on the plugin's behalf, so a request is trusted no
further than its schema: the daemon id must be a safe name, the devices GPU-/MIG- UUIDs (a comma
would split CUDA_VISIBLE_DEVICES), and every directory an existing one strictly inside the MPS
directory the host was given, reached without symbolic links and written without '..'.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from driver.gpu.errors import DriverError
from driver.gpu.mps.hostcmd import HostMode, Tools, inside_root
from driver.gpu.mps.launch import DaemonLaunch
from driver.gpu.mps.model import SUN_PATH_MAX_BYTES, check_daemon_id

_DEVICE_UUID = re.compile(r"^(GPU|MIG)-[A-Za-z0-9/-]+$")


class HostError(DriverError):
    """The host cannot start as configured; the message names the flag or path."""


class LaunchRefused(DriverError, ValueError):
    """A request the host will not act on; the message says which field and why."""


@dataclass(frozen=True)
class HostConfig:
    socket_path: Path
    mps_dir: Path  # the plugin's <state dir>/mps: every pipe, log and per-daemon shm dir is inside
    mode: HostMode
    tools: Tools = field(default_factory=Tools)
    start_timeout: float = 5.0  # until the launched process runs the daemon binary and made its socket
    stop_grace: float = 5.0  # SIGTERM to SIGKILL for the daemons when the host stops
    read_timeout: float = 5.0  # for a client to send its request


# -- validation ---------------------------------------------------------------------------------


def check_launch(request: DaemonLaunch, mps_dir: Path) -> None:
    """Raise :class:`LaunchRefused` unless ``request`` is one the host may act on."""
    try:
        check_daemon_id(request.daemon_id)
    except ValueError as exc:
        raise LaunchRefused(str(exc)) from exc
    for uuid in request.visible_devices:
        if not _DEVICE_UUID.fullmatch(uuid):
            raise LaunchRefused(f"visible_devices entry {uuid!r} is not a GPU-... or MIG-... UUID")
    if len(set(request.visible_devices)) != len(request.visible_devices):
        raise LaunchRefused(f"visible_devices {request.visible_devices} lists a device more than once")
    _check_dir_inside("pipe_dir", request.pipe_dir, mps_dir)
    _check_dir_inside("log_dir", request.log_dir, mps_dir)
    if request.shm_dir is not None:
        _check_dir_inside("shm_dir", request.shm_dir, mps_dir)
    control = len(os.fsencode(request.pipe_dir / "control"))
    if control > SUN_PATH_MAX_BYTES:
        raise LaunchRefused(f"pipe_dir {request.pipe_dir} is too long: its control socket needs {control} bytes, "
                            f"Unix sockets allow {SUN_PATH_MAX_BYTES}")
    # Each directory must be the daemon's own: a request naming another daemon's pipe or shm dir
    # would start a second daemon there, or hand one daemon's clients another's /dev/shm.
    daemon_dir = mps_dir / request.daemon_id
    for name, path, leaf in (("pipe_dir", request.pipe_dir, "pipe"), ("log_dir", request.log_dir, "log"),
                             ("shm_dir", request.shm_dir, "shm")):
        if path is not None and path != daemon_dir / leaf:
            raise LaunchRefused(f"{name} {path} is not {daemon_dir / leaf}, the {leaf} directory of daemon "
                                f"{request.daemon_id}")


def _check_dir_inside(name: str, path: Path, base: Path) -> None:
    text = str(path)
    if "\0" in text:  # the OS calls below would raise ValueError: refuse it as the bad field it is
        raise LaunchRefused(f"{name} {text!r} contains a NUL character")
    if not path.is_absolute():
        raise LaunchRefused(f"{name} {text!r} must be an absolute path")
    if os.path.normpath(text) != text:
        raise LaunchRefused(f"{name} {text!r} must be a normalised path (no '..')")
    if path == base or not path.is_relative_to(base):
        raise LaunchRefused(f"{name} {text} is not inside the MPS directory {base} this host serves")
    expected = os.path.join(os.path.realpath(base), str(path.relative_to(base)))
    real = os.path.realpath(path)
    if real != expected:
        raise LaunchRefused(f"{name} {text} goes through a symbolic link (it leads to {real})")
    if not stat.S_ISDIR(lstat_mode(path)):
        raise LaunchRefused(f"{name} {text} is not an existing directory (the plugin creates it before asking)")


def lstat_mode(path: Path) -> int:
    try:
        return os.lstat(path).st_mode
    except OSError:
        return 0


def check_config(config: HostConfig) -> None:
    """Raise :class:`HostError` naming the flag if the host cannot work as configured."""
    if not config.mps_dir.is_absolute():
        raise HostError(f"--mps-dir {config.mps_dir} must be an absolute path")
    if not config.mode.driver_root.is_dir():
        raise HostError(f"--driver-root {config.mode.driver_root} is not a directory")
    if config.mode.shm_tmpfs and not config.mode.private_shm:
        raise HostError("--shm-tmpfs needs --private-shm: each daemon must see its own tmpfs as /dev/shm")
    wrapping = config.mode.chroot or config.mode.private_shm
    tools = [config.tools.unshare, config.tools.sh, config.tools.mount] if wrapping else []
    if config.mode.chroot:
        tools.append(config.tools.chroot)
    for tool in tools:
        if not os.access(tool, os.X_OK):
            flag = "--chroot" if config.mode.chroot else "--private-shm"
            raise HostError(f"{flag} needs {tool} (util-linux unshare and mount, a shell, coreutils chroot)")
    if config.mode.chroot:
        config.mps_dir.mkdir(parents=True, exist_ok=True)
        make_mount_point_in_root(config)


def make_mount_point_in_root(config: HostConfig) -> None:
    """Create ``<driver root><mps dir>``, where each chrooted daemon gets the MPS directory bound.

    Done at start and again before each launch: a restarted driver container brings a fresh root.
    """
    inside = inside_root(config.mps_dir, config.mode.driver_root)
    try:
        inside.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise HostError(f"--chroot: cannot create {inside}, where daemons inside the driver root see the MPS "
                        f"directory: {exc}; the MPS host needs the driver root mounted writable") from exc


def default_tools() -> Tools:
    """The tools as found on this host's PATH (falling back to the usual places)."""
    defaults = Tools()
    return Tools(unshare=shutil.which("unshare") or defaults.unshare, sh=shutil.which("sh") or defaults.sh,
                 mount=shutil.which("mount") or defaults.mount, chroot=shutil.which("chroot") or defaults.chroot)
