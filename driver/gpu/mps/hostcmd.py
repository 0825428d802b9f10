"""The command line and environment the MPS host runs a control daemon with (pure functions).

Three shapes: plain (``<driver root>/usr/bin/nvidia-cuda-mps-control -f`` with the driver root's binaries and
NVIDIA libraries on PATH/LD_LIBRARY_PATH, as driver/gpu/host/binaries.py runs the plugin's tools); ``--chroot``
into the driver root, with a plain environment; and, whenever something must be bind-mounted before the daemon
starts (the MPS directory into the root, a directory over ``/dev/shm``), a mount namespace of its own (util-linux
``unshare --mount --propagation slave``). Why each: docs/sharing.md, "Where MPS daemons live".

Every step ``exec``s the next (unshare without ``--fork``, ``exec`` in the shell, chroot(8)), so
the PID the host starts is the daemon's PID, and the paths travel as positional arguments, never
inside the shell text.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from driver.gpu.claimconfig.quantity import DEFAULT_SHM_SIZE
from driver.gpu.mps.launch import DaemonLaunch, control_args, control_env

# PATH inside the driver root, where the container's PATH means nothing.
ROOT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# $1 = mount(8); then source/target pairs up to "--" (paths are absolute, so never "--"); then the
# command to become.
WRAP_SCRIPT = 'm=$1; shift; while [ "$1" != -- ]; do "$m" --bind -- "$1" "$2"; shift 2; done; shift; exec "$@"'
WRAP_NAME = "tessera-mps-wrap"  # $0 of the wrapper shell: what `ps` shows until the exec
HOST_SHM = Path("/dev/shm")


@dataclass(frozen=True)
class Tools:
    """Absolute paths of the host container's own tools (resolved once at start)."""

    unshare: str = "/usr/bin/unshare"
    sh: str = "/bin/sh"
    mount: str = "/usr/bin/mount"
    chroot: str = "/usr/sbin/chroot"


@dataclass(frozen=True)
class HostMode:
    """How the host runs daemons; see the module docstring."""

    driver_root: Path
    chroot: bool = False
    private_shm: bool = False
    # Each daemon's shm directory is a tmpfs of its own that the host mounts (shmmount.py); needs private_shm.
    shm_tmpfs: bool = False
    shm_size: int = DEFAULT_SHM_SIZE  # bytes, for a request that names no size (an older plugin's)
    host_root: Path = Path("/")  # where /proc is: the kernel's MIG capability numbers
    dev_root: Path = Path("/")  # the root whose dev/ this host (and its unchrooted daemons) open devices through


def daemon_dev_root(mode: HostMode) -> Path:
    """The root whose dev/ a daemon opens its MIG devices through: the driver root's when chrooted into it."""
    return mode.driver_root if mode.chroot else mode.dev_root


def binary_inside_root(binary: Path, driver_root: Path) -> str:
    """``binary`` (found under ``driver_root``) as a path seen after ``chroot driver_root``."""
    return "/" + str(binary.relative_to(driver_root))


def shm_source(request: DaemonLaunch, mode: HostMode) -> Path | None:
    """What to bind over the daemon's /dev/shm; None: leave it (the host's own /dev/shm)."""
    if mode.private_shm and request.shm_dir is not None:
        return request.shm_dir
    if mode.chroot:
        return HOST_SHM
    return None


def replied_shm_dir(request: DaemonLaunch, mode: HostMode) -> Path | None:
    """The host directory the daemon sees as /dev/shm, for the reply (None: the shared MPS shm)."""
    return request.shm_dir if mode.private_shm and request.shm_dir is not None else None


def inside_root(path: Path, driver_root: Path) -> Path:
    """Where the host sees ``path`` as the chrooted daemon will: ``<driver root><path>``."""
    return driver_root / path.relative_to("/")


def bind_mounts(request: DaemonLaunch, mps_dir: Path, mode: HostMode) -> list[tuple[Path, Path]]:
    """``(source, target)`` bind mounts, in order, for the daemon's own mount namespace."""
    binds: list[tuple[Path, Path]] = []
    if mode.chroot:
        binds.append((mps_dir, inside_root(mps_dir, mode.driver_root)))
    source = shm_source(request, mode)
    if source is not None:
        binds.append((source, inside_root(HOST_SHM, mode.driver_root) if mode.chroot else HOST_SHM))
    return binds


def daemon_argv(request: DaemonLaunch, binary: Path, mps_dir: Path, mode: HostMode, tools: Tools) -> list[str]:
    """The full command line; ``binary`` is where it was found under the driver root."""
    args = control_args(request)  # the same as LocalLauncher's, so both run the daemon alike
    argv = ([tools.chroot, str(mode.driver_root), binary_inside_root(binary, mode.driver_root), *args] if mode.chroot
            else [str(binary), *args])
    binds = bind_mounts(request, mps_dir, mode)
    if not binds:
        return argv
    pairs = [str(p) for pair in binds for p in pair]
    return [tools.unshare, "--mount", "--propagation", "slave", "--", tools.sh, "-euc", WRAP_SCRIPT, WRAP_NAME,
            tools.mount, *pairs, "--", *argv]


def daemon_env(request: DaemonLaunch, mode: HostMode, driver_env: Mapping[str, str]) -> dict[str, str]:
    """The environment: ``driver_env`` (the host's, with the driver root's PATH and libraries) when
    not chrooting; only a plain PATH otherwise. Plus the daemon's own variables (``control_env``)."""
    base = {"PATH": ROOT_PATH} if mode.chroot else dict(driver_env)
    return {**base, **control_env(request)}
