"""Locating NVIDIA driver executables under the driver root, and the environment to run them in.

The plugin container usually sees the host's driver installation mounted at a driver root
(``nvidiaDriverRoot`` in the Helm chart, ``--driver-root`` on the command line) rather than at
``/``. Its binaries then need that root's library directories to find ``libnvidia-ml.so.1``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

# Where driver installers put executables, relative to the driver root, in search order.
BIN_DIRS: tuple[str, ...] = ("usr/bin", "usr/local/nvidia/bin", "bin", "usr/sbin")
# Where they put libnvidia-ml and friends, relative to the driver root.
LIB_DIRS: tuple[str, ...] = ("usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "lib64")


class BinaryNotFound(Exception):
    """A driver executable is not under the configured driver root."""


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


def driver_env(driver_root: Path, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for driver subprocesses: ``base`` (default: ours) plus the driver root's dirs.

    With the driver at ``/`` the system defaults already apply, so nothing is added.
    """
    env = dict(os.environ if base is None else base)
    if driver_root.resolve() == Path("/"):
        return env
    bin_dirs = [str(driver_root / d) for d in BIN_DIRS if (driver_root / d).is_dir()]
    lib_dirs = [str(driver_root / d) for d in LIB_DIRS if (driver_root / d).is_dir()]
    _prepend(env, "PATH", bin_dirs)
    _prepend(env, "LD_LIBRARY_PATH", lib_dirs)
    return env


def _prepend(env: dict[str, str], key: str, dirs: list[str]) -> None:
    if not dirs:
        return
    existing = env.get(key, "")
    env[key] = ":".join([*dirs, existing] if existing else dirs)
