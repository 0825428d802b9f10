"""Helpers for the per-daemon /dev/shm tmpfs tests: can this machine mount, what is mounted, and cleanup."""

from __future__ import annotations

import contextlib
import errno
import functools
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from driver.gpu.mps.shmmount import mount_tmpfs, unmount_all
from driver.units import MIB, TIB


@functools.cache
def tmpfs_mount_problem() -> str | None:
    """Why a tmpfs cannot be mounted here (a skip reason), or None if it can."""
    with tempfile.TemporaryDirectory(prefix="tshm-probe-") as scratch:
        try:
            mount_tmpfs(Path(scratch), 64 * MIB)
        except OSError as exc:
            return (f"mounting a tmpfs is not permitted here ({errno.errorcode.get(exc.errno or 0, '?')}: "
                    f"{exc.strerror}); the per-daemon /dev/shm tmpfs needs CAP_SYS_ADMIN")
        unmount_all(Path(scratch))
    return None


@dataclass(frozen=True)
class Mount:
    point: Path
    fstype: str
    options: frozenset[str]  # per-mount options (nosuid, nodev, ...)
    super_options: frozenset[str]  # the file system's (size=..., mode=...)


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal.
    return field.encode().decode("unicode_escape") if "\\" in field else field


def mounts_under(top: Path) -> list[Mount]:
    """Every mount in this process's namespace at or below ``top``, from /proc/self/mountinfo."""
    found = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split()
        separator = fields.index("-")
        point = Path(_unescape(fields[4]))
        if point == top or point.is_relative_to(top):
            found.append(Mount(point, fields[separator + 1], frozenset(fields[5].split(",")),
                               frozenset(fields[separator + 3].split(","))))
    return found


def size_option(size: int) -> str:
    """How mountinfo shows a tmpfs's size (in KiB)."""
    return f"size={size // 1024}k"


def unmount_everything_under(top: Path) -> None:
    """Unmount whatever a test left mounted below ``top``, deepest first, so no mount outlives it."""
    for mount in sorted(mounts_under(top), key=lambda m: len(m.point.parts), reverse=True):
        with contextlib.suppress(OSError):
            unmount_all(mount.point)


@contextlib.contextmanager
def no_mounts_left(top: Path) -> Iterator[None]:
    try:
        yield
    finally:
        unmount_everything_under(top)


def fill_until_full(directory: Path, chunk: int = MIB) -> int:
    """Write files into ``directory`` until the file system is full (ENOSPC), as a tenant filling its
    /dev/shm would; returns the bytes written. Any other error is raised."""
    block = b"\xa5" * chunk
    written = 0
    fd = os.open(directory / "fill", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        while written < TIB:  # a bound, should the directory not be the small tmpfs it is meant to be
            try:
                written += os.write(fd, block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                return written
    finally:
        os.close(fd)
    raise AssertionError(f"{directory} took {written} bytes without filling up")


def write_ok(directory: Path, size: int = MIB) -> None:
    """Write (and read back) ``size`` bytes in ``directory``; raises if the file system refuses."""
    path = directory / f"probe-{os.getpid()}"
    path.write_bytes(b"\x5a" * size)
    assert path.stat().st_size == size
    path.unlink()
