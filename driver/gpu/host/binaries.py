"""Finding NVIDIA driver executables and libraries under the driver root, and running the executables.

The plugin container usually sees the host's driver installation mounted at a driver root
(``nvidiaDriverRoot`` in the Helm chart, ``--driver-root`` on the command line) rather than at
``/``. Its binaries then need the driver's libraries (``libnvidia-ml.so.1``, ``libcuda.so.1``),
but they run with the container's ``ld.so`` and libc: putting the driver root's whole library
directories on ``LD_LIBRARY_PATH`` would load the host's libc too, and a glibc mismatch breaks
them. So only NVIDIA's libraries are exposed, through a private directory of symlinks.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
import shlex
import stat
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from driver.gpu.errors import DriverError

# Where driver installers put executables, relative to the driver root, in search order.
BIN_DIRS: tuple[str, ...] = ("usr/bin", "usr/local/nvidia/bin", "bin", "usr/sbin")
# Where they put libnvidia-ml and friends, relative to the driver root, in search order.
LIB_DIRS: tuple[str, ...] = (
    "usr/lib/x86_64-linux-gnu",
    "usr/lib/aarch64-linux-gnu",
    "usr/lib64",
    "lib64",
    "usr/lib",
    "lib/x86_64-linux-gnu",
)
# The driver's own libraries: everything NVIDIA's binaries load from the driver, and nothing else.
NVIDIA_LIBRARY_PATTERNS: tuple[str, ...] = ("libnvidia-*.so*", "libcuda.so*")
LIBRARY_LINK_DIR_PREFIX = "tessera-nvidia-libs-"
# The kernel's own limit on symlink hops in one lookup.
_MAX_SYMLINK_HOPS = 40


class BinaryNotFound(DriverError):
    """A driver executable is not under the configured driver root."""


class BinaryFailed(DriverError):
    """A driver executable could not start or exited non-zero; the message has the command and its output."""


class BinaryTimedOut(BinaryFailed):
    """A driver executable did not finish within its timeout."""


class DriverLibrariesUnusable(BinaryFailed):
    """The directory exposing the driver's libraries to its executables cannot be built."""


def find_binary(driver_root: Path, name: str) -> Path:
    """Return the first executable called ``name`` in the driver root's bin directories."""
    if not name or "/" in name:
        raise ValueError(f"binary name must be a bare file name, got {name!r}")
    candidates = [driver_root / bin_dir / name for bin_dir in BIN_DIRS]
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    looked_in = ", ".join(str(c.parent) for c in candidates)
    raise BinaryNotFound(
        f"{name} not found as an executable under driver root {driver_root} (looked in {looked_in}); "
        "set the nvidiaDriverRoot Helm value (--driver-root flag) to where the NVIDIA driver is installed"
    )


def resolve_in_root(driver_root: Path, path: Path) -> Path | None:
    """The regular file ``path`` leads to, following symlinks as the host would; None if it leads nowhere.

    A host's library links may be absolute (``/usr/lib64/libcuda.so.580.95.05``); seen from the
    container such a target is under the driver root, not under ``/``.
    """
    current = path
    for _ in range(_MAX_SYMLINK_HOPS):
        if not current.is_symlink():
            return current if current.is_file() else None
        try:
            target = os.readlink(current)
        except OSError:
            return None
        current = driver_root / target.lstrip("/") if os.path.isabs(target) else current.parent / target
    return None


def find_driver_library(driver_root: Path, name: str) -> Path | None:
    """The file that library ``name`` (e.g. ``libnvidia-ml.so.1``) is in the first lib dir that has it."""
    for lib_dir in LIB_DIRS:
        found = resolve_in_root(driver_root, driver_root / lib_dir / name)
        if found is not None:
            return found
    return None


def nvidia_library_dir(driver_root: Path, links_parent: Path | None = None) -> Path | None:
    """A directory of symlinks to the driver root's NVIDIA libraries only; None if it has none.

    It lives in ``links_parent`` (default: the temporary directory), named after a hash of the
    driver root. It is brought up to date on every call, so a driver upgrade on the host is picked
    up, and links are replaced atomically, so concurrent callers never see a missing one.
    """
    wanted = _nvidia_libraries(driver_root)
    if not wanted:
        return None
    link_dir = library_link_dir(driver_root, links_parent)
    parent = link_dir.parent
    try:
        _make_own_dir(link_dir)
        for name, target in wanted.items():
            _ensure_symlink(link_dir / name, target)
        for entry in os.listdir(link_dir):
            # Dot names are other callers' links in the middle of being renamed into place.
            if entry not in wanted and not entry.startswith("."):
                with contextlib.suppress(FileNotFoundError):
                    (link_dir / entry).unlink()
    except OSError as exc:
        raise DriverLibrariesUnusable(
            f"cannot build {link_dir}, the directory exposing the NVIDIA libraries of driver root {driver_root}: "
            f"{exc}; the plugin needs a writable {parent}"
        ) from exc
    return link_dir


