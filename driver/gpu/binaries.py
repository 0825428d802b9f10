"""Locating NVIDIA driver executables under the driver root, the environment to run them in, and running them.

The plugin container usually sees the host's driver installation mounted at a driver root
(``nvidiaDriverRoot`` in the Helm chart, ``--driver-root`` on the command line) rather than at
``/``. Its binaries then need that root's library directories to find ``libnvidia-ml.so.1``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

# Where driver installers put executables, relative to the driver root, in search order.
BIN_DIRS: tuple[str, ...] = ("usr/bin", "usr/local/nvidia/bin", "bin", "usr/sbin")
# Where they put libnvidia-ml and friends, relative to the driver root.
LIB_DIRS: tuple[str, ...] = ("usr/lib64", "usr/lib/x86_64-linux-gnu", "usr/lib/aarch64-linux-gnu", "lib64")


class BinaryNotFound(Exception):
    """A driver executable is not under the configured driver root."""


class BinaryFailed(Exception):
    """A driver executable could not start or exited non-zero; the message has the command and its output."""


class BinaryTimedOut(BinaryFailed):
    """A driver executable did not finish within its timeout."""


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