def library_link_dir(driver_root: Path, links_parent: Path | None = None) -> Path:
    """Where :func:`nvidia_library_dir` keeps the links for ``driver_root`` (a throwaway root's must go with it)."""
    parent = Path(tempfile.gettempdir()) if links_parent is None else links_parent
    digest = hashlib.sha256(os.fsencode(driver_root.resolve())).hexdigest()[:12]
    return parent / f"{LIBRARY_LINK_DIR_PREFIX}{digest}"


def _nvidia_libraries(driver_root: Path) -> dict[str, Path]:
    """File name -> the file it leads to, for NVIDIA libraries in the lib dirs; the first lib dir wins."""
    found: dict[str, Path] = {}
    for lib_dir in LIB_DIRS:
        directory = driver_root / lib_dir
        if not directory.is_dir():
            continue
        for pattern in NVIDIA_LIBRARY_PATTERNS:
            for candidate in sorted(directory.glob(pattern)):
                if candidate.name in found:
                    continue
                target = resolve_in_root(driver_root, candidate)
                if target is not None:
                    found[candidate.name] = target
    return found


def _make_own_dir(directory: Path) -> None:
    directory.mkdir(mode=0o755, parents=True, exist_ok=True)
    info = os.lstat(directory)
    # The temporary directory may be shared: a directory planted there by someone else could
    # point our binaries at libraries of their choosing.
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
        raise PermissionError(f"{directory} exists but is not a directory owned by this user")
    if info.st_mode & 0o022:  # a umask that lets the group write
        directory.chmod(0o755)


def _ensure_symlink(link: Path, target: Path) -> None:
    with contextlib.suppress(OSError):
        if os.readlink(link) == str(target):
            return
    staging = link.with_name(f".{link.name}.{secrets.token_hex(6)}")
    os.symlink(target, staging)
    os.replace(staging, link)


def driver_env(
    driver_root: Path, base: Mapping[str, str] | None = None, links_parent: Path | None = None
) -> dict[str, str]:
    """Environment for driver subprocesses: ``base`` (default: ours) plus the driver root's bin dirs on
    ``PATH`` and its NVIDIA libraries (see :func:`nvidia_library_dir`) on ``LD_LIBRARY_PATH``.

    With the driver at ``/`` the system defaults already apply, so nothing is added.
    Raises :class:`DriverLibrariesUnusable` if the library directory cannot be built.
    """
    env = dict(os.environ if base is None else base)
    if driver_root.resolve() == Path("/"):
        return env
    _prepend(env, "PATH", [str(driver_root / d) for d in BIN_DIRS if (driver_root / d).is_dir()])
    library_dir = nvidia_library_dir(driver_root, links_parent)
    if library_dir is not None:
        _prepend(env, "LD_LIBRARY_PATH", [str(library_dir)])
    return env


def _prepend(env: dict[str, str], key: str, dirs: list[str]) -> None:
    if not dirs:
        return
    existing = env.get(key, "")
    env[key] = ":".join([*dirs, existing] if existing else dirs)


def run_binary(
    command: Sequence[str],
    *,
    env: Mapping[str, str],
    timeout: float,
    stdin_text: str | None = None,
    label: str | None = None,
) -> str:
    """Run ``command`` to completion and return its stdout, stripped.

    ``stdin_text`` is fed to it; without it stdin is /dev/null, so a tool that prompts cannot
    hang. Failures raise :class:`BinaryFailed` (:class:`BinaryTimedOut` for the timeout) naming
    the command (``label``, default the command line in backticks), the exit code and what it
    said: stderr, else stdout, as tools differ in where their errors go.
    """
    label = label or f"`{shlex.join(command)}`"
    try:
        done = subprocess.run(
            list(command),
            input=stdin_text,
            stdin=subprocess.DEVNULL if stdin_text is None else None,
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as exc:
        raise BinaryTimedOut(f"{label} did not finish within {timeout:g}s") from exc
    except OSError as exc:
        raise BinaryFailed(f"{label} could not run: {exc}") from exc
    if done.returncode != 0:
        said = done.stderr.strip() or done.stdout.strip() or "(no output)"
        raise BinaryFailed(f"{label} failed with exit code {done.returncode}: {said}")
    return done.stdout.strip()
